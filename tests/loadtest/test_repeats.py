"""Repeated live runs: medians per figure, every run's figures beside them."""

from __future__ import annotations

import subprocess
import sys

import orjson

from loadtest.compare.repeats import median_summary, run_order, spread_lines


def test_routers_take_turns_first_so_a_drift_weighs_on_each_alike():
    assert run_order(["kvlb", "other"], 3) == [
        (0, "kvlb"), (0, "other"), (1, "other"), (1, "kvlb"), (2, "kvlb"), (2, "other")]


def _summary(hit, p50, p99, requests=100):
    return {"requests": requests, "cache_hit_ratio": hit, "policy": "kvlb",
            "ttft_s": {"p50": p50, "p99": p99}, "e2e_s": {"p50": 1.0, "p99": None}}


def test_each_figure_is_the_median_of_the_runs_and_the_runs_are_kept():
    merged = median_summary([_summary(0.5, 0.010, 0.300), _summary(0.7, 0.030, 0.100),
                             _summary(0.6, 0.020, 0.900)])
    assert merged["cache_hit_ratio"] == 0.6
    assert merged["ttft_s"] == {"p50": 0.020, "p99": 0.300}
    assert merged["requests"] == 100 and isinstance(merged["requests"], int)
    assert merged["policy"] == "kvlb"
    # A figure missing from a run is not a number to take the median of.
    assert merged["e2e_s"]["p99"] is None
    assert [run["TTFT p99"] for run in merged["runs"]] == [0.300, 0.100, 0.900]
    lines = spread_lines({"kvlb": merged})
    assert "| kvlb | 0.500 / 0.700 / 0.600 | 10 / 30 / 20 | 300 / 100 / 900 | 1,000 / 1,000 / 1,000 | – / – / – |" in lines


def test_a_single_run_has_no_spread_to_show():
    assert spread_lines({"kvlb": _summary(0.5, 0.01, 0.3)}) == []


WORKLOAD = "shared-prefix,groups=2,prompts_per_group=4,system_tokens=200,question_tokens=20,output_tokens=8,rate=20"


def test_a_repeated_live_comparison_reports_medians_and_keeps_every_run(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "compare", "--live", "--repeat", "2", "--workload", WORKLOAD,
         "--policies", "cache_aware,random", "--replicas", "2", "--time-scale", "10", "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "medians over 2 runs per router" in report
    for name in ("cache_aware", "random"):
        runs = [orjson.loads((out / name / f"run-{i}" / "summary.json").read_bytes()) for i in (1, 2)]
        assert all(run["requests"] == 8 and run["errors"] == 0 for run in runs)
        merged = orjson.loads((out / name / "summary.json").read_bytes())
        hits = sorted(run["cache_hit_ratio"] for run in runs)
        assert merged["cache_hit_ratio"] == (hits[0] + hits[1]) / 2
        assert len(merged["runs"]) == 2
        assert (out / name / "requests.jsonl").read_text().count("\n") == 8


def test_repeating_an_offline_comparison_is_refused_with_the_reason(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "compare", "--repeat", "3", "--workload", WORKLOAD,
         "--policies", "random", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "--repeat is for live runs" in proc.stderr
