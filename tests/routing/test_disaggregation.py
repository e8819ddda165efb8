"""Choosing the pair: the decode replica by its batch, its KV room and the link from the
prefill replica; one replica instead when the prompt is mostly cached or a pool is empty."""

from __future__ import annotations

import pytest

from balancer.config import DisaggregationSettings, ReplicaSettings
from balancer.routing.disaggregation import (
    COLOCATED_CACHED,
    COLOCATED_NO_PAIR,
    colocate,
    link_gbps,
    pools,
    rank_decode,
    transfer_ms,
)
from balancer.routing.fleet import Replica

SETTINGS = DisaggregationSettings()


def replica(name: str, role: str, **labels: str) -> Replica:
    return Replica(ReplicaSettings(url=f"http://127.0.0.1:9000/{name}", name=name, role=role, labels=labels))


def test_pools_by_role_and_with_vllm_any_replica_can_serve_alone() -> None:
    fleet = [replica("p", "prefill"), replica("d", "decode"), replica("b", "both")]
    sglang, vllm = pools(fleet, "sglang"), pools(fleet, "vllm")
    assert [r.name for r in sglang.prefill] == ["p"] and [r.name for r in sglang.decode] == ["d"]
    assert [r.name for r in sglang.whole] == ["b"]
    assert [r.name for r in vllm.whole] == ["p", "d", "b"]


def test_a_mostly_cached_prompt_runs_whole_where_it_can_and_a_missing_pool_leaves_no_pair() -> None:
    both = pools([replica("p", "prefill"), replica("d", "decode"), replica("b", "both")], "sglang")
    assert colocate(both, 8000, 7800, SETTINGS) == COLOCATED_CACHED
    assert colocate(both, 8000, 0, SETTINGS) is None
    only_split = pools([replica("p", "prefill"), replica("d", "decode")], "sglang")
    assert colocate(only_split, 8000, 7800, SETTINGS) is None  # nothing could take it whole
    no_decode = pools([replica("p", "prefill"), replica("b", "both")], "sglang")
    assert colocate(no_decode, 8000, 0, SETTINGS) == COLOCATED_NO_PAIR


def test_the_link_is_faster_the_closer_the_pair() -> None:
    p = replica("p", "prefill", host="h1", zone="z1")
    same_host, same_zone, far = (replica("a", "decode", host="h1", zone="z1"),
                                 replica("b", "decode", host="h2", zone="z1"),
                                 replica("c", "decode", host="h3", zone="z2"))
    assert link_gbps(p, same_host, SETTINGS) > link_gbps(p, same_zone, SETTINGS) > link_gbps(p, far, SETTINGS)
    # 8k tokens of llama-3.1-8b (1 GiB of KV) over 100 Gb/s: about 86 ms.
    assert 80 < transfer_ms(8192, 100.0, SETTINGS) < 90
    ranked = rank_decode([far, same_zone, same_host], p, 8192, 100, SETTINGS, [0.0, 0.0, 0.0])
    assert [c.replica.name for c in ranked] == ["a", "b", "c"]
    assert ranked[0].terms["transfer_ms"] < ranked[-1].terms["transfer_ms"]


def test_a_busier_decode_batch_and_a_full_kv_cache_rank_later() -> None:
    p = replica("p", "prefill")
    idle, busy = replica("idle", "decode"), replica("busy", "decode")
    busy.decoding, busy.context_tokens = 64, 64 * 4000
    ranked = rank_decode([busy, idle], p, 4000, 300, SETTINGS, [0.0, 0.0])
    assert [c.replica.name for c in ranked] == ["idle", "busy"]
    full = Replica(ReplicaSettings(url="http://127.0.0.1:9000/full", name="full", role="decode",
                                   kv_capacity_tokens=5000))
    full.context_tokens = 3000
    ranked = rank_decode([full, busy], p, 4000, 300, SETTINGS, [0.0, 0.0])
    assert ranked[-1].replica.name == "full"


def test_a_replica_fitted_slower_at_decoding_ranks_later_and_each_choice_carries_the_profiles_time() -> None:
    p = replica("p", "prefill")
    slow, fast = replica("slow", "decode"), replica("fast", "decode")
    alike = rank_decode([slow, fast], p, 4000, 300, SETTINGS, [0.0, 0.5])
    assert [c.replica.name for c in alike] == ["slow", "fast"]  # equal but for the tie-break
    ranked = rank_decode([slow, fast], p, 4000, 300, SETTINGS, [0.0, 0.5], [3.0, 1.0])
    assert [c.replica.name for c in ranked] == ["fast", "slow"]
    assert ranked[1].terms["decode_speed"] == 3.0 and "decode_speed" not in ranked[0].terms
    # What the answer's own gaps between tokens are compared with: the profile's time, not
    # the fitted one.
    assert ranked[1].terms["model_itl_ms"] == ranked[0].terms["model_itl_ms"] > 0


