"""The cache-aware policy, checked against hand-made fleets.

Costs are in prefill-token equivalents; with the default weights and replica weight 1.0 a
replica's cost is: uncached prompt tokens + queued prefill tokens + 32 per decoding sequence
+ 4096 when it sits in another region than the request.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

import pytest

from policies.base import Choice, ReplicaView, RequestFeatures
from policies.cache_aware import CacheAwarePolicy
from policies.registry import POLICIES, make_policy
from tests.fakes import FakeReplica, holder_and_loader

TERM_NAMES = {"cached", "uncached", "queued", "decode", "locality", "adapter", "cost", "wait_ms", "tier"}


def fleet_of(n: int, **fields) -> list[FakeReplica]:
    return [FakeReplica(f"r{i}", **fields) for i in range(n)]


def request(
    prompt_tokens: int = 0,
    cached: Mapping[str, int] | None = None,
    origin_region: str | None = None,
) -> RequestFeatures:
    return RequestFeatures(
        route="/v1/chat/completions",
        model="m",
        prompt_tokens=prompt_tokens,
        cached_tokens=dict(cached or {}),
        origin_region=origin_region,
    )


def names(choices: Iterable[Choice]) -> list[str]:
    return [c.replica.name for c in choices]


def first_picks(policy, fleet, req: RequestFeatures, calls: int) -> Counter[str]:
    return Counter(policy.rank(req, fleet)[0].replica.name for _ in range(calls))


# --- interface ------------------------------------------------------------------------------


def test_registered_under_its_yaml_name_and_asks_for_the_prompt():
    assert POLICIES["cache_aware"] is CacheAwarePolicy
    policy = make_policy("cache_aware", {"other_region_penalty_tokens": 1000}, seed=1)
    assert isinstance(policy, CacheAwarePolicy)
    assert policy.other_region_penalty_tokens == 1000.0
    assert CacheAwarePolicy.needs_prompt is True


def test_fake_replica_satisfies_the_protocol():
    assert isinstance(FakeReplica("r0"), ReplicaView)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_every_replica_once_with_consistent_float_terms(n):
    policy = CacheAwarePolicy(seed=5)
    fleet = [
        FakeReplica(
            f"r{i}",
            weight=1.0 + (i % 3) / 2,
            labels={
                "region": ("us-east", "us-west")[i % 2],
                "tier": "overflow" if i % 4 == 3 else "committed",
            },
            prefill_tokens_queued=(i * 977) % 5000,
            decoding=(i * 7) % 11,
        )
        for i in range(n)
    ]
    fleet.append(FakeReplica("r1", prefill_tokens_queued=10))  # a repeated name keeps its entry
    for call in range(40):
        req = request(
            prompt_tokens=1000 + 97 * call,
            cached={f"r{j}": 300 * j for j in range(0, n, 2)},
            origin_region=(None, "us-east", "eu-west")[call % 3],
        )
        ranking = policy.rank(req, fleet)
        assert sorted(map(id, (c.replica for c in ranking))) == sorted(map(id, fleet))
        for choice in ranking:
            t = choice.terms
            assert set(t) == TERM_NAMES
            assert all(isinstance(v, float) for v in t.values())
            assert t["cost"] == pytest.approx(
                t["uncached"] + t["queued"] + t["decode"] + t["locality"]
            )
            r = choice.replica
            assert t["uncached"] == pytest.approx((req.prompt_tokens - t["cached"]) / r.weight)
            assert t["queued"] == pytest.approx(r.prefill_tokens_queued / r.weight)
            assert t["decode"] == pytest.approx(32.0 * r.decoding / r.weight)
            assert t["tier"] in (0.0, 1.0)
            assert t["wait_ms"] == pytest.approx(
                (r.prefill_tokens_queued + req.prompt_tokens - t["cached"]) / r.weight / 43.0
            )


def test_same_seed_gives_same_rankings():
    fleet = fleet_of(6)
    req = request(prompt_tokens=2000)
    a, b = CacheAwarePolicy(seed=3), CacheAwarePolicy(seed=3)
    assert [names(a.rank(req, fleet)) for _ in range(20)] == [
        names(b.rank(req, fleet)) for _ in range(20)
    ]


def test_cached_tokens_are_clamped_to_the_prompt():
    fleet = fleet_of(2)
    ranking = CacheAwarePolicy(seed=1).rank(request(1000, {"r0": 5000, "r1": -3}), fleet)
    terms = {c.replica.name: c.terms for c in ranking}
    assert (terms["r0"]["cached"], terms["r0"]["uncached"]) == (1000.0, 0.0)
    assert (terms["r1"]["cached"], terms["r1"]["uncached"]) == (0.0, 1000.0)


# --- cache affinity against load ------------------------------------------------------------


def test_prefix_affinity_wins_at_equal_load():
    fleet = fleet_of(4, prefill_tokens_queued=1000, decoding=3)
    req = request(prompt_tokens=5000, cached={"r2": 4000, "r3": 1000})
    policy = CacheAwarePolicy(seed=2)
    for _ in range(200):
        ranking = policy.rank(req, fleet)
        # Longest cached prefix first, then the shorter one, then the cold ones.
        assert names(ranking)[:2] == ["r2", "r3"]


def test_saturated_replica_loses_to_a_cold_idle_one():
    fleet = [FakeReplica("hot", prefill_tokens_queued=40_000, decoding=50), FakeReplica("cold")]
    req = request(prompt_tokens=5000, cached={"hot": 4500})
    policy = CacheAwarePolicy(seed=3)
    assert first_picks(policy, fleet, req, 200) == {"cold": 200}
    # ... but a short queue is worth waiting behind for a long cached prefix.
    fleet[0].prefill_tokens_queued, fleet[0].decoding = 2000, 4
    assert first_picks(policy, fleet, req, 200) == {"hot": 200}


def test_decoding_sequences_count_against_a_replica():
    fleet = [FakeReplica("busy", decoding=200), FakeReplica("quiet", decoding=2)]
    req = request(prompt_tokens=3000)
    assert first_picks(CacheAwarePolicy(seed=4), fleet, req, 200) == {"quiet": 200}
    # With the decode term switched off the two are tied and share the traffic.
    picks = first_picks(CacheAwarePolicy(decode_tokens_per_seq=0, seed=4), fleet, req, 400)
    assert min(picks.values()) > 150


def test_weight_reads_as_speed():
    # A replica twice as fast clears twice the queue in the same time.
    fleet = [FakeReplica("fast", weight=2.0, prefill_tokens_queued=6000), FakeReplica("slow")]
    fleet[1].prefill_tokens_queued = 4000
    ranking = CacheAwarePolicy(seed=1).rank(request(prompt_tokens=1000), fleet)
    assert names(ranking) == ["fast", "slow"]
    assert ranking[0].terms["queued"] == 3000.0 and ranking[0].terms["uncached"] == 500.0


# --- spreading ------------------------------------------------------------------------------


def test_idle_fleet_spreads_misses_over_every_replica():
    fleet = fleet_of(8)
    req = request(prompt_tokens=1500)
    counts = first_picks(CacheAwarePolicy(seed=6), fleet, req, 2000)
    assert set(counts) == {r.name for r in fleet}
    assert min(counts.values()) > 180, counts  # 250 each on average


def test_near_ties_spread_but_clear_winners_do_not():
    fleet = fleet_of(3)
    fleet[1].prefill_tokens_queued = 100  # within the 128 + 5 % tolerance of r0
    fleet[2].prefill_tokens_queued = 600  # clearly worse
    counts = first_picks(CacheAwarePolicy(seed=7), fleet, request(prompt_tokens=1000), 1000)
    assert counts["r2"] == 0
    assert counts["r0"] > counts["r1"] > 50


def simulate_shared_system_prompt(
    policy: CacheAwarePolicy,
    *,
    replicas: int = 8,
    requests: int = 1000,
    system_tokens: int = 2000,
    user_tokens: int = 500,
    drain_tokens: int = 70,
    warm: Iterable[str] = ("r0",),
) -> tuple[Counter[str], int]:
    """Every request is one shared system prompt plus its own user part.

    Routing a request queues its uncached tokens on the chosen replica (as the balancer does
    at routing time) and makes that replica hold the system prompt; between two requests
    every replica prefills `drain_tokens` of its queue. The default, 70 tokens (one request
    every 1.6 ms at 43 tokens/ms), offers a warm fleet 500 / (8 × 70) ≈ 90 % of its prefill
    capacity: a busy fleet, where a hot spot hurts. Returns the requests per replica and the
    longest queue any replica had.
    """
    fleet = fleet_of(replicas)
    holders = set(warm)
    prompt = system_tokens + user_tokens
    counts: Counter[str] = Counter({r.name: 0 for r in fleet})
    longest_queue = 0
    for _ in range(requests):
        for r in fleet:
            r.prefill_tokens_queued = max(0, r.prefill_tokens_queued - drain_tokens)
        req = request(prompt, {name: system_tokens for name in holders})
        chosen = policy.rank(req, fleet)[0].replica
        assert isinstance(chosen, FakeReplica)
        chosen.prefill_tokens_queued += prompt - req.cached_tokens.get(chosen.name, 0)
        longest_queue = max(longest_queue, chosen.prefill_tokens_queued)
        holders.add(chosen.name)
        counts[chosen.name] += 1
    return counts, longest_queue


@pytest.mark.parametrize("seed", [8, 9, 10])
@pytest.mark.parametrize("warm", [(), ("r0",)], ids=["nobody-warm", "one-warm"])
def test_shared_system_prompt_spreads_traffic(warm, seed):
    counts, _ = simulate_shared_system_prompt(CacheAwarePolicy(seed=seed), warm=warm)
    assert sum(counts.values()) == 1000
    assert min(counts.values()) > 0, counts
    assert max(counts.values()) / min(counts.values()) < 2, counts


def test_shared_system_prompt_burst_spreads_by_queued_tokens():
    # 200 requests at once (nothing drains): only the queue counted at routing time can stop
    # the one replica holding the system prompt from taking them all.
    counts, _ = simulate_shared_system_prompt(
        CacheAwarePolicy(seed=9), requests=200, drain_tokens=0
    )
    assert min(counts.values()) > 0, counts
    assert max(counts.values()) / min(counts.values()) < 2, counts


def test_shared_system_prompt_at_light_load_stays_on_warm_replicas_with_a_bounded_queue():
    # Offered 500 / (8 × 430) ≈ 15 % of the fleet: two warm replicas carry it all, each
    # request's first token as soon as anywhere else (a cold replica would first prefill the
    # 2,000-token system prompt), and no queue grows past what that prompt is worth.
    counts, longest_queue = simulate_shared_system_prompt(
        CacheAwarePolicy(seed=8), drain_tokens=430
    )
    assert sum(1 for n in counts.values() if n) >= 2, counts
    assert longest_queue <= 2000 + 500 + 128 + 0.05 * 2500


def test_without_the_queue_term_the_system_prompt_is_a_hot_spot():
    # The control for the tests above: the queue term is what spreads the load.
    counts, longest_queue = simulate_shared_system_prompt(CacheAwarePolicy(queue_weight=0, seed=8))
    assert counts["r0"] == 1000
    assert longest_queue > 100_000


# --- locality -------------------------------------------------------------------------------


def test_same_region_beats_other_region_at_equal_cost():
    fleet = [
        FakeReplica("far", labels={"region": "us-west", "zone": "us-west-2a"}),
        FakeReplica("near", labels={"region": "us-east", "zone": "us-east-1a"}),
    ]
    req = request(prompt_tokens=2000, origin_region="us-east")
    policy = CacheAwarePolicy(seed=10)
    for _ in range(100):
        ranking = policy.rank(req, fleet)
        assert names(ranking) == ["near", "far"]
        assert [c.terms["locality"] for c in ranking] == [0.0, 4096.0]


def test_a_long_cached_prefix_can_be_worth_the_trip():
    fleet = [
        FakeReplica("far", labels={"region": "us-west"}),
        FakeReplica("near", labels={"region": "us-east"}),
    ]
    req = request(prompt_tokens=20_000, cached={"far": 16_000}, origin_region="us-east")
    assert first_picks(CacheAwarePolicy(seed=11), fleet, req, 100) == {"far": 100}


def test_unknown_origin_or_region_costs_nothing():
    fleet = [FakeReplica("labelled", labels={"region": "us-west"}), FakeReplica("bare")]
    policy = CacheAwarePolicy(same_region_penalty_tokens=10, seed=12)
    for origin in (None, "us-east"):
        terms = {
            c.replica.name: c.terms["locality"]
            for c in policy.rank(request(100, origin_region=origin), fleet)
        }
        assert terms == {"labelled": 0.0 if origin is None else 4096.0, "bare": 0.0}
    terms = {
        c.replica.name: c.terms["locality"]
        for c in policy.rank(request(100, origin_region="us-west"), fleet)
    }
    assert terms == {"labelled": 10.0, "bare": 0.0}


# --- tiers ----------------------------------------------------------------------------------


def tiered_fleet(committed_queued: int) -> list[FakeReplica]:
    return [
        FakeReplica("spare", labels={"region": "us-east", "tier": "overflow"}),
        FakeReplica(
            "c0",
            labels={"region": "us-east", "tier": "committed"},
            prefill_tokens_queued=committed_queued,
        ),
        FakeReplica("c1", labels={"region": "us-east"}, prefill_tokens_queued=committed_queued),
    ]


def test_overflow_ranked_last_when_committed_capacity_is_light():
    # Even with the cheaper (cached, idle) overflow replica: 2,000 + 1,000 tokens ≈ 70 ms wait.
    fleet = tiered_fleet(committed_queued=2000)
    req = request(prompt_tokens=1000, cached={"spare": 1000}, origin_region="us-east")
    policy = CacheAwarePolicy(seed=13)
    for _ in range(100):
        ranking = policy.rank(req, fleet)
        assert names(ranking)[-1] == "spare"
        assert [c.terms["tier"] for c in ranking] == [0.0, 0.0, 1.0]
        assert ranking[-1].terms["cost"] < ranking[0].terms["cost"]


def test_overflow_ranked_first_under_pressure():
    # 60,000 + 1,000 queued tokens at 43 tokens/ms ≈ 1.4 s > the 1 s threshold.
    fleet = tiered_fleet(committed_queued=60_000)
    req = request(prompt_tokens=1000, origin_region="us-east")
    ranking = CacheAwarePolicy(seed=14).rank(req, fleet)
    assert names(ranking)[0] == "spare"
    assert all(c.terms["tier"] == 0.0 for c in ranking)
    assert min(c.terms["wait_ms"] for c in ranking[1:]) > 1000.0


def test_overflow_threshold_uses_the_best_committed_replica():
    fleet = tiered_fleet(committed_queued=60_000)
    fleet[2].prefill_tokens_queued = 0  # one committed replica is free: no overflow
    ranking = CacheAwarePolicy(seed=15).rank(request(prompt_tokens=1000), fleet)
    assert names(ranking) == ["c1", "c0", "spare"]
    # The threshold is a parameter: a 0 ms target sends work to overflow whenever it is cheaper.
    ranking = CacheAwarePolicy(overflow_after_ms=0, seed=15).rank(request(1000), fleet)
    assert names(ranking)[:2] in (["c1", "spare"], ["spare", "c1"])


def test_an_all_overflow_fleet_is_ranked_by_cost():
    fleet = [
        FakeReplica("o0", labels={"tier": "overflow"}, prefill_tokens_queued=5000),
        FakeReplica("o1", labels={"tier": "overflow"}),
    ]
    ranking = CacheAwarePolicy(seed=16).rank(request(prompt_tokens=100), fleet)
    assert names(ranking) == ["o1", "o0"]
    assert [c.terms["tier"] for c in ranking] == [0.0, 0.0]


# --- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"prefill_weight": 0}, r"prefill_weight must be a finite number > 0 \(cost tokens"),
        ({"prefill_weight": -1.0}, r"prefill_weight must be a finite number > 0"),
        ({"queue_weight": -0.5}, r"queue_weight must be a finite number >= 0 \(cost tokens"),
        ({"queue_weight": "1"}, r"queue_weight must be a number \(cost tokens"),
        ({"decode_tokens_per_seq": math.nan}, r"decode_tokens_per_seq .* \(tokens per decoding"),
        ({"decode_tokens_per_seq": True}, r"decode_tokens_per_seq must be a number"),
        ({"same_region_penalty_tokens": -1}, r"same_region_penalty_tokens .* \(tokens\)"),
        ({"other_region_penalty_tokens": math.inf}, r"other_region_penalty_tokens .* \(tokens\)"),
        (
            {"same_region_penalty_tokens": 500, "other_region_penalty_tokens": 100},
            r"other_region_penalty_tokens \(tokens\) must be >= same_region_penalty_tokens",
        ),
        ({"overflow_after_ms": -1}, r"overflow_after_ms must be a finite number >= 0 \(ms\)"),
        ({"overflow_after_ms": None}, r"overflow_after_ms must be a number \(ms\)"),
        ({"prefill_tokens_per_ms": 0}, r"prefill_tokens_per_ms .* > 0 \(tokens per ms\)"),
        ({"tie_tolerance_tokens": -5}, r"tie_tolerance_tokens .* \(tokens\)"),
        ({"tie_tolerance_ratio": 1.5}, r"tie_tolerance_ratio must be between 0 and 1"),
        ({"tie_tolerance_ratio": -0.1}, r"tie_tolerance_ratio .* \(fraction of the cost\)"),
        ({"prefil_weight": 1.0}, r"unknown parameter\(s\) for policy 'cache_aware': prefil_weight"),
    ],
)
def test_bad_params_raise(params, message):
    with pytest.raises(ValueError, match=message):
        make_policy("cache_aware", params)


def test_defaults_match_the_documented_calibration():
    p = CacheAwarePolicy()
    assert (p.prefill_weight, p.queue_weight, p.decode_tokens_per_seq) == (1.0, 1.0, 32.0)
    assert (p.same_region_penalty_tokens, p.other_region_penalty_tokens) == (0.0, 4096.0)
    assert (p.overflow_after_ms, p.prefill_tokens_per_ms) == (1000.0, 43.0)
    assert (p.tie_tolerance_tokens, p.tie_tolerance_ratio) == (128.0, 0.05)




def test_a_replica_holding_the_adapter_wins_unless_blind_to_adapters():
    from balancer.routing.adapters import AdapterSlots

    holding, other = FakeReplica("holding"), FakeReplica("other")
    holding.adapter_slots, other.adapter_slots = AdapterSlots(1, 500.0), AdapterSlots(1, 500.0)
    holding.adapter_slots.started("sql")
    holding.adapter_slots.ended("sql")
    # The other replica has the prompt cached and the holder is busier: the load still costs more.
    request = RequestFeatures("/v1/completions", prompt_tokens=2000, cached_tokens={"other": 2000}, adapter="sql")
    holding.prefill_tokens_queued = 4000
    ranked = CacheAwarePolicy(seed=0).rank(request, [other, holding])
    assert ranked[0].replica is holding
    terms = {c.replica.name: c.terms for c in ranked}
    assert terms["holding"]["adapter"] == 0 and terms["other"]["adapter"] == pytest.approx(500.0 * 43.0)
    assert terms["other"]["wait_ms"] == pytest.approx(500.0)  # its prompt cached: the load is all its wait
    blind = CacheAwarePolicy(seed=0, adapter_weight=0).rank(request, [other, holding])
    assert blind[0].replica is other and all(c.terms["adapter"] == 0 for c in blind)


def test_an_overloaded_fleet_waits_where_the_adapter_is_rather_than_stall_a_queue_with_a_load():
    # Both replicas have a long prefill backlog. For this request alone, loading the adapter
    # beside the shorter queue is cheaper; but the load stalls that replica for 500 ms and
    # everyone queued there waits it out. On a fleet with an idle replica a load costs only
    # its own time.
    holding, loading = holder_and_loader(90_000, 60_000)
    request = RequestFeatures("/v1/completions", prompt_tokens=64, adapter="sql")
    ties = {"tie_tolerance_tokens": 0, "tie_tolerance_ratio": 0}
    assert CacheAwarePolicy(seed=0, overload_load_weight=0, **ties).rank(request, [loading, holding])[0].replica is loading
    ranked = CacheAwarePolicy(seed=0, **ties).rank(request, [loading, holding])
    assert ranked[0].replica is holding
    assert ranked[1].terms["adapter"] > 4 * 500.0 * 43.0  # the load at nearly five times its time
    # With the shorter queue empty, the load beside it is worth it.
    holding.prefill_tokens_queued, loading.prefill_tokens_queued = 45_000, 0
    ranked = CacheAwarePolicy(seed=0, **ties).rank(request, [loading, holding])
    assert ranked[0].replica is loading
    assert ranked[0].terms["adapter"] == pytest.approx(500.0 * 43.0)


def test_the_overload_load_weight_is_checked():
    with pytest.raises(ValueError, match="overload_load_weight"):
        CacheAwarePolicy(overload_load_weight=-1)
