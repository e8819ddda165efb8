"""Admission control: at most `max_in_flight` requests at once; the excess waits in a bounded
line, first come first served; beyond either bound the request is refused with 429 and
Retry-After, before any work is spent on it.

A brief burst thus queues instead of failing, while a sustained overload is told to back off
instead of piling up memory and latency without bound.

The line decides and never waits: whoever drives it (the proxy with futures and the loop's
timers, the simulator with virtual-time events) supplies the waiting and the deadline
(`limits.queue_timeout_s`), and tells the line when a waiter gives up.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from balancer.errors import ClientError

W = TypeVar("W")


class AdmissionQueue(Generic[W]):
    def __init__(self, max_in_flight: int, max_queued: int) -> None:
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.in_flight = 0
        self.refused = 0
        self._waiting: deque[W] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def try_enter(self) -> bool:
        """True: admitted now. False: the request must wait in line (`join`). Raises the 429
        refusal when the line is full."""
        if self.in_flight < self.max_in_flight and not self._waiting:
            self.in_flight += 1
            return True
        if len(self._waiting) >= self.max_queued:
            self.refused += 1
            raise refusal("the admission queue is full")
        return False

    def join(self, waiter: W) -> None:
        self._waiting.append(waiter)

    def hand_over(self) -> W | None:
        """A request finished: its slot goes to the longest waiter, returned (`in_flight`
        already counts it), or is freed when nobody waits (None). A returned waiter that has
        given up meanwhile is the driver's to skip: it calls again."""
        if self._waiting:
            return self._waiting.popleft()
        self.in_flight -= 1
        return None

    def withdraw(self, waiter: W) -> bool:
        """A waiter gave up (deadline, client gone); True if it was still in line."""
        try:
            self._waiting.remove(waiter)
        except ValueError:
            return False
        return True

    def timed_out(self, queue_timeout_s: float) -> ClientError:
        self.refused += 1
        return refusal(f"no capacity within limits.queue_timeout_s ({queue_timeout_s} s)")


def refusal(why: str) -> ClientError:
    return ClientError(
        429, f"kvlb is at capacity ({why}); retry shortly", "rate_limit_exceeded",
        type_="rate_limit_error", retry_after=1,
    )
