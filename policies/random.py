"""Weighted random order: a replica's chance of coming first is its share of the total weight."""

from __future__ import annotations

from collections.abc import Sequence
from math import log

from policies.base import Choice, Policy, ReplicaView, RequestFeatures


class RandomPolicy(Policy):
    """A fresh weighted random permutation per request (Efraimidis–Spirakis)."""

    name = "random"

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        rand = self.rng.random
        # Sorting by the exponential race -log(u)/w is the same order as u**(1/w) descending,
        # without pow() and without underflow to 0.0 for small weights. 1 - u lies in (0, 1].
        keyed = sorted((-log(1.0 - rand()) / r.weight, i) for i, r in enumerate(replicas))
        return [Choice(replicas[i], {"weight": float(replicas[i].weight)}) for _, i in keyed]
