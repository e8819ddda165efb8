"""The predictive policy, checked against hand-made fleets: it predicts milliseconds with
the engine model, keeps cache hits when the whole fleet is busy, spreads decode at light
load, avoids a replica fitted as slow, and keeps cache_aware's guard, ties, locality and
tiers."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest

from balancer.config import load_settings
from balancer.routing.adapters import AdapterDemand, AdapterSlots
from policies.base import MODEL_ITL_PARTS, MODEL_TTFT_PARTS, TTFT_TERM, RequestFeatures
from policies.predictive import PredictivePolicy
from policies.registry import POLICIES, make_policy
from tests.fakes import FakeReplica, holder_and_loader

TERMS = {"cached", "output_tokens", "model_itl_ms", "decode_speed", "ttft_ms", "model_ttft_ms", "decode_ms", "fleet_ms", "locality_ms", "busy", "persistence", "speed",
         "cost", "wait_ms", "tier", "adapter_ms", "evict_ms", "copy_credit_ms"}


def request(prompt_tokens: int, cached: Mapping[str, int] | None = None, *, max_tokens: int | None = None,
            origin_region: str | None = None, prefix_rate: float = 0.0) -> RequestFeatures:
    return RequestFeatures(route="/v1/chat/completions", model="m", prompt_tokens=prompt_tokens,
                           cached_tokens=dict(cached or {}), max_tokens=max_tokens, origin_region=origin_region,
                           prefix_rate=prefix_rate)


def first(policy: PredictivePolicy, fleet: list[FakeReplica], req: RequestFeatures) -> str:
    return policy.rank(req, fleet)[0].replica.name


def picks(policy: PredictivePolicy, fleet: list[FakeReplica], req: RequestFeatures, n: int = 200) -> Counter[str]:
    return Counter(first(policy, fleet, req) for _ in range(n))


def test_registered_and_asks_for_the_prompt() -> None:
    assert POLICIES["predictive"] is PredictivePolicy
    assert PredictivePolicy.needs_prompt


@pytest.mark.parametrize("params", [
    {"prefill_ms_per_token": 0}, {"fleet_weight": -1}, {"busy_reference_ms": 0}, {"chunk_tokens": 0.5},
    {"tie_tolerance_ratio": 2}, {"other_region_penalty_ms": 1, "same_region_penalty_ms": 2},
    {"decode_weight": "much"}, {"no_such_knob": 1},
])
def test_bad_parameters_are_refused_by_name(params: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(params))):
        make_policy("predictive", params)


def test_every_replica_once_with_terms_that_add_up() -> None:
    fleet = [FakeReplica(f"r{i}", prefill_tokens_queued=1000 * i, decoding=i, context_tokens=4000 * i) for i in range(5)]
    ranked = make_policy("predictive", seed=1).rank(request(4000, {"r2": 2000}, prefix_rate=5.0), fleet)
    assert sorted(c.replica.name for c in ranked) == [f"r{i}" for i in range(5)]
    for choice in ranked:
        t = choice.terms
        assert set(t) == TERMS
        assert t["cost"] == pytest.approx(t["model_ttft_ms"] * t["speed"] + t["decode_ms"] + t["fleet_ms"]
                                          + t["locality_ms"] - t["copy_credit_ms"])
        # Only a replica holding less of the prompt than r2 would make a copy worth a credit.
        assert (t["copy_credit_ms"] > 0) == (choice.replica.name != "r2")
        assert t["ttft_ms"] == pytest.approx(t["model_ttft_ms"] * choice.replica.ttft_scale)
        # The parts the core fits apart add up to the predictions they split.
        split = len(MODEL_TTFT_PARTS)
        assert len(choice.parts) == split + len(MODEL_ITL_PARTS)
        assert sum(choice.parts[:split]) == pytest.approx(t["model_ttft_ms"])
        assert sum(choice.parts[split:]) == pytest.approx(t["model_itl_ms"])


def test_an_idle_fleet_predicts_a_lone_prefill() -> None:
    policy = make_policy("predictive", {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0})
    choice = policy.rank(request(4096), [FakeReplica("r")])[0]
    # 4,096 tokens at 0.0191 ms plus their attention and one and a half iterations: ~95 ms.
    assert 85 < choice.terms["ttft_ms"] < 105
    assert choice.terms["busy"] == 0 and choice.terms["fleet_ms"] == 0


def test_a_cached_prefix_wins_on_an_idle_fleet() -> None:
    fleet = [FakeReplica(f"r{i}") for i in range(4)]
    assert picks(make_policy("predictive", seed=2), fleet, request(8000, {"r3": 7800})) == {"r3": 200}


def test_a_hot_replica_loses_once_its_queue_outweighs_the_prefix() -> None:
    fleet = [FakeReplica("hot", prefill_tokens_queued=40_000), FakeReplica("cold")]
    assert first(make_policy("predictive", seed=3), fleet, request(8000, {"hot": 8000})) == "cold"


def test_an_overloaded_fleet_keeps_the_hit_where_the_myopic_choice_would_not() -> None:
    # Every replica has a backlog. On its own first token the request is a little faster on
    # the shorter queue; counting the 8,000 tokens of GPU time it would spend there (and take
    # from everyone queued behind it), the replica holding its prefix is the better place.
    fleet = [FakeReplica("holder", prefill_tokens_queued=20_000), FakeReplica("short", prefill_tokens_queued=9_000)]
    req = request(10_000, {"holder": 8_000})
    myopic = make_policy("predictive", {"fleet_weight": 0, "tie_tolerance_ms": 0, "tie_tolerance_ratio": 0})
    assert first(myopic, fleet, req) == "short"
    policy = make_policy("predictive", {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0})
    ranked = policy.rank(req, fleet)
    assert ranked[0].replica.name == "holder"
    assert 0.5 < ranked[0].terms["busy"] < 1


def test_light_load_spreads_decode_instead_of_piling_onto_warm_replicas() -> None:
    # A shared 8k prompt: "warm" holds it but already decodes 24 sequences; "cold" is idle.
    warm = FakeReplica("warm", decoding=24, context_tokens=24 * 8200)
    fleet = [warm, FakeReplica("cold")]
    req = request(8200, {"warm": 8000}, max_tokens=200)
    assert first(make_policy("predictive", seed=4), fleet, req) == "cold"
    # A one-token answer has no decode to slow down: the warm replica answers first.
    assert first(make_policy("predictive", seed=4), fleet, request(8200, {"warm": 8000}, max_tokens=1)) == "warm"
    # And without the decode term the policy is the myopic time to first token.
    assert first(make_policy("predictive", {"decode_weight": 0}, seed=4), fleet, req) == "warm"


def test_a_sought_after_prefix_is_copied_to_an_idle_replica_and_a_one_off_is_not() -> None:
    # "warm" holds a shared 8k system prompt and decodes 3 sequences; "cold" is idle. For
    # this request alone the batch costs less than the prefill of a copy; at 12 requests a
    # second on that prefix the copy serves the requests after it, and the batch thins.
    fleet = [FakeReplica("warm", decoding=3, context_tokens=3 * 8200), FakeReplica("cold")]
    exact = make_policy("predictive", {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0})
    assert first(exact, fleet, request(8200, {"warm": 8000}, max_tokens=150)) == "warm"
    hot = request(8200, {"warm": 8000}, max_tokens=150, prefix_rate=12.0)
    ranked = exact.rank(hot, fleet)
    assert ranked[0].replica.name == "cold" and ranked[0].terms["copy_credit_ms"] > 100
    # The prediction is still the request's own wait: the copy's whole prefill.
    assert ranked[0].terms["ttft_ms"] > 150
    no_horizon = make_policy("predictive", {"copy_horizon_s": 0, "tie_tolerance_ms": 0, "tie_tolerance_ratio": 0})
    assert first(no_horizon, fleet, hot) == "warm"


def test_an_overloaded_fleet_keeps_the_hit_of_a_sought_after_prefix_too() -> None:
    fleet = [FakeReplica("holder", prefill_tokens_queued=20_000), FakeReplica("short", prefill_tokens_queued=9_000)]
    policy = make_policy("predictive", {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0})
    assert first(policy, fleet, request(10_000, {"holder": 8_000}, prefix_rate=40.0)) == "holder"


def test_a_replica_fitted_as_slow_gets_work_only_when_the_others_are_busier() -> None:
    slow = FakeReplica("slow", ttft_scale=5.0)
    fleet = [slow, FakeReplica("a", prefill_tokens_queued=3000), FakeReplica("b", prefill_tokens_queued=3000)]
    assert picks(make_policy("predictive", seed=5), fleet, request(1500))["slow"] == 0
    for r in fleet[1:]:
        r.prefill_tokens_queued = 60_000
    assert picks(make_policy("predictive", seed=5), fleet, request(1500))["slow"] == 200


def test_weight_reads_as_speed() -> None:
    fleet = [FakeReplica("fast", weight=2.0, prefill_tokens_queued=6000), FakeReplica("slow", prefill_tokens_queued=4000)]
    assert first(make_policy("predictive", seed=6), fleet, request(2000)) == "fast"


def test_near_ties_spread_and_clear_winners_do_not() -> None:
    fleet = [FakeReplica(f"r{i}") for i in range(4)]
    spread = picks(make_policy("predictive", seed=7), fleet, request(100), n=400)
    assert len(spread) == 4 and min(spread.values()) > 50


def test_another_region_costs_a_round_trip() -> None:
    fleet = [FakeReplica("east", labels={"region": "us-east"}, prefill_tokens_queued=2000),
             FakeReplica("west", labels={"region": "us-west"})]
    assert first(make_policy("predictive", seed=8), fleet, request(1000, origin_region="us-east")) == "east"
    assert first(make_policy("predictive", seed=8), fleet, request(1000, origin_region="us-west")) == "west"


def test_overflow_replicas_wait_behind_committed_ones_until_the_wait_is_too_long() -> None:
    spot = FakeReplica("spot", labels={"tier": "overflow"})
    base = FakeReplica("base", labels={"tier": "committed"}, prefill_tokens_queued=20_000)
    policy = make_policy("predictive", seed=9)
    ranked = policy.rank(request(1000), [spot, base])
    assert [c.replica.name for c in ranked] == ["base", "spot"] and ranked[1].terms["tier"] == 1.0
    base.prefill_tokens_queued = 80_000  # over a second and a half of prefill ahead
    assert first(policy, [spot, base], request(1000)) == "spot"


def test_replicas_of_one_kind_stay_equal_despite_the_noise_of_their_fits() -> None:
    fleet = [FakeReplica(f"r{i}", ttft_scale=s) for i, s in enumerate((0.9, 1.0, 1.1, 1.2))]
    spread = picks(make_policy("predictive", seed=10), fleet, request(100), n=400)
    assert len(spread) == 4 and min(spread.values()) > 50
    fleet[0].ttft_scale = 5.0
    assert picks(make_policy("predictive", seed=10), fleet, request(100), n=400)["r0"] == 0
    # Told to trust the profile, the policy ignores the fit.
    trusting = make_policy("predictive", {"use_fitted_speed": False}, seed=10)
    assert picks(trusting, fleet, request(100), n=400)["r0"] > 50
    with pytest.raises(ValueError, match="use_fitted_speed"):
        make_policy("predictive", {"use_fitted_speed": "no"})


def test_every_parameter_is_documented_and_the_example_config_uses_the_policy() -> None:
    root = Path(__file__).resolve().parents[2]
    documented = (root / "config" / "balancer.yaml").read_text()
    params = [name for name, p in inspect.signature(PredictivePolicy).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "seed"]
    missing = [name for name in params if f"#   {name}: " not in documented]
    assert not missing
    settings = load_settings(root / "config" / "cache-aware.yaml")
    assert settings.policy.name == "predictive"
    make_policy(settings.policy.name, settings.policy.params)  # every value it sets is valid
    assert {r.labels["tier"] for r in settings.replicas} == {"committed", "overflow"}


def test_a_prefill_that_would_stall_a_busy_batch_keeps_the_conversation_where_it_is_cached() -> None:
    # Both replicas decode; the one holding the conversation has the bigger batch. Moving the
    # request would spare its own tokens some batch, but its 6,000-token prefill would stall
    # the 24 sequences decoding on the other replica.
    fleet = [FakeReplica("warm", decoding=36, context_tokens=36 * 6000),
             FakeReplica("cold", decoding=24, context_tokens=24 * 6000)]
    req = request(6000, {"warm": 5800}, max_tokens=200)
    exact = {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0}
    assert first(make_policy("predictive", exact), fleet, req) == "warm"
    assert first(make_policy("predictive", {**exact, "prefill_stall_weight": 0, "avoidable_stall_weight": 0}), fleet, req) == "cold"


def test_replicas_not_yet_fitted_count_as_the_fitted_median() -> None:
    # Replicas sped up tenfold for a test: the one that answered first is fitted at 0.1 of
    # its profile; the others have not answered yet and must not look ten times slower.
    fleet = [FakeReplica("seen", ttft_scale=0.1, itl_scale=0.1, ttft_samples=5, itl_samples=5)]
    fleet += [FakeReplica(f"new{i}", ttft_samples=0, itl_samples=0) for i in range(3)]
    counts = picks(make_policy("predictive", seed=2), fleet, request(2000))
    assert counts["seen"] < 120 and len(counts) == 4, counts
    # Once they are fitted too, a real difference counts again.
    fitted = [FakeReplica("slow", ttft_scale=5.0, ttft_samples=5)] + [FakeReplica(f"r{i}") for i in range(3)]
    assert picks(make_policy("predictive", seed=2), fitted, request(2000))["slow"] == 0


def test_a_card_fitted_faster_at_attention_takes_the_long_prompts_not_the_short_ones() -> None:
    # One replica whose attention term is fitted at a tenth of the profile's, three as the
    # profile says; all idle. A 30k-token prompt spends a third of its prefill on attention.
    fleet = [FakeReplica("fast", ttft_terms=(1.0, 1.0, 0.1))]
    fleet += [FakeReplica(f"plain{i}", ttft_terms=(1.0, 1.0, 1.0)) for i in range(3)]
    shaped = picks(make_policy("predictive", seed=3), fleet, request(30_000))
    assert shaped == {"fast": 200}, shaped
    # A short prompt's attention is a rounding error: it goes anywhere.
    short = picks(make_policy("predictive", seed=3), fleet, request(500))
    assert min(short[r.name] for r in fleet) > 20, short
    # Blind to the terms, the long prompt goes anywhere too; so it does when the fast
    # replica's terms have not earned trust (they predict its answers no better).
    blind = picks(make_policy("predictive", {"use_fitted_terms": False}, seed=3), fleet, request(30_000))
    assert min(blind[r.name] for r in fleet) > 20, blind
    fleet[0].ttft_terms = None
    untrusted = picks(make_policy("predictive", seed=3), fleet, request(30_000))
    assert min(untrusted[r.name] for r in fleet) > 20, untrusted
    # The prediction is in the replica's own milliseconds: a tenth of the attention.
    fleet[0].ttft_terms = (1.0, 1.0, 0.1)
    choices = {c.replica.name: c for c in make_policy("predictive", seed=3).rank(request(30_000), fleet)}
    saved = choices["plain0"].parts[2] * 0.9  # the attention term
    assert choices["fast"].terms["ttft_ms"] == pytest.approx(choices["plain0"].terms["ttft_ms"] - saved)


def test_term_corrections_within_the_tolerance_count_as_equal() -> None:
    # Replicas of one kind whose fitted terms differ by the noise of what each happened to see.
    fleet = [FakeReplica("a", ttft_terms=(1.2, 0.9, 1.2)), FakeReplica("b", ttft_terms=(0.9, 1.05, 0.95))]
    ranked = make_policy("predictive", seed=1).rank(request(30_000), fleet)
    blind = make_policy("predictive", {"use_fitted_terms": False}, seed=1).rank(request(30_000), fleet)
    assert [c.terms["cost"] for c in ranked] == [c.terms["cost"] for c in blind]


def test_one_slow_answer_is_not_a_verdict_but_two_clipped_steps_are() -> None:
    # The fit moves at most 1.5x per answer: one unlucky answer, and a replica five times
    # slower after two.
    healthy = [FakeReplica(f"r{i}") for i in range(3)]
    unlucky = picks(make_policy("predictive", seed=4), healthy + [FakeReplica("x", ttft_scale=1.5, ttft_samples=1)],
                    request(2000))
    assert unlucky["x"] > 20, unlucky
    slow = picks(make_policy("predictive", seed=4), healthy + [FakeReplica("x", ttft_scale=2.25, ttft_samples=2)],
                 request(2000))
    assert slow["x"] == 0, slow


def _adapter_request(adapter: str | None = "sql") -> RequestFeatures:
    return RequestFeatures("/v1/completions", prompt_tokens=200, adapter=adapter, max_tokens=64)


def test_a_replica_holding_the_adapter_wins_over_one_that_must_load_it():
    holding, other = FakeReplica("holding"), FakeReplica("other")
    holding.adapter_slots = AdapterSlots(2, 500.0)
    other.adapter_slots = AdapterSlots(2, 500.0)
    holding.adapter_slots.started("sql")
    holding.adapter_slots.ended("sql")
    policy = PredictivePolicy(seed=0)
    ranked = policy.rank(_adapter_request(), [other, holding])
    assert ranked[0].replica is holding
    terms = {c.replica.name: c.terms for c in ranked}
    assert terms["holding"]["adapter_ms"] == 0 and terms["other"]["adapter_ms"] == 500.0
    # The load is part of the request's own predicted time to first token there.
    assert terms["other"]["model_ttft_ms"] - terms["holding"]["model_ttft_ms"] == pytest.approx(500.0)
    # A base-model request, or a policy blind to adapters, sees no difference.
    for request, blind in ((_adapter_request(None), PredictivePolicy(seed=0)),
                           (_adapter_request(), PredictivePolicy(seed=0, adapter_weight=0))):
        terms = {c.replica.name: c.terms for c in blind.rank(request, [other, holding])}
        assert terms["holding"]["adapter_ms"] == terms["other"]["adapter_ms"] == 0


def test_evicting_a_sought_after_adapter_costs_more_than_filling_a_free_slot_or_evicting_a_cold_one():
    demand = AdapterDemand()
    free, hot, cold = FakeReplica("free"), FakeReplica("hot"), FakeReplica("cold")
    for replica in (free, hot, cold):
        replica.adapter_slots = AdapterSlots(2, 500.0, demand)

    def serve(replica: FakeReplica, adapter: str, times: int = 1) -> None:
        for _ in range(times):
            replica.adapter_slots.started(adapter)
            replica.adapter_slots.ended(adapter)

    serve(free, "code")
    # cold's least recently used adapter was asked for once, long ago; hot's is asked for
    # often, and nowhere else.
    serve(cold, "old")
    serve(cold, "code", 300)
    serve(hot, "chat", 30)
    serve(hot, "code", 5)
    terms = {c.replica.name: c.terms for c in PredictivePolicy(seed=0).rank(_adapter_request(), [free, hot, cold])}
    # Each pays the prompt's prefill where nothing is cached (the same on all three); the
    # evictions differ.
    prefill = terms["free"]["evict_ms"]
    assert terms["hot"]["evict_ms"] - prefill == pytest.approx(500.0 * hot.adapter_slots.eviction_cost("chat"))
    assert terms["hot"]["evict_ms"] - prefill > 250.0 and terms["cold"]["evict_ms"] - prefill < 25.0
    assert terms["free"]["cost"] < terms["cold"]["cost"] < terms["hot"]["cost"]


def test_a_replica_whose_slots_are_all_in_use_makes_the_request_wait_for_one():
    busy, idle = FakeReplica("busy"), FakeReplica("idle")
    for replica in (busy, idle):
        replica.adapter_slots = AdapterSlots(1, 500.0)
    busy.adapter_slots.started("chat")  # still running
    idle.adapter_slots.started("chat")
    idle.adapter_slots.ended("chat")
    terms = {c.replica.name: c.terms for c in PredictivePolicy(seed=0).rank(_adapter_request(), [busy, idle])}
    assert terms["busy"]["adapter_ms"] > terms["idle"]["adapter_ms"] == 500.0


def test_an_overloaded_fleet_waits_where_the_adapter_is_rather_than_stall_a_queue_with_a_load():
    # Both replicas have a long prefill backlog. On the request's own first token, loading
    # the adapter beside the shorter queue is faster; but the load stalls that replica for
    # 500 ms, and everyone queued there waits it out. On an idle fleet a load costs only the
    # request's own wait.
    holding, loading = holder_and_loader(90_000, 30_000)
    ties = {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0}
    ranked = PredictivePolicy(seed=0, **ties).rank(_adapter_request(), [loading, holding])
    terms = {c.replica.name: c.terms for c in ranked}
    assert terms["loading"][TTFT_TERM] < terms["holding"][TTFT_TERM]
    assert terms["loading"]["busy"] > 0.9
    assert ranked[0].replica is holding
    # With the shorter queue empty the fleet is not busy, and the load beside it is worth it.
    holding.prefill_tokens_queued, loading.prefill_tokens_queued = 45_000, 0
    assert PredictivePolicy(seed=0, **ties).rank(_adapter_request(), [loading, holding])[0].replica is loading


def test_a_ttft_target_steers_to_a_replica_that_meets_it_only_when_one_does() -> None:
    # The replica with prefill queued is cheaper overall (its batch is empty, the answer is
    # long) but slower to the first token: about 108 ms against 50.
    fleet = [FakeReplica("queued", prefill_tokens_queued=3000), FakeReplica("batch", decoding=4, context_tokens=8000)]
    exact = {"tie_tolerance_ms": 0, "tie_tolerance_ratio": 0}

    def ranked(params: dict, target_ms: float | None = None) -> list:
        req = RequestFeatures(route="/v1/chat/completions", model="m", prompt_tokens=2000, max_tokens=500,
                              ttft_target_ms=target_ms)
        return make_policy("predictive", {**exact, **params}).rank(req, fleet)

    assert ranked({})[0].replica.name == "queued"
    steer = {"ttft_target_weight": 10}
    steered = ranked(steer, target_ms=80)
    assert [c.replica.name for c in steered] == ["batch", "queued"]
    assert steered[1].terms["target_ms"] == pytest.approx(10 * (steered[1].terms[TTFT_TERM] - 80))
    # The policy's own target serves requests without one; a request's own target wins.
    assert ranked({**steer, "ttft_target_ms": 80})[0].replica.name == "batch"
    assert ranked({**steer, "ttft_target_ms": 80}, target_ms=200)[0].replica.name == "queued"
    # Neither can meet 30 ms: the ranking is the usual one. And without the weight, targets are inert.
    assert ranked(steer, target_ms=30)[0].replica.name == "queued"
    assert "target_ms" not in ranked(steer, target_ms=30)[0].terms
    assert ranked({}, target_ms=80)[0].replica.name == "queued"
