"""Power of two choices: sample two replicas, send to the lighter."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Choice, Policy, ReplicaView, RequestFeatures


def _terms(r: ReplicaView, load: float, sampled: bool) -> dict[str, float]:
    return {"in_flight": float(r.in_flight), "load": load, "sampled": 1.0 if sampled else 0.0}


class PowerOfTwoPolicy(Policy):
    """Two distinct random candidates, the lighter (in_flight / weight) first, then the other.

    Sampling instead of taking the global minimum keeps several balancers, each with stale
    counts, from herding onto one replica. For failover, the replicas not sampled follow,
    lightest first, equal loads in random order.
    """

    name = "power_of_two"

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        n = len(replicas)
        if n == 1:
            r = replicas[0]
            return [Choice(r, _terms(r, r.in_flight / r.weight, True))]
        rand = self.rng.random
        # int(u * n) is cheaper than randrange; its bias is about n / 2**53.
        a = int(rand() * n)
        b = int(rand() * (n - 1))
        if b >= a:
            b += 1
        ra, rb = replicas[a], replicas[b]
        la, lb = ra.in_flight / ra.weight, rb.in_flight / rb.weight
        if lb < la or (lb == la and rand() < 0.5):
            ra, rb, la, lb = rb, ra, lb, la
        choices = [Choice(ra, _terms(ra, la, True)), Choice(rb, _terms(rb, lb, True))]
        if n > 2:
            rest = sorted(
                (r.in_flight / r.weight, rand(), i)
                for i, r in enumerate(replicas)
                if i != a and i != b
            )
            choices.extend(
                Choice(replicas[i], _terms(replicas[i], load, False)) for load, _, i in rest
            )
        return choices
