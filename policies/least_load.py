"""Least load: the replica with the fewest in-flight requests per unit of weight."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Choice, Policy, ReplicaView, RequestFeatures


class LeastLoadPolicy(Policy):
    """All replicas by in_flight / weight, lightest first; equal loads in random order.

    Random tie-breaks matter: with "first in the list" every balancer instance (and every
    burst that arrives between count updates) would pile onto the same replica.
    """

    name = "least_load"

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        rand = self.rng.random
        keyed = sorted((r.in_flight / r.weight, rand(), i) for i, r in enumerate(replicas))
        return [
            Choice(replicas[i], {"in_flight": float(replicas[i].in_flight), "load": load})
            for load, _, i in keyed
        ]
