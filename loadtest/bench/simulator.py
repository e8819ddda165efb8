"""Simulator speed: how much CPU one core spends per simulated request and per simulated hour.

    python -m loadtest.bench.simulator                 # both cases below
    python -m loadtest.bench.simulator --case trace    # the shared trace on 8 replicas
    python -m loadtest.bench.simulator --case fleet --minutes 5

Cases:
- trace: the whole shared Mooncake trace (3,993 requests, 15k-token prompts on average), 8
  replicas of llama-3.1-8b-h100, arrivals sped up 4x, cache_aware. Target: at most 60 s.
- fleet: 200 replicas serving 100 requests/s for one simulated hour (360,000 requests;
  multi-tenant prompts of about 2,100 tokens, 128 output tokens), cache_aware. Target: at
  most 10 minutes.
CPU time of this process is what is reported (one core; the simulator is single-threaded).
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from balancer.config import PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.simulator import simulate

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


def run(label: str, spec: str, replicas: int, policy: str, context_limit: int = 131072) -> None:
    workload = load_workload(spec)
    fleet = uniform_fleet(replicas, context_limit=context_limit)
    started_cpu, started_wall = time.process_time(), time.monotonic()
    result = simulate(fleet, workload.requests, PolicySettings(name=policy, seed=0))
    cpu = time.process_time() - started_cpu
    wall = time.monotonic() - started_wall
    summary = summarize(result.records, result.duration_s, replicas=result.replicas)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{label}: {len(workload.requests):,} requests, {result.duration_s:,.0f} s simulated on {replicas} replicas ({policy})")
    print(f"  CPU {cpu:,.1f} s (wall {wall:,.1f} s), {cpu / len(workload.requests) * 1e6:,.0f} µs per request, "
          f"{result.duration_s / cpu:,.0f} simulated s per CPU s, peak RSS {rss_mb:,.0f} MB")
    print(f"  {result.events:,} events, {result.iterations:,} engine iterations, {result.decode_runs:,} of "
          f"the steps plain decode runs; errors {summary['errors']}, "
          f"cache hit {summary['cache_hit_ratio']:.3f}, TTFT p50 {summary['ttft_s']['p50'] * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["trace", "fleet", "all"], default="all")
    parser.add_argument("--minutes", type=float, default=60.0, help="simulated minutes for the fleet case")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--trace", type=Path, default=TRACE, help="the shared Mooncake trace (default: %(default)s)")
    args = parser.parse_args()
    if args.case in ("trace", "all"):
        if args.trace.exists():
            # The trace's ten longest prompts exceed llama-3.1's 131,072-token context.
            run("shared trace, speed-up 4", f"mooncake:{args.trace},speedup=4", 8, args.policy, context_limit=262144)
        else:
            print(f"shared trace not found at {args.trace}; skipping the trace case (give --trace)")
    if args.case in ("fleet", "all"):
        requests = int(100 * 60 * args.minutes)
        spec = (f"multi-tenant,tenants=200,system_tokens=2000,question_tokens=128,output_tokens=128,"
                f"requests={requests},rate=100")
        run(f"200 replicas, 100 req/s, {args.minutes:g} simulated minutes", spec, 200, args.policy)


if __name__ == "__main__":
    main()
