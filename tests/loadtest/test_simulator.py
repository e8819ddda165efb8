"""The offline fleet simulator: deterministic, faithful to its engines, and routing as kvlb does."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from balancer.config import Limits, PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.simulator.fleetspec import FleetError, load_fleet, parse_fleet, uniform_fleet
from loadtest.simulator.simulator import Simulator, simulate

SHARED = "shared-prefix,groups=6,prompts_per_group=12,system_tokens=1500,question_tokens=60,output_tokens=40,rate=6"


def run(spec: str, policy: str, replicas: int = 4, seed: int = 0, **kwargs):
    workload = load_workload(spec)
    sim = Simulator(uniform_fleet(replicas), PolicySettings(name=policy, seed=seed), **kwargs)
    result = sim.run(workload.requests)
    return result, summarize(result.records, result.duration_s, replicas=result.replicas)


def test_same_seed_same_summary_and_records():
    first, first_summary = run(SHARED, "random", seed=3)
    second, second_summary = run(SHARED, "random", seed=3)
    assert first_summary == second_summary
    assert [r.to_json() for r in first.records] == [r.to_json() for r in second.records]
    _, other = run(SHARED, "random", seed=4)
    assert other["requests_per_replica"] != first_summary["requests_per_replica"]


def test_decode_runs_change_nothing_but_the_work():
    fast, _ = run(SHARED, "cache_aware")
    slow, _ = run(SHARED, "cache_aware", decode_runs=False)
    assert fast.decode_runs > 0 and slow.decode_runs == 0
    assert fast.events < slow.events
    for a, b in zip(fast.records, slow.records, strict=True):
        assert (a.replica, a.cached_tokens, a.output_tokens) == (b.replica, b.cached_tokens, b.output_tokens)
        assert a.ttft_s == pytest.approx(b.ttft_s, abs=1e-9)
        assert a.e2e_s == pytest.approx(b.e2e_s, abs=1e-9)


def test_every_request_is_recorded_with_the_replicas_own_figures():
    result, summary = run(SHARED, "round_robin")
    assert summary["requests"] == 72 and summary["errors"] == 0
    # Round robin over 4 replicas: 18 each.
    assert set(summary["requests_per_replica"].values()) == {18}
    for record in result.records:
        assert record.prompt_tokens == 1500 + 60
        assert record.output_tokens == 40
        assert 0 < record.ttft_s < record.e2e_s
        assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 39)


def test_cache_aware_keeps_groups_together_and_beats_random():
    _, random_summary = run(SHARED, "random")
    result, aware = run(SHARED, "cache_aware")
    assert aware["cache_hit_ratio"] > random_summary["cache_hit_ratio"] + 0.15
    assert aware["ttft_s"]["p50"] < random_summary["ttft_s"]["p50"]
    # A group stays on the replica holding its prefix; six groups on four replicas leave
    # room for a group or two to be split for balance, not more.
    by_group: dict[str, set[str]] = {}
    for record in result.records:
        by_group.setdefault(record.session, set()).add(record.replica)
    assert sum(len(replicas) == 1 for replicas in by_group.values()) >= 4


def test_a_replica_in_another_region_adds_its_round_trip_to_ttft():
    fleet = parse_fleet({
        "region": "us-east",
        "round_trip_ms": {"eu-west": 80},
        "groups": [{"count": 1, "region": "eu-west"}],
    })
    workload = load_workload("shared-prefix,groups=1,prompts_per_group=1,system_tokens=100,question_tokens=10,output_tokens=5")
    far = simulate(fleet, workload.requests, PolicySettings(name="random")).records[0]
    near = simulate(uniform_fleet(1), workload.requests, PolicySettings(name="random")).records[0]
    assert far.ttft_s == pytest.approx(near.ttft_s + 0.080)
    assert far.e2e_s == pytest.approx(near.e2e_s + 0.080)


def test_cache_aware_fills_committed_replicas_before_overflow():
    fleet = parse_fleet({"groups": [
        {"count": 2, "tier": "committed", "region": "a"},
        {"count": 2, "tier": "overflow", "region": "b"},
    ]})
    workload = load_workload("multi-tenant,tenants=4,system_tokens=500,question_tokens=20,output_tokens=10,requests=40,rate=2")
    result = simulate(fleet, workload.requests, PolicySettings(name="cache_aware"))
    assert {r.replica for r in result.records} <= {"a-0", "a-1"}


def test_a_prompt_beyond_the_context_limit_is_an_error_record_not_a_crash():
    workload = load_workload("shared-prefix,groups=1,prompts_per_group=3,system_tokens=3000,question_tokens=10,output_tokens=5")
    result = simulate(uniform_fleet(2, context_limit=2048), workload.requests, PolicySettings(name="least_load"))
    assert [r.status for r in result.records] == [400, 400, 400]
    assert "exceed the limit of 2048 tokens" in result.records[0].error
    # Nothing is left counted against the replicas.
    assert summarize(result.records, 1.0)["errors"] == 3


@pytest.mark.parametrize("bad, message", [
    ({"groups": []}, "non-empty list"),
    ({"groups": [{"count": 0}]}, "count"),
    ({"groups": [{"count": 1, "profile": "gpt-9"}]}, "unknown profile"),
    ({"groups": [{"count": 1, "colour": "red"}]}, "unknown key"),
    ({"round_trip_ms": {"x": -1}, "groups": [{"count": 1}]}, "round_trip_ms"),
])
def test_bad_fleet_descriptions_say_what_is_wrong(bad, message):
    with pytest.raises(FleetError, match=message):
        parse_fleet(bad)


def test_simulate_command_writes_the_summary(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "simulate", "--workload", SHARED, "--replicas", "3",
         "--policy", "cache_aware", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["requests"] == 72 and summary["mode"] == "offline" and summary["policy"] == "cache_aware"
    assert sorted(summary["requests_per_replica"]) == ["replica-0", "replica-1", "replica-2"]
    lines = (out / "requests.jsonl").read_bytes().splitlines()
    assert len(lines) == 72 and orjson.loads(lines[0])["index"] == 0
    assert "cache hit" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--workload", "nope"], "unknown kind"),
    (["--workload", SHARED, "--policy", "nope"], "unknown policy"),
    (["--workload", SHARED, "--fleet", "/nonexistent.yaml"], "cannot read fleet file"),
])
def test_simulate_command_refuses_bad_input_in_one_line(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "simulate", *args, "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_compare_writes_a_report_with_table_and_plots(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "compare", "--workload", SHARED, "--policies",
         "random,cache_aware", "--replicas", "3", "--out", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "report.md").read_text()
    assert "| random |" in report and "| cache_aware |" in report
    assert SHARED in report and "Seed: 0" in report and "3 x llama-3.1-8b-h100" in report
    assert "**cache_aware** against random" in report
    for png in ("ttft_cdf.png", "requests_per_replica.png", "cache_hit.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
        assert f"]({png})" in report
    assert (tmp_path / "cache_aware" / "summary.json").exists()


def test_the_example_fleet_file_describes_two_regions_and_tiers():
    fleet = load_fleet(Path(__file__).resolve().parents[2] / "config" / "fleet-multi-region.yaml")
    assert len(fleet.replicas) == 130
    far = [r for r in fleet.replicas if r.labels["region"] == "eu-west"]
    assert len(far) == 80 and all(r.round_trip_s == 0.080 and r.labels["tier"] == "overflow" for r in far)
    assert fleet.replicas[0].name == "us-east-0" and fleet.replicas[0].round_trip_s == 0.0


def test_the_faster_cards_of_the_example_mixed_fleet_take_the_larger_share():
    fleet = load_fleet(Path(__file__).resolve().parents[2] / "config" / "fleet-mixed-cards.yaml")
    fast = {r.name for r in fleet.replicas if r.profile.name == "llama-3.1-8b-h200"}
    assert len(fleet.replicas) == 8 and len(fast) == 4
    requests = load_workload("multi-tenant,tenants=48,requests=3000,rate=50,route=chat").requests

    def fast_share(policy: str) -> float:
        result = simulate(fleet, requests, PolicySettings(name=policy, seed=0))
        assert all(r.status == 200 for r in result.records)
        return sum(r.replica in fast for r in result.records) / len(result.records)

    # With every weight at 1, the H200s, whose batches drain sooner, get more (0.557 at seed
    # 0); blind to load and cache, an even split (0.503).
    assert fast_share("predictive") > 0.54
    assert 0.47 < fast_share("random") < 0.53


def test_the_balancers_admission_line_runs_offline():
    # A burst of 40 requests of about 3.3 s each, all at once, on a balancer admitting 4 at a
    # time with room for 6 more in line: 30 are refused at once; of those in line, 4 get the
    # first four's slots as they finish, and 2 give up after queue_timeout_s, all in virtual
    # time, as kvlb serve would.
    burst = "shared-prefix,groups=1,prompts_per_group=40,system_tokens=200,question_tokens=20,output_tokens=400,rate=100000"
    limits = Limits(max_in_flight=4, max_queued=6, queue_timeout_s=5.0)
    result, _ = run(burst, "least_load", replicas=2, limits=limits)
    full = [r for r in result.records if r.status == 429 and "queue is full" in (r.error or "")]
    timed_out = [r for r in result.records if r.status == 429 and "queue_timeout_s" in (r.error or "")]
    served = sorted((r for r in result.records if r.status == 200), key=lambda r: r.send_s)
    assert (len(full), len(timed_out), len(served)) == (30, 2, 8)
    # The second four started once the first four ended: never more than four at once.
    first, second = served[:4], served[4:]
    assert min(r.ttft_s for r in second) > max(r.e2e_s for r in first)
    unlimited, _ = run(burst, "least_load", replicas=2)
    assert all(r.status == 200 for r in unlimited.records)


def test_two_models_behind_one_endpoint_each_on_its_own_fleet_and_policy():
    from balancer.config import ModelSettings

    fleet = parse_fleet({"groups": [
        {"count": 2, "profile": "llama-3.1-70b-h100-tp4", "model": "big"},
        {"count": 3, "model": "small"},
    ]})
    workload = load_workload("shared-prefix,model=small,groups=3,prompts_per_group=20,system_tokens=800,rate=8;"
                             "shared-prefix,model=big,groups=2,prompts_per_group=30,system_tokens=800,rate=8")
    per_model = (ModelSettings(model="big", policy=PolicySettings(name="round_robin"), max_in_flight=4),)
    result = simulate(fleet, workload.requests, PolicySettings(name="predictive", seed=0), per_model=per_model)
    summary = summarize(result.records, result.duration_s, replicas=result.replicas)
    by_model = summary["by_model"]
    assert set(by_model) == {"big", "small"} and by_model["small"]["errors"] == 0
    served = {r.model: set() for r in result.records}
    for r in result.records:
        if r.ok:
            served[r.model].add(r.replica)
    assert served == {"big": {"replica-0", "replica-1"}, "small": {"replica-2", "replica-3", "replica-4"}}
    # The big model's bound of 4 at once refuses some of its requests, never the small one's.
    refused = [r for r in result.records if not r.ok]
    assert refused and all(r.model == "big" and r.status == 429 for r in refused)
    # Round robin: the big model's requests alternate between its two replicas.
    big = [r.replica for r in sorted(result.records, key=lambda r: r.send_s) if r.model == "big" and r.ok]
    assert all(a != b for a, b in zip(big, big[1:], strict=False))


def test_one_shared_system_prompt_at_light_load_is_copied_to_every_replica():
    # Priced on each request's own wait, a cold replica's 8k prefill outweighs the batch on
    # the warm ones and the prompt stays on a few; the copy credit counts the requests a copy
    # serves afterwards, and the whole fleet shares the decode.
    workload = load_workload("shared-prefix,groups=1,prompts_per_group=1200,system_tokens=8000,"
                             "question_tokens=200,output_tokens=150,rate=12")

    def served(params: dict) -> list[int]:
        result = simulate(uniform_fleet(8), workload.requests, PolicySettings(name="predictive", params=params, seed=0))
        return sorted(Counter(record.replica for record in result.records).values())

    assert len(served({"copy_horizon_s": 0})) < 8
    spread = served({})  # the shipped default
    assert len(spread) == 8 and spread[0] > 0.5 * 1200 / 8
