"""A time-to-first-token target in the ranking: where some candidate is predicted to meet
it, the others pay for their excess.

A policy that prices time trades a request's own first token against the fleet's work and
the decode batch it joins: a replica a little slower to the first token may be the better
place overall. A request with a target (its flow-control class's, the
`x-kvlb-ttft-slo-ms` header's, or the policy's own `ttft_target_ms`) may make that trade
lopsided, when missing the target is what its user promised not to do. So while at least one
candidate is predicted within the target, every candidate predicted past it adds
`weight` × its excess to its cost, and the usual cost decides among those within (and, on
a near tie, among those past it). Where none is predicted within, the ranking is left
alone: steering such a request to the fastest first token anyway cost the shared trace at 4x
a share of its requests within target and half again its end-to-end p99 (docs/routing.md,
which also has where the target helps and where it costs end-to-end time; hence off unless
the policy's `ttft_target_weight` is set).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import TTFT_TERM, Choice

# The term that holds what a candidate paid for its excess over the target, in ms of cost.
TARGET_TERM = "target_ms"


def steer_to_target(choices: Sequence[Choice], keys: list[float], target_ms: float, weight: float) -> None:
    """Add the excess over `target_ms` (× `weight`) to the cost and key of each choice
    predicted past it, if any choice is predicted within it. `keys[j]` is choice j's
    ranking key."""
    if weight <= 0.0 or not any(c.terms[TTFT_TERM] <= target_ms for c in choices):
        return
    for j, choice in enumerate(choices):
        excess = choice.terms[TTFT_TERM] - target_ms
        if excess > 0.0:
            penalty = weight * excess
            terms = choice.terms
            terms[TARGET_TERM] = penalty  # type: ignore[index]
            terms["cost"] += penalty  # type: ignore[index]
            keys[j] += penalty
