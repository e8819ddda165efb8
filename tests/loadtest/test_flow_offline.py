"""Flow control in the offline simulator: the routing core's controller on virtual time, with
workloads that name tenants and classes, beside first come, first served on the same fleet."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from loadtest.client.summary import percentile
from loadtest.client.workloads import load_workload
from loadtest.compare.flow_report import CLASSES, flow_config, offline

NOISY = ("noisy-neighbour,steady_tenants=2,steady_rate=3,noisy_rate=60,duration_s=40,"
         "burst_start_s=5,burst_s=30")
MIX = "interactive-batch,requests=900,rate=25"


def p99(records, keep) -> float:
    return percentile(sorted(r.ttft_s for r in records if keep(r) and r.ok), 99)


def test_a_flooding_tenant_is_throttled_and_the_steady_ones_are_not():
    workload = load_workload(NOISY)
    fcfs = offline(workload, flow_config(None))
    flow = offline(workload, flow_config(CLASSES))
    steady = lambda r: r.tenant.startswith("steady")  # noqa: E731
    assert all(r.ok for r in flow if steady(r))
    assert p99(flow, steady) < 1.5 < 5.0 < p99(fcfs, steady)
    refused = [r for r in flow if not r.ok]
    assert refused and all(r.tenant == "noisy" and r.status == 429 and r.reject_reason for r in refused)


def test_critical_keeps_its_target_under_overload_while_batch_absorbs_the_shedding():
    workload = load_workload(MIX)
    fcfs = offline(workload, flow_config(None))
    flow = offline(workload, flow_config(CLASSES))
    critical = [r for r in flow if r.priority == "critical"]
    assert sum(r.ok and r.ttft_s <= 2.0 for r in critical) >= 0.99 * len(critical)
    assert sum(r.ok and r.ttft_s <= 2.0 for r in fcfs if r.priority == "critical") < 0.5 * len(critical)
    assert {r.priority for r in flow if not r.ok} == {"batch"}


def test_kvlb_simulate_runs_the_flow_control_of_a_policy_config(tmp_path):
    config = tmp_path / "kvlb.yaml"
    config.write_text(yaml.safe_dump(flow_config(CLASSES)))
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "balancer", "simulate", "--workload", MIX, "--policy", "least_load",
         "--policy-config", str(config), "--replicas", "4", "--max-concurrency", "4", "--out", str(out),
         "--no-progress"],
        check=True, capture_output=True, timeout=120,
    )
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["flow_control"] is True
    assert {r["priority"] for r in records} == {"critical", "standard", "batch"}
    assert {r["reject_reason"] for r in records if r["status"] == 429} <= {"predicted_wait_too_long", "queue_timeout"}
    assert any(r["queued_s"] for r in records if r["status"] == 200)
