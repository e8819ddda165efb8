"""Admission control: at most `max_in_flight` requests at once; the excess waits in a bounded
queue, first come first served, for at most `queue_timeout_s`; beyond either bound the
request is refused with 429 and Retry-After, before any work is spent on it.

A brief burst thus queues instead of failing, while a sustained overload is told to back off
instead of piling up memory and latency without bound.
"""

from __future__ import annotations

import asyncio
from collections import deque

from balancer.errors import ClientError


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.refused = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_queued:
            self.refused += 1
            raise self._refusal("the admission queue is full")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter  # release() hands its slot over: in_flight already counts us
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived just as time ran out: pass it on
            self.refused += 1
            raise self._refusal(f"no capacity within limits.queue_timeout_s ({self.queue_timeout_s} s)") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived as the client left: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the longest waiter
                return
        self.in_flight -= 1

    def _refusal(self, why: str) -> ClientError:
        return ClientError(
            429, f"kvlb is at capacity ({why}); retry shortly", "rate_limit_exceeded",
            type_="rate_limit_error", retry_after=1,
        )
