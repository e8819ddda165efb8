"""Relay a replica's answer body to the client as it arrives: the proxy's hottest path.

A token stream is hundreds of small chunks. Handing each one through a future, a task
wake-up, an async iterator and a rescheduled timeout cost more CPU than reading and writing
it, so the body goes the short way: the replica connection's read callback writes each piece
straight to the client's transport (`UpstreamResponse.pipe`), and the relay's coroutine only
waits for the end.

Backpressure and deadlines stay, off the per-chunk path:
- the client falling behind pauses reading from the replica, and catching up resumes it;
- a client that stays behind for `write_timeout_s` has stalled (ClientStalled): its own
  fault, never the replica's;
- a replica silent for `idle_s` while the client keeps up has broken the stream
  (TimeoutError). One lazy timer checks that: it re-arms itself from the last chunk's time
  instead of being pushed back on every chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from balancer.wire.client import UpstreamResponse
from balancer.wire.server import ClientStalled, ResponseStream


class StreamRelay:
    __slots__ = ("_stream", "_resp", "_loop", "_idle_s", "_write_s", "_on_chunk", "_on_first", "_done",
                 "_idle_timer", "_write_timer", "_closed", "_send", "_time", "last_at", "first_at")

    def __init__(self, stream: ResponseStream, resp: UpstreamResponse, loop: asyncio.AbstractEventLoop,
                 idle_s: float, on_chunk: Callable[[bytes], None] | None = None,
                 on_first: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self._resp = resp
        self._loop = loop
        self._idle_s = idle_s
        self._write_s = stream.write_timeout_s
        self._on_chunk = on_chunk
        self._on_first = on_first  # once, with the first body byte
        self._done: asyncio.Future[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._send = stream.send  # bound once: called for every chunk
        self._time = loop.time
        self.last_at = loop.time()  # when the replica last sent (or the client caught up)
        self.first_at: float | None = None  # when the first body byte went to the client

    async def run(self) -> None:
        """Until the body has been relayed; raises UpstreamError (the replica broke it),
        TimeoutError (the replica went silent) or ClientStalled (the client stopped reading)."""
        loop = self._loop
        self._done = loop.create_future()
        self._stream.watch_flow(self._flow)
        self._idle_timer = loop.call_at(self.last_at + self._idle_s, self._check_idle)
        ended = self._resp.pipe(self._feed)
        ended.add_done_callback(self._ended)
        try:
            await self._done
        finally:
            self._closed = True
            self._stream.watch_flow(None)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            if self._write_timer is not None:
                self._write_timer.cancel()
            if not ended.done():
                ended.cancel()

    # called by the connections, never awaited -------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            self._send(data)  # a client falling behind calls _flow(True) from in here
        except ConnectionError as exc:
            self._fail(exc)
            return
        now = self.last_at = self._time()
        if self.first_at is None:
            self.first_at = now
            if self._on_first is not None:
                self._on_first()
        if self._on_chunk is not None:
            self._on_chunk(data)

    def _flow(self, behind: bool) -> None:
        if self._closed:
            return
        if behind:
            self._resp.pause_reading()
            if self._write_timer is None:
                self._write_timer = self._loop.call_later(self._write_s, self._stalled)
        else:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            # The replica waited on the client all along: its silence starts counting now.
            self.last_at = self._loop.time()
            self._resp.resume_reading()

    def _check_idle(self) -> None:
        now = self._loop.time()
        if self._write_timer is not None:
            when = now + self._idle_s  # the client is behind: that time is not the replica's
        elif self.last_at + self._idle_s <= now:
            self._fail(TimeoutError(f"no chunk from the replica for {self._idle_s} s"))
            return
        else:
            when = self.last_at + self._idle_s
        self._idle_timer = self._loop.call_at(when, self._check_idle)

    def _stalled(self) -> None:
        self._write_timer = None
        self._fail(ClientStalled(f"the client read nothing for {self._write_s} s"))

    def _ended(self, ended: asyncio.Future[None]) -> None:
        if ended.cancelled():
            return
        error = ended.exception()
        if error is not None:
            self._fail(error)
        elif self._done is not None and not self._done.done():
            # The client has its whole answer the moment the replica is done: ended here, in
            # the connection's callback, its end waits neither for the relay's coroutine to
            # come round the loop's queue nor for the answer's bookkeeping after it.
            self._stream.finish()
            self._done.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
