"""How often requests have lately met the same cached prefix: the traffic a copy would serve.

A replica that computes a prefix other replicas already hold pays its prefill once and then
serves it cached to every later request sent there. Whether that copy pays depends on how
many requests share the prefix, which one request's own figures cannot tell: one shared
system prompt at 12 requests/s and a conversation's history, matched once per turn, look
alike to it. This counts, per prefix, the requests whose longest cached prefix ended at
that block: a decayed count over `time_constant_s`, which divided by it is a rate in
requests per second (a steady λ converges on λ).

The key is the hash of the deepest block any replica holds of the prompt, so a
conversation's turns, each ending where the last one did, count once each and never make
a rate, while every request under one system prompt adds to the same key.

Bounded: at most `max_entries` prefixes, the least recently met dropped first. Time is
passed in by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from math import exp


class PrefixDemand:
    def __init__(self, *, time_constant_s: float = 10.0, max_entries: int = 4096) -> None:
        if not time_constant_s > 0:
            raise ValueError("time_constant_s must be positive")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.time_constant_s = time_constant_s
        self.max_entries = max_entries
        self._counts: OrderedDict[int, tuple[float, float]] = OrderedDict()  # key -> (count, at)

    def __len__(self) -> int:
        return len(self._counts)

    def _count(self, key: int, now: float) -> float:
        entry = self._counts.get(key)
        if entry is None:
            return 0.0
        count, at = entry
        return count * exp(-max(now - at, 0.0) / self.time_constant_s)

    def rate(self, key: int, now: float) -> float:
        """Requests per second lately met this prefix, not counting the one asking."""
        return self._count(key, now) / self.time_constant_s

    def observe(self, key: int, now: float) -> None:
        """A request whose longest cached prefix ends at `key` is being sent."""
        counts = self._counts
        counts[key] = (self._count(key, now) + 1.0, now)
        counts.move_to_end(key)
        if len(counts) > self.max_entries:
            counts.popitem(last=False)
