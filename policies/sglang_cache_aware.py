"""SGLang router's `cache_aware` rule, on kvlb's prefix index: a baseline to compare against.

Live, `kvlb compare --live --external` runs SGLang's router itself. This policy lets the same
comparison run offline, in the simulator, where runs are deterministic and take seconds, so
`predictive` can be checked against SGLang's rule on many workloads instead of a few noisy
live runs. The rule, as sglang-router (0.3.x) describes and applies it by default:

- The fleet is *imbalanced* when the busiest replica's in-flight requests exceed the idlest's
  by more than `balance_abs_threshold` (64) and by more than `balance_rel_threshold` (1.5)
  times. Then the idlest replica gets the request, cache or not.
- Otherwise the replica holding the longest prefix of the prompt gets it, if that prefix is
  more than `cache_threshold` (0.3) of the prompt; below that, the replica whose record of
  past prompts is smallest (SGLang's router: the fewest characters in its tree), the one it
  takes to have the most cache to spare.

Where it differs from SGLang's router, knowingly: its tree records every prompt it routed
and forgets only past 64 M characters per replica, while this policy reads kvlb's index,
which forgets what a replica's KV capacity could not hold; it counts tokens where SGLang's
router counts characters; among replicas sharing the longest prefix it picks at random where
SGLang's router takes its tree node's first entry. The record size is the tokens each
replica was routed beyond what it held of them, which is what SGLang's tree grows by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.base import Choice, Policy, ReplicaView, RequestFeatures
from policies.costs import fraction_param, number_param

# The `rule` term: which case of the rule chose the first replica.
IMBALANCED, LONGEST_PREFIX, SMALLEST_RECORD = 1.0, 2.0, 3.0


class SGLangCacheAwarePolicy(Policy):
    """The idlest replica when loads are far apart; else the longest cached prefix when it is
    a big enough share of the prompt; else the replica with the smallest record. The others
    follow by load, for failover."""

    name = "sglang_cache_aware"
    needs_prompt = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        seed: int | None = None,
        **params: Any,
    ) -> None:
        super().__init__(seed=seed, **params)
        self.cache_threshold = fraction_param("cache_threshold", cache_threshold, "share of the prompt")
        self.balance_abs_threshold = number_param(
            "balance_abs_threshold", balance_abs_threshold, "in-flight requests")
        self.balance_rel_threshold = number_param(
            "balance_rel_threshold", balance_rel_threshold, "ratio of in-flight requests")
        # Tokens recorded per replica name. Names of replicas that left are dropped once the
        # map outgrows the fleet it last saw, so it is bounded by the fleet's size.
        self._recorded: dict[str, int] = {}

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        rand = self.rng.random
        loads = [r.in_flight for r in replicas]
        busiest, idlest = max(loads), min(loads)
        imbalanced = (busiest - idlest > self.balance_abs_threshold
                      and busiest > idlest * self.balance_rel_threshold)
        cached = request.cached_tokens
        longest = max((cached.get(r.name, 0) for r in replicas), default=0)
        share = longest / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
        recorded = self._recorded
        if imbalanced:
            rule = IMBALANCED
            key = [(load, rand()) for load in loads]
        elif share > self.cache_threshold:
            rule = LONGEST_PREFIX
            key = [(cached.get(r.name, 0) != longest, rand()) for r in replicas]
        else:
            rule = SMALLEST_RECORD
            key = [(recorded.get(r.name, 0), rand()) for r in replicas]
        first = min(range(len(replicas)), key=key.__getitem__)
        rest = sorted((i for i in range(len(replicas)) if i != first), key=lambda i: (loads[i], rand()))
        chosen = replicas[first].name
        recorded[chosen] = recorded.get(chosen, 0) + max(request.prompt_tokens - cached.get(chosen, 0), 0)
        if len(recorded) > 2 * len(replicas) + 16:
            present = {r.name for r in replicas}
            for name in [n for n in recorded if n not in present]:
                del recorded[name]
        return [
            Choice(replicas[i], {
                "in_flight": float(loads[i]),
                "cached": float(cached.get(replicas[i].name, 0)),
                "match_share": share,
                "recorded_tokens": float(recorded.get(replicas[i].name, 0)),
                "rule": rule,
            })
            for i in (first, *rest)
        ]
