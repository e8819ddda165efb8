"""A small HTTP/1.1 client for talking to replicas, with a keep-alive pool per replica.

The general-purpose aiohttp client spends more CPU per request than the rest of the proxy put
together (request objects, URL parsing, cookie and redirect machinery, tracing hooks), and a
proxy needs none of that: it sends bytes it already has and relays the bytes it gets. This
client writes the request in one call and parses the status line, headers and body framing
(Content-Length, chunked, or until close) itself. Bodies are handed over as they arrive, with
backpressure: reading from the replica pauses while the client is slow to take them.

Whatever a replica sends in its head is relayed to clients, so the head is checked strictly
(RFC 9110/9112) before anything of it is believed: a lenient parse would let a broken or
compromised replica split responses or inject header lines into the client's answer.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

from balancer.wire.chunked import ChunkedDecoder, ChunkedError

MAX_HEAD_BYTES = 64 * 1024  # every interim 1xx head and the final one, together
# RFC 9110 §15.2 asks clients to take any number of 1xx answers; a replica that keeps sending
# them is stuck or hostile, and the proxy has nothing to gain from waiting on it.
MAX_INTERIM_RESPONSES = 16
PAUSE_ABOVE_BYTES = 256 * 1024
RESUME_BELOW_BYTES = 64 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})

# Compiled once: these run on every upstream answer. The head is decoded as latin-1, so
# obs-text (0x80-0xff) is one character each. Of the controls only tab is allowed, and CR and
# LF only as the CRLF that ends a line: that is what keeps a value from becoming a header.
_STATUS_LINE = re.compile(r"HTTP/1\.([0-9]) ([1-5][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?")
_FIELD = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*"
_FIELD_LINE = re.compile(_FIELD)
# One match for the whole header block instead of one per line; the line's own pattern is
# only needed to name the bad line in the error.
_HEADER_BLOCK = re.compile(rf"{_FIELD}(?:\r\n{_FIELD})*")
# 18 digits fit an int64 and stay far below int()'s limit on digit strings (ValueError).
_CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")


def _content_length(value: str) -> int:
    """RFC 9110 §8.6 lets a recipient take `42, 42` (a list of one repeated value) as 42;
    differing values leave the body's end unknown, so the answer cannot be framed at all."""
    if _CONTENT_LENGTH.fullmatch(value):
        return int(value)
    values = {part.strip(" \t") for part in value.split(",")}
    if len(values) == 1:
        (single,) = values
        if _CONTENT_LENGTH.fullmatch(single):
            return int(single)
    raise UpstreamError(f"bad Content-Length: {value[:80]!r}")


def _bad_field_line(block: str) -> str:
    for line in block.split("\r\n"):
        if _FIELD_LINE.fullmatch(line) is None:
            return line
    return block  # unreachable when the block as a whole failed to match


def _bare_lf(data: bytes, after_cr: bool) -> bool:
    """An LF not preceded by CR; `after_cr` says the bytes before `data` ended with CR."""
    if after_cr:
        data = b"\r" + data
    return data.count(b"\n") != data.count(b"\r\n")


class UpstreamError(ConnectionError):
    """The replica's connection failed or it sent something that is not HTTP/1.1."""


class InvalidResponse(UpstreamError):
    """The replica sent something that is not a valid HTTP/1.1 answer."""


