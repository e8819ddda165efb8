"""The KV a prefill replica holds for decode replicas to fetch: a bounded table with a TTL.

A prefill server keeps a finished prompt's KV until a decode server has copied it. Here that
is one small entry per prompt (its token counts), keyed by SGLang's bootstrap room or by the
block ids of vLLM's transfer. A decode replica may ask for a room before the prefill request
has even arrived (SGLang's router sends both halves at once), so `take` waits for an unknown
key, leaving a placeholder that the prefill's `put` fills. Nothing grows without bound: at
most `capacity` entries, the oldest dropped first, each gone `ttl_s` after it was last put.
Expiry is checked lazily, on each put and take; entries are in insertion order, which with
one TTL for all is also the order of expiry.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

# Failure reasons counted in /metrics. The prefill side's: an entry nobody fetched before it
# expired, or that newer ones pushed out of the table. The decode side's: the prefill side
# could not be reached, did not answer in time, did not know the key, or answered garbage.
PREFILL_FAILURES = ("expired", "dropped")
DECODE_FAILURES = ("unreachable", "timeout", "not_found", "bad_answer")


@dataclass(slots=True)
class TransferCounters:
    """What /metrics reports: transfers a decode replica fetched from here (sent), fetched
    from a prefill replica (received), and failures by reason."""

    sent: int = 0
    received: int = 0
    failures: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(PREFILL_FAILURES + DECODE_FAILURES, 0)
    )

    def fail(self, reason: str) -> None:
        self.failures[reason] += 1

    def to_json(self) -> dict[str, object]:
        return {"sent": self.sent, "received": self.received, "failures": dict(self.failures)}


@dataclass(slots=True)
class HeldKv:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the prefill side's prefix cache hit
    ready: bool = False  # False: a placeholder a decode replica waits on
    expires: float = 0.0
    waiters: int = 0
    # Set (and replaced) whenever the entry is filled or dropped, to wake its waiters.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class HandoffTable:
    def __init__(
        self,
        capacity: int,
        ttl_s: float,
        counters: TransferCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.ttl_s = ttl_s  # real seconds
        self._counters = counters
        self._clock = clock
        self._entries: OrderedDict[Hashable, HeldKv] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, prompt_tokens: int, cached_tokens: int) -> None:
        """The prefill of `key` is done: hold its KV, waking a decode replica waiting for it."""
        now = self._clock()
        self._purge(now)
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = HeldKv()
        entry.prompt_tokens = prompt_tokens
        entry.cached_tokens = cached_tokens
        entry.ready = True
        entry.expires = now + self.ttl_s
        self._insert(key, entry)
        entry.wake()

    async def take(self, key: Hashable, wait_s: float) -> HeldKv | None:
        """The held KV of `key`, removed from the table (a decode replica copied it), waiting
        at most `wait_s` real seconds for it to be put; None if it never was."""
        deadline = self._clock() + wait_s
        while True:
            now = self._clock()
            self._purge(now)
            entry = self._entries.get(key)
            if entry is not None and entry.ready:
                del self._entries[key]
                self._counters.sent += 1
                return entry
            remaining = deadline - now
            if remaining <= 0:
                return None
            if entry is None:
                entry = HeldKv(expires=now + self.ttl_s)
                self._insert(key, entry)
            changed = entry.changed
            entry.waiters += 1
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return None
            finally:
                entry.waiters -= 1
                # A placeholder nobody waits on any more would only take a slot.
                if not entry.waiters and not entry.ready and self._entries.get(key) is entry:
                    del self._entries[key]
            # Filled, or dropped (then a new placeholder is made): look again.

    def _insert(self, key: Hashable, entry: HeldKv) -> None:
        entries = self._entries
        entries[key] = entry
        while len(entries) > self.capacity:
            _, oldest = entries.popitem(last=False)
            if oldest.ready:
                self._counters.fail("dropped")
            oldest.wake()

    def _purge(self, now: float) -> None:
        entries = self._entries
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.expires > now:
                return
            del entries[key]
            if entry.ready:
                self._counters.fail("expired")
            entry.wake()
