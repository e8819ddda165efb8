"""Incremental decoding of HTTP/1.1 chunked bodies (RFC 9112 §7.1), for requests and answers.

Bytes arrive split anywhere (inside a size line, a chunk, its CRLF or the trailers); the
decoder keeps what it cannot use yet and hands back body bytes as soon as they are whole.
Chunk extensions and trailers are read and dropped.
"""

from __future__ import annotations

import re

MAX_SIZE_LINE_BYTES = 1024
# A size line: hex digits (16 at most: beyond, no body could be that big), then optional
# whitespace and extensions. Checked by one compiled match rather than byte by byte.
_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,16})[ \t]*(?:;[^\r\n]*)?\r\n")


class ChunkedError(ValueError):
    """The bytes are not a valid chunked body."""


class ChunkedTooLarge(ChunkedError):
    """A size line or the trailers are over their limit."""


class ChunkedDecoder:
    __slots__ = ("_state", "_remaining", "_pending", "_trailer_bytes", "max_trailer_bytes", "done")

    def __init__(self, max_trailer_bytes: int = 16384) -> None:
        self._state = "size"  # size -> data -> crlf -> size ... -> trailer
        self._remaining = 0
        self._pending = b""
        self._trailer_bytes = 0
        self.max_trailer_bytes = max_trailer_bytes
        self.done = False

    def whole_chunk(self, data: bytes) -> bytes | None:
        """The usual read of a stream, exactly one whole chunk from size line to CRLF: its
        data, with no list or tuple to build. None: anything else, for `feed`."""
        if self._state == "size" and not self._pending:
            match = _SIZE_LINE.match(data)
            if match is not None:
                start = match.end()
                stop = start + int(match.group(1), 16)
                if stop > start and len(data) == stop + 2 and data.endswith(b"\r\n"):
                    return data[start:stop]
        return None

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        """Decode `data`; returns the body pieces it completed and, once the body has ended
        (`done`), the bytes after it."""
        piece = self.whole_chunk(data)
        if piece is not None:
            return [piece], b""
        buf = self._pending + data if self._pending else data
        self._pending = b""
        pos, end_of_buf = 0, len(buf)
        out: list[bytes] = []
        while pos < end_of_buf:
            state = self._state
            if state == "data":
                take = min(self._remaining, end_of_buf - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = "crlf"
            elif state == "size":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if end_of_buf - pos > MAX_SIZE_LINE_BYTES:
                        raise ChunkedTooLarge("chunk size line too long")
                    break
                match = _SIZE_LINE.match(buf, pos, end + 2)
                if match is None:
                    size_text = bytes(buf[pos:min(end, pos + 20)])
                    raise ChunkedError(f"malformed chunk size {size_text!r}")
                self._remaining = int(match.group(1), 16)
                pos = end + 2
                self._state = "data" if self._remaining else "trailer"
            elif state == "crlf":
                if end_of_buf - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ChunkedError("missing CRLF after a chunk")
                pos += 2
                self._state = "size"
            else:  # trailer lines, up to an empty one
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if self._trailer_bytes + end_of_buf - pos > self.max_trailer_bytes:
                        raise ChunkedTooLarge("trailers too large")
                    break
                self._trailer_bytes += end + 2 - pos
                if end == pos:
                    self.done = True
                    return out, bytes(buf[end + 2:])
                if self._trailer_bytes > self.max_trailer_bytes:
                    raise ChunkedTooLarge("trailers too large")
                pos = end + 2
        self._pending = bytes(buf[pos:])
        return out, b""
