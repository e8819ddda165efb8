"""`kvlb compare --live`: real replica processes, kvlb or another router in front, one report."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import aiohttp
import orjson

from loadtest.compare.livefleet import LiveFleet

WORKLOAD = "shared-prefix,groups=2,prompts_per_group=4,system_tokens=200,question_tokens=20,output_tokens=8,rate=20"

# Another router, as a user would bring one: a command template filled with the port to
# listen on and the replicas' URLs. Here it is kvlb started by a script of its own, with the
# header that names the serving replica turned off, as a foreign router would not send it.
ROUTER = textwrap.dedent("""
    import sys, yaml
    from balancer.process.cli import main
    port, workers = int(sys.argv[1]), sys.argv[2:]
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": url} for url in workers],
        "policy": {"name": "round_robin"},
        "headers": {"expose_replica": False},
    }
    path = sys.argv[0] + ".yaml"
    open(path, "w").write(yaml.safe_dump(config))
    sys.exit(main(["serve", "--config", path]))
""")


def test_live_comparison_with_kvlb_and_an_external_router(tmp_path):
    script = tmp_path / "router.py"
    script.write_text(ROUTER)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "compare", "--live", "--workload", WORKLOAD,
         "--policies", "cache_aware", "--replicas", "2", "--time-scale", "10", "--out", str(out),
         "--external", f"other={sys.executable} {script} {{port}} {{workers}}", "--no-progress"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "| cache_aware | 8 | 0 |" in report and "| other | 8 | 0 |" in report
    assert "Mode: live" in report
    ours = orjson.loads((out / "cache_aware" / "summary.json").read_bytes())
    assert ours["mode"] == "live" and ours["time_scale"] == 10
    assert sum(ours["requests_per_replica"].values()) == 8
    # The second prompt of each group found the group's system prompt in cache.
    assert ours["cache_hit_ratio"] > 0.5
    theirs = orjson.loads((out / "other" / "summary.json").read_bytes())
    # The external router named no replica; the replicas' own counters did.
    assert theirs["requests_per_replica_source"] == "replica metrics"
    assert theirs["requests_per_replica"] == {"replica-0": 4, "replica-1": 4}
    assert theirs["replica_max_min_ratio"] == 1.0
    # What each router's own processes spent during its run sits beside its latencies.
    assert ours["router_cpu_s"] >= 0.0 and theirs["router_cpu_s"] >= 0.0
    assert "| router | CPU during the run (user + system) | per request |" in report
    assert f"| other | {theirs['router_cpu_s']:.2f} s |" in report


async def test_replicas_count_the_requests_they_finished():
    async with LiveFleet(1, time_scale=10) as fleet:
        await fleet.start_replicas()
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                body = {"model": fleet.model, "prompt": "one two three", "max_tokens": 2}
                async with http.post(fleet.replica_urls[0] + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
        assert await fleet.replica_request_counts() == {"replica-0": 3}


def test_live_comparison_of_adapters_loads_them_on_replicas_that_serve_them(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "compare", "--live", "--workload",
         "lora,adapters=6,system_tokens=300,question_tokens=20,output_tokens=4,requests=30,rate=20",
         "--policies", "predictive", "--replicas", "2", "--max-loras", "2", "--lora-load-ms", "50",
         "--time-scale", "10", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = orjson.loads((out / "predictive" / "summary.json").read_bytes())
    # Every adapter's request served (the replicas know them all), its own system prompt
    # found in cache from its second request on.
    assert summary["requests"] == 30 and summary["errors"] == 0
    assert summary["cache_hit_ratio"] > 0.3
