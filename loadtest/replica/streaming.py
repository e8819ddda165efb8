"""Server-sent events for one request, one chunk per token, at low CPU cost.

Writing tokens is most of the replica's CPU. Waking a handler task per token and going through
aiohttp's writer costs several times the socket write itself, so once the headers and first
chunk are out, the engine loop writes each iteration's chunks straight to the connection's
transport (HTTP/1.1 chunked framing, as aiohttp would). The handler task only wakes to start
the stream, to finish it, to cut it (fault injection), or when the client reads slowly and the
transport's buffer passes `HIGH_WATER_BYTES`; then it writes through aiohttp, whose flow
control waits for the client once it has buffered its own 64 kB. A reader that stalls thus
costs about 128 kB of buffer, not the whole answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from loadtest.replica.driver import TokenListener
from loadtest.replica.faults import FaultState

HIGH_WATER_BYTES = 64 * 1024
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

# render(first_token, end_token, done) -> the SSE chunks for tokens first..end-1, plus the
# closing chunks (usage, [DONE]) when done.
Render = Callable[[int, int, bool], list[bytes]]
# framed(token) -> the SSE chunk of a token that is not the last, already framed as one
# HTTP/1.1 chunk; the engine loop's fast path.
Framed = Callable[[int], bytes]


def drop_connection(request: web.Request) -> None:
    """End the exchange mid-answer, as a crashed server would: no final chunk, no [DONE]."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    # aiohttp treats a ConnectionError from a handler as the client having gone.
    raise ConnectionResetError("injected fault: connection cut")


class SseStream:
    __slots__ = ("_request", "_listener", "_render", "_framed", "_faults", "_written", "_transport")

    def __init__(
        self,
        request: web.Request,
        listener: TokenListener,
        render: Render,
        framed: Framed,
        faults: FaultState,
    ) -> None:
        self._request = request
        self._listener = listener
        self._render = render
        self._framed = framed
        self._faults = faults
        self._written = 0  # tokens handed to the transport
        self._transport: asyncio.Transport | None = None  # set once direct writes may start

    def _sendable(self) -> tuple[int, bool]:
        """(tokens that may be sent by now, whether to cut the connection after them)."""
        cut = self._faults.faults.cut_after_tokens
        delivered = self._listener.delivered
        if cut is not None and delivered >= cut:
            return max(cut, self._written), True
        return delivered, False

    def push(self, delivered: int, done: bool) -> bool:
        """The engine loop's direct write; False hands the work back to the handler task."""
        transport = self._transport
        if (
            done
            or transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() > HIGH_WATER_BYTES
            or self._faults.faults.cut_after_tokens is not None
        ):
            return False
        written = self._written
        if delivered == written + 1:
            transport.write(self._framed(written))
        elif delivered > written:
            transport.write(b"".join(map(self._framed, range(written, delivered))))
        self._written = delivered
        return True

    async def run(self) -> web.StreamResponse:
        listener = self._listener
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(self._request)
        try:
            while True:
                while listener.delivered == self._written and not listener.done:
                    await listener.wait()
                end, cut = self._sendable()
                done = listener.done and not cut
                parts = self._render(self._written, end, done)
                self._written = end
                # The engine loop must not write while aiohttp's writer holds the stream.
                listener.sink = None
                if done:
                    # The last chunks and the end of the chunked body leave in one write.
                    await response.write_eof(b"".join(parts))
                    return response
                if parts:
                    await response.write(b"".join(parts))
                if cut:
                    drop_connection(self._request)
                # Headers and the first chunk are out: direct writes may follow.
                self._transport = self._request.transport
                listener.sink = self.push
        finally:
            # However the stream ends (done, cut, client gone): no more direct writes, and
            # no listener -> stream -> listener cycle left for the cycle collector.
            listener.sink = None
