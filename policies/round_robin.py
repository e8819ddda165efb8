"""Smooth weighted round robin, as in nginx: shares follow weights, picks interleave."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.base import Choice, Policy, ReplicaView, RequestFeatures

# Weights are counted in thousandths so the arithmetic is on integers: with floats, rounding
# would eventually break ties differently and equal weights would stop cycling in list order.
_WEIGHT_SCALE = 1000
# Names missing from a call keep their counter (nginx skips a down peer the same way, so a
# replica that drops out for a moment resumes its place); past this many extra names, the
# counters of absent replicas are dropped so pod churn cannot grow the table forever.
_MAX_ABSENT = 1024


class RoundRobinPolicy(Policy):
    """Each call adds every replica's weight to its counter and picks the largest counter.

    With equal weights this cycles through the replicas exactly in the order given; ties go to
    the earlier replica. After the pick, the ranking continues in cyclic list order.
    """

    name = "round_robin"

    def __init__(self, *, seed: int | None = None, **params: Any) -> None:
        super().__init__(seed=seed, **params)
        self._current: dict[str, int] = {}

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        current = self._current
        counters: list[int] = []
        total = 0
        best_i = 0
        best = None
        for i, r in enumerate(replicas):
            w = int(r.weight * _WEIGHT_SCALE + 0.5) or 1
            c = current.get(r.name, 0) + w
            current[r.name] = c
            counters.append(c)
            total += w
            if best is None or c > best:
                best, best_i = c, i
        current[replicas[best_i].name] -= total
        n = len(replicas)
        if len(current) > n + _MAX_ABSENT:
            present = {r.name for r in replicas}
            self._current = {k: v for k, v in current.items() if k in present}
        choices = []
        for k in range(best_i, best_i + n):
            i = k % n if k >= n else k
            r = replicas[i]
            choices.append(
                Choice(r, {"weight": float(r.weight), "counter": counters[i] / _WEIGHT_SCALE})
            )
        return choices
