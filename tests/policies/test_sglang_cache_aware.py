"""SGLang router's cache_aware rule as a kvlb policy, against hand-made fleets: the three
cases its rule has, the thresholds' edges, and its record staying bounded."""

from __future__ import annotations

import pytest

from policies.base import RequestFeatures
from policies.registry import make_policy
from tests.fakes import FakeReplica


def prompt(tokens: int, **cached: int) -> RequestFeatures:
    return RequestFeatures(route="/v1/chat/completions", model="m", prompt_tokens=tokens, cached_tokens=cached)


def fleet(*loads: int) -> list[FakeReplica]:
    return [FakeReplica(f"r{i}", in_flight=load) for i, load in enumerate(loads)]


def first(policy, request, replicas) -> str:
    return policy.rank(request, replicas)[0].replica.name


def test_a_balanced_fleet_sends_a_prompt_to_the_replica_holding_its_longest_prefix():
    policy = make_policy("sglang_cache_aware", seed=0)
    # r1 is far busier but within 64 requests of the idlest: the fleet counts as balanced.
    replicas = fleet(0, 60, 0)
    for _ in range(20):
        assert first(policy, prompt(1000, r0=200, r1=800), replicas) == "r1"


def test_a_prefix_under_the_threshold_goes_to_the_replica_with_the_smallest_record():
    # 0.3 of the prompt exactly is not more than the threshold.
    assert make_policy("sglang_cache_aware", seed=0).rank(prompt(1000, r0=300), fleet(0, 0))[0].terms["rule"] == 3.0
    policy = make_policy("sglang_cache_aware", seed=0)
    replicas = fleet(0, 0, 0, 0)
    # Each routed prompt grows its replica's record by what it did not hold, so four fresh
    # prompts of the same size land on four different replicas.
    picks = [first(policy, prompt(1000), replicas) for _ in range(4)]
    assert sorted(picks) == ["r0", "r1", "r2", "r3"]
    ranking = policy.rank(prompt(10), replicas)
    assert ranking[0].terms["rule"] == 3.0 and ranking[0].terms["recorded_tokens"] == 1010.0


def test_an_imbalanced_fleet_sends_every_prompt_to_the_idlest_replica():
    policy = make_policy("sglang_cache_aware", seed=0)
    replicas = fleet(70, 5, 3)
    ranking = policy.rank(prompt(1000, r0=1000), replicas)
    assert [c.replica.name for c in ranking] == ["r2", "r1", "r0"]
    assert ranking[0].terms["rule"] == 1.0
    # 70 against 50 is more than 64 apart only in ratio: balanced, so the cache wins again.
    assert first(policy, prompt(1000, r0=1000), fleet(70, 50, 60)) == "r0"


def test_the_thresholds_are_parameters():
    strict = make_policy("sglang_cache_aware", {"cache_threshold": 0.9, "balance_abs_threshold": 4}, seed=0)
    assert first(strict, prompt(1000, r0=800), fleet(0, 0)) == "r1"  # under 0.9: smallest record
    assert first(strict, prompt(1000, r0=1000), fleet(6, 1)) == "r1"  # 5 apart, 6x: imbalanced
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("sglang_cache_aware", {"cache_threshold": 1.5})
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        make_policy("sglang_cache_aware", {"balance_rel_threshold": "high"})


def test_its_record_forgets_replicas_that_left():
    policy = make_policy("sglang_cache_aware", seed=0)
    for generation in range(50):
        replicas = [FakeReplica(f"g{generation}-{i}") for i in range(2)]
        policy.rank(prompt(100), replicas)
    assert len(policy._recorded) <= 2 * 2 + 16
