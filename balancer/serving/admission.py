"""The admission line (`balancer.routing.admission`) driven by the event loop: a waiter is
a future, its deadline `limits.queue_timeout_s` on the loop's clock."""

from __future__ import annotations

import asyncio

from balancer.routing.admission import AdmissionQueue


class Admission:
    def __init__(self, queue: AdmissionQueue[asyncio.Future[None]], queue_timeout_s: float) -> None:
        self.queue = queue
        self.queue_timeout_s = queue_timeout_s

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @property
    def queued(self) -> int:
        return self.queue.queued

    async def acquire(self) -> None:
        queue = self.queue
        if queue.try_enter():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.join(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter  # release() hands its slot over: in_flight already counts us
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived just as time ran out: pass it on
            raise queue.timed_out(self.queue_timeout_s) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived as the client left: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            queue.withdraw(waiter)

    def release(self) -> None:
        while (waiter := self.queue.hand_over()) is not None:
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the longest waiter
                return
