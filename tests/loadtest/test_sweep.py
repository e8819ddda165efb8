"""Load sweeps: one comparison per load, and the highest load meeting an SLO (goodput)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.client.summary import RequestRecord
from loadtest.compare.sweep import Point, Slo, capacity, parse_sweep, point, with_option

WORKLOAD = "shared-prefix,groups=2,prompts_per_group=30,system_tokens=3000,question_tokens=100,output_tokens=40,rate=2"


def record(ttft: float | None, tpot: float | None = 0.01, status: int = 200) -> RequestRecord:
    return RequestRecord(index=0, send_s=0.0, status=status, error=None if status == 200 else "x", replica="a",
                         session=None, prompt_tokens=10, cached_tokens=0, output_tokens=5, ttft_s=ttft,
                         e2e_s=1.0, tpot_s=tpot)


def test_a_request_meets_the_slo_only_when_it_succeeded_within_both_targets() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    assert slo.met_by(record(0.5, 0.05))
    assert not slo.met_by(record(0.51))
    assert not slo.met_by(record(0.1, 0.06))
    assert not slo.met_by(record(0.1, status=503))
    assert Slo(ttft_s=0.5).met_by(record(0.1, tpot=9.0))  # no TPOT target given


def test_goodput_counts_requests_that_met_it_over_the_runs_duration() -> None:
    summary = {"duration_s": 2.0, "cache_hit_ratio": 0.5, "ttft_s": {"p50": 0.1, "p99": 0.9}, "e2e_s": {"p50": 1.0}}
    p = point("4", summary, [record(0.1), record(0.2), record(0.9), record(None, status=500)], Slo(ttft_s=0.5))
    assert p.attained == 0.5 and p.goodput_per_s == 1.0


def test_capacity_is_the_highest_load_before_the_first_miss() -> None:
    slo = Slo(ttft_s=1.0, attainment=0.9)

    def at(level: str, attained: float) -> Point:
        return Point(level, 0.0, None, None, None, attained, 0.0)

    assert capacity([at("1", 1.0), at("2", 0.95), at("4", 0.5), at("8", 0.99)], slo) == "2"
    assert capacity([at("1", 0.5)], slo) is None


def test_sweep_values_replace_the_key_in_the_spec() -> None:
    assert parse_sweep("speedup=1, 2,4") == ("speedup", ["1", "2", "4"])
    assert with_option("multi-turn,rate=2,turns=3", "rate", "8") == "multi-turn,turns=3,rate=8"
    assert with_option("mooncake:trace.jsonl,limit=5", "speedup", "2") == "mooncake:trace.jsonl,limit=5,speedup=2"
    with pytest.raises(ValueError):
        parse_sweep("speedup")


def test_kvlb_compare_sweeps_loads_and_reports_each_policys_capacity(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "balancer", "compare", "--workload", WORKLOAD, "--sweep", "rate=2,50",
         "--policies", "random,cache_aware", "--replicas", "2", "--slo-ttft-ms", "300", "--slo-attainment", "0.9",
         "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "rate-2" / "report.md").exists() and (out / "rate-50" / "report.md").exists()
    report = (out / "sweep.md").read_text()
    assert "TTFT <= 300 ms for at least 90% of requests" in report
    rows = [line for line in report.splitlines() if line.startswith("| random |") or line.startswith("| cache_aware |")]
    # One capacity row and one row per load, for each policy.
    assert len(rows) == 2 * (1 + 2)
    # At 2 requests/s the fleet is idle enough for every policy to meet the SLO.
    assert "| random | 2 |" in report and "| cache_aware | 2 |" in report
    assert all(row.split("|")[2].strip() in ("2", "50") for row in rows[:2])