class UpstreamResponse:
    """Status and headers of a replica's answer; the body is read with `read` or
    `iter_chunks`, or handed on as it arrives with `pipe`."""

    __slots__ = ("status", "reason", "headers", "content_length", "_conn", "_chunks", "_buffered",
                 "_done", "_error", "_waiter", "_sink", "_ended")

    def __init__(self, conn: _Connection, status: int, reason: str,
                 headers: list[tuple[str, str]], content_length: int | None) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_length = content_length
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._ended: asyncio.Future[None] | None = None

    def header(self, name: str) -> str | None:
        lower = name.lower()
        for key, value in self.headers:
            if key.lower() == lower:
                return value
        return None

    # fed by the connection -------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_ABOVE_BYTES:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        self._done = True
        self._error = error
        # Nothing more will come: let go of the sink, which holds its relay, which holds
        # this response. Left, that cycle keeps every relayed request's state for the cyclic
        # collector, whose full passes then stalled the proxy for 60-300 ms.
        self._sink = None
        self._wake()
        ended = self._ended
        if ended is not None and not ended.done():
            if error is None:
                ended.set_result(None)
            else:
                ended.set_exception(error)

    # handed on ---------------------------------------------------------------------------------

    def pipe(self, sink: Callable[[bytes], None]) -> asyncio.Future[None]:
        """From now on, call `sink` with the body's bytes as they arrive, inside the
        connection's own read callback: a relayed chunk costs no task wake-up, no future and
        no timer. The future ends with the body (UpstreamError if it broke). `sink` must not
        raise; `pause_reading` is its backpressure."""
        ended = self._ended = self._conn.loop.create_future()
        if self._chunks:
            data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
            self._chunks.clear()
            self._buffered = 0
            sink(data)
        self._sink = sink
        if self._done:
            self._finish(self._error)
        else:
            self._conn.resume()
        return ended

    def pause_reading(self) -> None:
        self._conn.pause()

    def resume_reading(self) -> None:
        self._conn.resume()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # read by the proxy -------------------------------------------------------------------------

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamError if the body ends early."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume()
                yield data
                continue
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    @property
    def complete(self) -> bool:
        """The whole body has arrived (a small answer usually comes with its headers)."""
        return self._done and self._error is None

    async def peek(self, limit: int) -> bytes | None:
        """The whole body, left in place for `read`, `iter_chunks` or `pipe` to hand on; None
        when it is over `limit` bytes or broke. For the few answers kvlb must look into
        before relaying them."""
        limit = min(limit, PAUSE_ABOVE_BYTES)  # past it the connection pauses: nothing more would come
        while not self._done and self._buffered <= limit:
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None or self._buffered > limit:
            return None
        data = b"".join(self._chunks)
        self._chunks.clear()
        if data:
            self._chunks.append(data)
        return data

    async def read(self, limit: int) -> bytes:
        if self._done and self._error is None and len(self._chunks) <= 1:
            # The usual small answer: all there already, no need to iterate.
            data = self._chunks.popleft() if self._chunks else b""
            if len(data) > limit:
                raise UpstreamError(f"response body over {limit} bytes")
            self._buffered = 0
            return data
        parts: list[bytes] = []
        size = 0
        async for chunk in self.iter_chunks():
            size += len(chunk)
            if size > limit:
                raise UpstreamError(f"response body over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Done with this response: a fully read one returns its connection to the pool,
        anything else closes the connection so the replica sees the request go away."""
        self._conn.response_closed(self)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, carrying one request at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        self._buffer = b""
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._body_mode = ""  # "length", "chunked", "close" or "" before headers
        self._remaining = 0
        self._keep_alive = True
        self._got_bytes = False
        self._complete = False
        self._chunked: ChunkedDecoder | None = None
        self._head_bytes = 0  # of the heads already parsed for this request (1xx included)
        self._interim = 0

    # asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None  # it holds this protocol: no cycle left for the collector
        if self._body_mode == "close" and self._response is not None and not self._complete:
            self._complete = True
            self._response._finish()
            return
        self._fail(UpstreamError(f"connection to {self.pool.name} closed" + (f": {exc}" if exc else "")))

    def data_received(self, data: bytes) -> None:
        if self._head_waiter is None or self._complete:
            # Bytes after the answer ended (or on an idle connection) belong to no request: the
            # replica is out of step with us, and the next answer read here could be anyone's.
            self._keep_alive = False
            self.abort()
            return
        self._got_bytes = True
        try:
            if self._body_mode == "chunked":
                self._parse_chunked(data)  # a stream's every chunk: the short way
            else:
                self._parse(data)
        except UpstreamError as exc:
            # What the replica sent is not HTTP: its fault, told apart from a lost connection.
            self._fail(InvalidResponse(str(exc)))
            self.abort()

    def eof_received(self) -> bool:
        return False

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and self._response is not None \
                and self._response._buffered < RESUME_BELOW_BYTES:
            self._paused = False
            self.transport.resume_reading()

    # request ---------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._reset()
        self._head_waiter = self.loop.create_future()
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        return self._head_waiter

    def response_closed(self, response: UpstreamResponse) -> None:
        if response is not self._response:
            return
        if self._complete and self._keep_alive and not self.closed:
            self._response = None
            self.pool.release(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    @property
    def failed_silently(self) -> bool:
        """Closed before answering anything: a kept-alive connection the replica had dropped."""
        return not self._got_bytes

    # parsing ---------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(exc)
        elif self._response is not None and not self._complete:
            self._complete = True
            self._response._finish(exc)

    def _parse(self, data: bytes) -> None:
        if self._body_mode == "":
            data = self._parse_heads(data)
            if self._body_mode == "" or not data:
                return
            if self._complete:
                self._keep_alive = False  # bytes beyond a body-less answer: out of step
                return
        response = self._response
        assert response is not None
        if self._body_mode == "length":
            if len(data) >= self._remaining:
                extra = len(data) - self._remaining
                if extra:
                    data = data[: self._remaining]
                    self._keep_alive = False  # bytes beyond the body: the connection is confused
                self._remaining = 0
                response._feed(data)
                self._complete = True
                response._finish()
            else:
                self._remaining -= len(data)
                response._feed(data)
        elif self._body_mode == "chunked":
            self._parse_chunked(data)
        elif self._body_mode == "close":
            response._feed(data)

    def _parse_heads(self, data: bytes) -> bytes:
        """Read interim 1xx heads and the final one; returns the bytes after the final head.

        A loop rather than a call per head, so a run of 1xx answers in one read cannot grow
        the stack. The size limit counts every head of the answer, whether or not its end has
        arrived, so a head that comes whole in one read is held to it as well.
        """
        buffer = self._buffer + data if self._buffer else data
        after_cr = self._buffer.endswith(b"\r")
        scan_from = max(0, len(self._buffer) - 3)  # the terminator may straddle the reads
        start = 0
        while True:
            end = buffer.find(b"\r\n\r\n", max(start, scan_from))
            if end < 0:
                if self._head_bytes + len(buffer) - start > MAX_HEAD_BYTES:
                    raise UpstreamError(f"response head over {MAX_HEAD_BYTES} bytes")
                # Only the new bytes are scanned, so a head trickling in stays linear; caught
                # here, an LF-only head fails now instead of at the first-byte timeout.
                if _bare_lf(data, after_cr):
                    raise UpstreamError("bare LF in the response head")
                self._buffer = buffer[start:] if start else buffer
                return b""
            self._head_bytes += end + 4 - start
            if self._head_bytes > MAX_HEAD_BYTES:
                raise UpstreamError(f"response head over {MAX_HEAD_BYTES} bytes")
            if self._start_response(buffer[start:end]):
                self._buffer = b""
                return buffer[end + 4:]
            self._interim += 1
            if self._interim > MAX_INTERIM_RESPONSES:
                raise UpstreamError(f"over {MAX_INTERIM_RESPONSES} interim 1xx responses")
            start = end + 4

    def _start_response(self, head: bytes) -> bool:
        """Parse one head; False for a 1xx interim answer (the real one follows)."""
        status_line, _, block = head.decode("latin-1").partition("\r\n")
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise UpstreamError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        if block and _HEADER_BLOCK.fullmatch(block) is None:
            raise UpstreamError(f"malformed header line: {_bad_field_line(block)[:80]!r}")
        status = int(match[2])
        if status < 200:
            if status == 101:
                # The proxy never asks to switch protocols; what follows would not be HTTP.
                raise UpstreamError("101 Switching Protocols to a request without Upgrade")
            return False
        headers: list[tuple[str, str]] = []
        content_length: int | None = None
        codings: list[str] | None = None
        http10 = match[1] == "0"
        keep_alive = not http10
        for line in block.split("\r\n") if block else ():
            name, _, value = line.partition(":")
            value = value.strip(" \t")
            headers.append((name, value))
            lower = name.lower()
            if lower == "content-length":
                length = _content_length(value)
                if content_length is not None and length != content_length:
                    raise UpstreamError(f"conflicting Content-Length: {content_length}, {length}")
                content_length = length
            elif lower == "transfer-encoding":
                if codings is None:
                    codings = []
                codings += [c for part in value.lower().split(",") if (c := part.strip(" \t"))]
            elif lower == "connection":
                tokens = {t.strip(" \t") for t in value.lower().split(",")}
                if "close" in tokens:
                    keep_alive = False
                elif "keep-alive" in tokens:
                    keep_alive = True
        chunked = False
        if codings is not None:
            # RFC 9112 §6.1/§6.3: Transfer-Encoding overrides Content-Length. Both at once (or
            # Transfer-Encoding from an HTTP/1.0 peer) is how responses get smuggled, so the
            # answer is read by its Transfer-Encoding and the connection closed after it.
            if content_length is not None or http10:
                keep_alive = False
            content_length = None
            if codings.count("chunked") > 1:
                raise UpstreamError("chunked applied more than once")
            chunked = bool(codings) and codings[-1] == "chunked"
        self._keep_alive = keep_alive
        if status in _NO_BODY_STATUSES:
            # RFC 9112 §6.3: no body whatever the framing headers say.
            self._body_mode, self._remaining = "length", 0
        elif chunked:
            self._body_mode = "chunked"
            self._chunked = ChunkedDecoder()
        elif codings is not None:
            # Another final coding (gzip, say) would have to be relayed under a
            # Transfer-Encoding the client never asked for (TE), or decoded: no engine sends
            # one, so it is an answer kvlb cannot pass on.
            raise UpstreamError(f"transfer coding {codings[-1][:40]!r} is not chunked; "
                                "kvlb relays chunked or Content-Length bodies only")
        elif content_length is not None:
            self._body_mode, self._remaining = "length", content_length
        else:
            self._body_mode, self._keep_alive = "close", False
        reason = match[3] or ""
        self._response = UpstreamResponse(self, status, reason, headers, content_length)
        if self._body_mode == "length" and self._remaining == 0:
            self._complete = True
            self._response._finish()
        assert self._head_waiter is not None
        if not self._head_waiter.done():
            self._head_waiter.set_result(self._response)
        return True

    def _parse_chunked(self, data: bytes) -> None:
        response = self._response
        assert response is not None and self._chunked is not None
        piece = self._chunked.whole_chunk(data)
        if piece is not None:
            sink = response._sink
            if sink is not None:
                sink(piece)  # piped: straight on
            else:
                response._feed(piece)
            return
        try:
            pieces, rest = self._chunked.feed(data)
        except ChunkedError as exc:
            raise UpstreamError(str(exc)) from None
        if pieces:
            data = b"".join(pieces) if len(pieces) > 1 else pieces[0]
            sink = response._sink
            if sink is not None:
                sink(data)  # piped: straight on, one call less per chunk
            else:
                response._feed(data)
        if self._chunked.done:
            if rest:
                self._keep_alive = False  # bytes beyond the body: the connection is confused
            self._complete = True
            response._finish()


class _HostPool:
    """Idle connections to one replica, most recently used first."""

    def __init__(self, name: str, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 loop: asyncio.AbstractEventLoop, max_idle: int, idle_timeout_s: float) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.loop = loop
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s
        self.idle: deque[_Connection] = deque()
        self.closed = False

    def take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.closed or (conn.transport is not None and conn.transport.is_closing()):
                continue
            if now - conn.idle_since > self.idle_timeout_s:
                conn.abort()
                continue
            conn.reused = True
            return conn
        return None

    async def connect(self, timeout_s: float) -> _Connection:
        async with asyncio.timeout(timeout_s):
            _, conn = await self.loop.create_connection(
                lambda: _Connection(self), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None,
            )
        return conn

    def release(self, conn: _Connection) -> None:
        # A closed pool is no longer in UpstreamPool: a connection kept here would never be
        # used again, only left open to a replica that has left.
        if self.closed or len(self.idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().abort()


def _expire(waiter: asyncio.Future[UpstreamResponse]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no response headers in time"))


class UpstreamPool:
    """Keep-alive connections to every replica, keyed by base URL."""

    def __init__(self, *, connect_timeout_s: float, max_idle_per_replica: int = 256,
                 idle_timeout_s: float = 30.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_replica
        self.idle_timeout_s = idle_timeout_s
        self._pools: dict[str, tuple[_HostPool, str, str]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _pool_for(self, base_url: str) -> tuple[_HostPool, str, str]:
        entry = self._pools.get(base_url)
        if entry is None:
            parts = urlsplit(base_url)
            secure = parts.scheme == "https"
            port = parts.port or (443 if secure else 80)
            host = parts.hostname or "127.0.0.1"
            if secure and self._ssl is None:
                self._ssl = ssl.create_default_context()
            pool = _HostPool(base_url, host, port, self._ssl if secure else None,
                             asyncio.get_running_loop(), self.max_idle, self.idle_timeout_s)
            default_port = 443 if secure else 80
            host_header = host if port == default_port else f"{host}:{port}"
            if ":" in host and not host.startswith("["):
                host_header = f"[{host}]" if port == default_port else f"[{host}]:{port}"
            entry = (pool, host_header, parts.path.rstrip("/"))
            self._pools[base_url] = entry
        return entry

    async def request(self, base_url: str, method: str, path_qs: str,
                      headers: Iterable[tuple[str, str]], body: bytes,
                      first_byte_timeout_s: float) -> UpstreamResponse:
        """Send one request and return once the response headers arrived.

        Raises TimeoutError when connecting and the response headers take longer than
        `first_byte_timeout_s` together.

        A reused keep-alive connection that the replica had already closed fails before any
        byte of an answer; the request then goes once more on a fresh connection, as the
        replica never saw it.
        """
        pool, host_header, prefix = self._pool_for(base_url)
        lines = [f"{method} {prefix}{path_qs} HTTP/1.1\r\nHost: {host_header}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("latin-1")
        deadline = pool.loop.time() + first_byte_timeout_s
        conn = pool.take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, head, body, deadline)
            except UpstreamError:
                if not conn.failed_silently:
                    raise
        conn = await pool.connect(min(self.connect_timeout_s, deadline - pool.loop.time()))
        return await self._exchange(conn, head, body, deadline)

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes, deadline: float) -> UpstreamResponse:
        waiter = conn.send(head, body)
        # A plain timer on the future: cheaper than a timeout context on the hot path.
        timer = conn.loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        except BaseException:
            conn.abort()
            raise
        finally:
            timer.cancel()

    def forget(self, base_url: str) -> None:
        """A replica left the fleet: close its idle connections and drop its pool, so pools do
        not pile up as replicas come and go. A connection still carrying a request closes when
        that request ends; a later request to the same URL starts a fresh pool."""
        entry = self._pools.pop(base_url, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        for pool, _, _ in self._pools.values():
            pool.close()
        self._pools.clear()
