"""The limit beside the result: each request's TTFT on an ideal fleet bounds what any policy
gets, and reports carry it."""

from __future__ import annotations

from balancer.config import PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.compare.report import against_ideal
from loadtest.simulator.cli import ideal_for
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.ideal import ideal_ttfts
from loadtest.simulator.simulator import MODEL, Simulator

WORKLOAD = "shared-prefix,groups=3,prompts_per_group=10,system_tokens=3000,question_tokens=80,output_tokens=30,rate=20"


def test_no_policy_beats_the_ideal_fleet_on_any_request() -> None:
    workload = load_workload(WORKLOAD)
    fleet = uniform_fleet(2)
    ideal = ideal_for(workload, fleet)
    assert set(ideal) == {r.index for r in workload.requests}
    for policy in ("random", "cache_aware"):
        result = Simulator(fleet, PolicySettings(name=policy, seed=1)).run(workload.requests)
        for record in result.records:
            assert record.ttft_s is not None and record.ttft_s >= ideal[record.index] - 1e-9


def test_a_prefix_seen_before_is_all_the_ideal_fleet_skips() -> None:
    workload = load_workload("shared-prefix,groups=1,prompts_per_group=3,system_tokens=4000,question_tokens=50,rate=1")
    profile = uniform_fleet(1).replicas[0].profile
    first, second, third = (ideal_ttfts(workload.requests, profile, MODEL)[r.index] for r in workload.requests)
    # The first computes the whole 4k system prompt; the others only their own question.
    assert second < first / 10 and abs(second - third) < second * 0.5


def test_summaries_and_reports_carry_the_ideal_and_each_runs_multiple_of_it() -> None:
    workload = load_workload(WORKLOAD)
    fleet = uniform_fleet(2)
    ideal = ideal_for(workload, fleet)
    summaries = {}
    for policy in ("random", "cache_aware"):
        result = Simulator(fleet, PolicySettings(name=policy, seed=1)).run(workload.requests)
        for record in result.records:
            record.ideal_ttft_s = ideal[record.index]
        summaries[policy] = summarize(result.records, result.duration_s)
    for summary in summaries.values():
        assert summary["ideal_ttft_s"]["p50"] <= summary["ttft_s"]["p50"]
        assert summary["ttft_over_ideal"]["mean"] >= 1.0 and summary["ttft_over_ideal"]["p99"] >= 1.0
    lines = against_ideal(summaries)
    assert lines[0].startswith("Ideal TTFT") and any(line.startswith("| cache_aware |") for line in lines)
    # A run that does not know its fleet (a live run against any endpoint) has no ideal.
    bare = Simulator(fleet, PolicySettings(name="random")).run(workload.requests)
    assert summarize(bare.records, bare.duration_s)["ideal_ttft_s"] is None


def test_each_models_ideal_is_on_its_own_replicas_profile_and_cache() -> None:
    from loadtest.simulator.fleetspec import parse_fleet

    fleet = parse_fleet({"groups": [{"count": 1, "profile": "llama-3.1-70b-h100-tp4", "model": "big"},
                                    {"count": 1, "model": "small"}]})
    # The same prompts under each model: neither model's cache helps the other.
    spec = "shared-prefix,groups=1,prompts_per_group=4,system_tokens=3000,question_tokens=50,rate=1,seed=5"
    workload = load_workload(f"{spec},model=small;{spec},model=big")
    ideal = ideal_for(workload, fleet)
    first = {model: min((r for r in workload.requests if r.model == model), key=lambda r: r.arrival_s)
             for model in ("small", "big")}
    assert ideal[first["big"].index] > 2 * ideal[first["small"].index] > 0  # a 70B prefills slower
    small = sorted(ideal[r.index] for r in workload.requests if r.model == "small")
    assert small[-1] > 5 * small[0]  # its first prompt paid the system prompt, the others not