def _core(replicas: list[Replica]):
    from balancer.config import RoutingSettings
    from balancer.routing.admission import AdmissionQueue
    from balancer.routing.core import CoreSettings, RoutingCore
    from balancer.routing.fleet import Fleet
    from balancer.routing.tracker import CacheTracker
    from policies.registry import make_policy

    fleet = Fleet([r.settings for r in replicas])
    core = RoutingCore(fleet, make_policy("predictive", seed=0), CacheTracker(RoutingSettings(), lambda: 0.0),
                       AdmissionQueue(8, 8), CoreSettings(), call_at=lambda when, cb: None)
    return core, fleet


def test_a_saturated_prefill_pool_sends_the_request_whole_where_vllm_allows() -> None:
    from balancer.routing.disaggregation import COLOCATED_FASTER, SPLIT, plan_split
    from policies.base import RequestFeatures

    # One host: the transfer is quick, and an idle pair beats a whole run on the decode side.
    core, fleet = _core([replica("p", "prefill", host="h"), replica("d", "decode", host="h")])
    prefill, decode = fleet.replicas
    prompt = "a long document to summarize " * 2000
    features = RequestFeatures("/v1/completions", stream=True)
    vllm = DisaggregationSettings(protocol="vllm")
    assert plan_split(core, "/v1/completions", features, prompt, fleet.replicas, vllm).outcome == SPLIT
    prefill.prefill_tokens_queued = 400_000  # seconds of prefill queued on the only prefill replica
    plan = plan_split(core, "/v1/completions", features, prompt, fleet.replicas, vllm)
    assert plan.outcome == COLOCATED_FASTER and plan.decode is None
    assert plan.journey.ranking[0].replica is decode
    # SGLang's decode servers cannot take a request alone: the pair stands.
    assert plan_split(core, "/v1/completions", features, prompt, fleet.replicas, SETTINGS).outcome == SPLIT


def test_the_decode_replica_is_priced_with_its_models_own_decode_iteration() -> None:
    from balancer.config import PolicySettings
    from balancer.routing.disaggregation import SPLIT, plan_split
    from policies.base import RequestFeatures
    from policies.registry import make_policy

    pair = [ReplicaSettings(url=f"http://127.0.0.1:9000/{n}", name=n, role=role, model=model)
            for n, role, model in (("p8", "prefill", "small"), ("d8", "decode", "small"),
                                   ("p70", "prefill", "big"), ("d70", "decode", "big"))]
    core, fleet = _core([Replica(s) for s in pair])
    # The 70B on four H100s (docs/calibration.md): its own decode iteration, as per_model gives it.
    big = PolicySettings("predictive", {"decode_iteration_ms": 17.6, "decode_ms_per_seq": 0.0403,
                                        "decode_ms_per_context_token": 2.79e-5}, 0)
    core.model_policies["big"] = make_policy(big.name, big.params, big.seed)
    prompt = "a long document to summarize " * 2000
    itl = {}
    for model in ("small", "big"):
        features = RequestFeatures("/v1/completions", model=model, stream=True, max_tokens=100)
        candidates = [r for r in fleet.replicas if r.serves(model)]
        plan = plan_split(core, "/v1/completions", features, prompt, candidates, SETTINGS)
        assert plan.outcome == SPLIT and plan.decode is not None
        itl[model] = plan.decode.ranking[0].terms["model_itl_ms"]
    # An idle decode replica: its fixed cost, one sequence, the prompt and half the answer.
    tokens = plan.decode.features.prompt_tokens + 50
    assert itl["small"] == pytest.approx(8.3 + 0.009 + 4.39e-5 * tokens)
    assert itl["big"] == pytest.approx(17.6 + 0.0403 + 2.79e-5 * tokens)


def test_a_prompt_cached_on_one_prefill_replica_runs_whole_even_when_a_copy_ranks_first() -> None:
    from balancer.routing.disaggregation import COLOCATED_CACHED, plan_split
    from policies.base import RequestFeatures

    core, fleet = _core([replica("p1", "prefill", host="h"), replica("p2", "prefill", host="h"),
                         replica("d", "decode", host="h")])
    p1, p2, _ = fleet.replicas
    system = "Shared instructions for every caller of this service. " * 600
    for i in range(60):  # a sought-after system prompt, all of it served by p1 so far
        routed = core.tracker.predict(system + f"question {i}")
        core.tracker.start(routed, p1)
    p1.decoding, p1.context_tokens = 4, 4 * 8200
    features = RequestFeatures("/v1/completions", stream=True, max_tokens=150)
    prompt = system + "one more question"
    prefill_ranking = core.plan("/v1/completions", features, prompt, [p1, p2]).ranking
    assert prefill_ranking[0].replica is p2 and prefill_ranking[0].terms["copy_credit_ms"] > 0
    plan = plan_split(core, "/v1/completions", features, prompt, fleet.replicas, DisaggregationSettings(protocol="vllm"))
    assert plan.outcome == COLOCATED_CACHED and plan.decode is None
