"""Gray-failure benchmark: one replica much slower than its profile claims, the rest healthy.

Starts four simulated replicas (`kvlb replica`, llama-3.1-8b on H100) on 127.0.0.1 and kvlb
in front of them, then sends unique 1,500-token prompts (no cache to find) at a moderate
rate, streamed, through each policy twice on fresh replicas: once with every replica at
`--time-scale`, once with replica-0 at a fifth of it, so it runs `--slowdown` times slower
than the others while answering health checks like them. Printed per policy: TTFT p50 and
p99 of each run (model time), the gray run's p99 over the healthy one's, and the share of
requests the slow replica served. A balancer that learns each replica's speed keeps the
ratio near 1; one that trusts the profile keeps sending the slow replica its share.

Near 1, but not at it: a fleet that loses a replica's worth of speed has less room for
bursts, whoever routes. So each policy also runs on the healthy replicas alone (three, no
slow one to find), the best a router could do by knowing from the start, and the gray run's
p99 is given over that too.

A p99 of a few hundred requests on a shared machine moves from run to run by more than the
effect measured, so `--repeats N` runs the three fleets N times, interleaved, and prints each
round and then the median ratios with their range.

    python -m loadtest.bench.gray_failure [--policies cache_aware,predictive] [--rate 12]
                                          [--requests 600] [--time-scale 2] [--slowdown 5]
                                          [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

from loadtest.client.runner import run_load
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.compare.livefleet import LiveFleet

REPLICAS = 4
SLOW = "replica-0"


def workload_spec(requests: int, rate: float) -> str:
    # One group per request: every prompt is its own system prompt, unique from the start.
    return (f"shared-prefix,groups={requests},prompts_per_group=1,system_tokens=1400,question_tokens=100,"
            f"output_tokens=64,rate={rate}")


async def run(policy: str, scales: list[float], spec: str, time_scale: float) -> dict:
    workload = load_workload(spec)
    async with LiveFleet(len(scales), time_scale=time_scale, time_scales=scales) as fleet:
        await fleet.start_replicas()
        target = await fleet.start_kvlb(policy, seed=0)
        try:
            records, meta = await run_load(target, workload.requests, model=fleet.model,
                                           time_scale=time_scale, timeout_s=120.0, progress=False)
        finally:
            fleet.stop_router()
        return summarize(records, meta.pop("duration_s"), replicas=fleet.replica_names, meta=meta)


async def main_async(args: argparse.Namespace) -> int:
    spec = workload_spec(args.requests, args.rate)
    healthy = [args.time_scale] * REPLICAS
    gray = [args.time_scale / args.slowdown] + healthy[1:]
    print(f"{REPLICAS} replicas at time scale {args.time_scale:g}; gray run: {SLOW} {args.slowdown:g}x slower\n"
          f"workload: {spec}\n")
    print("| policy | healthy TTFT p50 | healthy p99 | gray TTFT p50 | gray p99 | gray p99 / healthy p99 "
          f"| {REPLICAS - 1} healthy alone, p99 | gray p99 / theirs | slow replica's share | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy in args.policies.split(","):
        over_healthy: list[float] = []
        over_theirs: list[float] = []
        for _ in range(args.repeats):
            ok = await run(policy, healthy, spec, args.time_scale)
            bad = await run(policy, gray, spec, args.time_scale)
            fewer = await run(policy, healthy[1:], spec, args.time_scale)
            counts = bad["requests_per_replica"]
            share = counts.get(SLOW, 0) / max(1, sum(counts.values()))
            p99 = bad["ttft_s"]["p99"]
            over_healthy.append(p99 / ok["ttft_s"]["p99"])
            over_theirs.append(p99 / fewer["ttft_s"]["p99"])
            print(f"| {policy} | {ok['ttft_s']['p50'] * 1000:,.0f} ms | {ok['ttft_s']['p99'] * 1000:,.0f} ms "
                  f"| {bad['ttft_s']['p50'] * 1000:,.0f} ms | {p99 * 1000:,.0f} ms "
                  f"| {over_healthy[-1]:.2f}x | {fewer['ttft_s']['p99'] * 1000:,.0f} ms "
                  f"| {over_theirs[-1]:.2f}x | {share:.1%} "
                  f"| {ok['errors'] + bad['errors'] + fewer['errors']} |", flush=True)
        if args.repeats > 1:
            print(f"\n{policy}, {args.repeats} rounds: gray p99 / healthy p99 median "
                  f"{statistics.median(over_healthy):.2f}x ({min(over_healthy):.2f}-{max(over_healthy):.2f}x); "
                  f"gray p99 / {REPLICAS - 1} healthy alone median {statistics.median(over_theirs):.2f}x "
                  f"({min(over_theirs):.2f}-{max(over_theirs):.2f}x)\n", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="cache_aware,predictive")
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second of model time")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--slowdown", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three fleets, interleaved")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
