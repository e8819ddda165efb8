"""LoRA adapters on a shared fleet: adapter-aware routing against adapter-blind, offline.

    python -m loadtest.compare.adapter_report --out docs/compare/adapters [--seeds 0,1,2]

8 simulated replicas, each holding 4 adapters in its GPU slots at once and taking 500 ms
(model time) to load another; 64 adapters by Zipf popularity, each with a 2,000-token system
prompt of its own; two popularity skews at two loads. The same requests go to `cache_aware` and
`predictive` blind to adapters (`adapter_weight: 0`: they know where each adapter's prompt is
cached, not which adapters are in which slots) and as shipped, pricing a missing adapter's
load and the eviction it causes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from balancer.config import PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.simulator import simulate

REPLICAS, SLOTS, LOAD_MS = 8, 4, 500.0
WORKLOAD = "lora,adapters=64,system_tokens=2000,question_tokens=64,output_tokens=64"
# (Zipf exponent of the adapters' popularity, requests a second)
SHAPES = ((1.0, 10.0), (1.0, 20.0), (1.0, 40.0), (1.2, 10.0), (1.2, 20.0), (1.2, 40.0))
REQUESTS = 4000
POLICIES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("cache_aware, adapter_weight 0 (blind)", "cache_aware", {"adapter_weight": 0}),
    ("predictive, adapter_weight 0 (blind)", "predictive", {"adapter_weight": 0}),
    ("cache_aware (adapter-aware)", "cache_aware", {}),
    ("predictive (adapter-aware)", "predictive", {}),
)


def run(zipf: float, rate: float, seed: int, policy: str, params: dict[str, Any]) -> dict[str, Any]:
    fleet = uniform_fleet(REPLICAS, max_loras=SLOTS, lora_load_ms=LOAD_MS)
    workload = load_workload(f"{WORKLOAD},zipf={zipf:g},requests={REQUESTS},rate={rate:g},seed={seed}")
    result = simulate(fleet, workload.requests, PolicySettings(policy, params, seed))
    summary = summarize(result.records, result.duration_s, replicas=result.replicas)
    summary["adapter_loads"] = result.adapter_loads
    counts = sorted(Counter(r.adapter for r in workload.requests).values(), reverse=True)
    # What a placement that knew the popularity beforehand would load, keeping the most
    # popular adapters that fit in all slots for good: a first load of each, then one for
    # every request of any other adapter. No engine can do that: each of those loads needs a
    # slot, and evicts one of the kept adapters, which its next request loads again.
    slots = REPLICAS * SLOTS
    summary["fewest_loads"] = sum(counts[slots:]) + min(len(counts), slots)
    # One that can: the most popular kept in all slots but one per replica, the rest loaded
    # into that one (counted as a load each, though two requests in a row for the same
    # adapter would share one).
    kept = slots - REPLICAS
    summary["kept_loads"] = sum(counts[kept:]) + min(len(counts), kept)
    # The fewest any policy that loads on demand can expect when each request's adapter is
    # drawn independently by a fixed popularity, as here: keep the most popular in all slots
    # but one in the whole fleet, the rest through that one (Aho, Denning and Ullman's A0,
    # optimal for such draws even knowing the popularity; more copies only add loads).
    summary["online_loads"] = sum(counts[slots - 1:]) + min(len(counts), slots - 1)
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f} ms"


def report(seeds: Sequence[int]) -> tuple[str, list[str]]:
    lines = [
        "# LoRA adapters: adapter-aware routing against adapter-blind",
        "",
        f"{REPLICAS} simulated replicas (llama-3.1-8b-h100 profile), each with {SLOTS} adapter slots and "
        f"{LOAD_MS:g} ms (model time) to load an adapter into one; workload `{WORKLOAD}`, {REQUESTS} "
        f"requests per run, Poisson arrivals, seeds {', '.join(map(str, seeds))} (medians over seeds; "
        "each seed is one workload and the policy's tie-breaks). "
        "`python -m loadtest.compare.adapter_report --out DIR` writes this report.",
        "",
        "Beside each shape, the loads of two fixed placements that knew the popularity beforehand. "
        "*All slots kept*: the most popular adapters that fill all slots loaded for good, a first "
        "load of each, then one for every request of any other adapter; no engine can do it, since "
        "each of those loads evicts a kept adapter that its next request must load again. *One "
        "slot free per replica*: the most popular kept in the other slots, every other adapter "
        "loaded into the free one, a load per request (two requests in a row for one adapter "
        "would share a load, which this does not count). *One slot free in the fleet*: the same "
        "with a single free slot for the whole fleet; with each request's adapter drawn independently "
        "by a fixed popularity, as here, no policy that loads adapters on demand can expect fewer "
        "loads, even knowing the popularity beforehand (one free slot must then take every request "
        "of the other adapters, which one replica could not serve in time).",
        "",
        "| zipf, load | policy | adapter loads | TTFT p50 | TTFT p99 | E2E p50 | cache hit | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for zipf, rate in SHAPES:
        rows: dict[str, dict[str, float]] = {}
        fewest = kept = online = 0.0
        for label, policy, params in POLICIES:
            runs = [run(zipf, rate, seed, policy, params) for seed in seeds]
            fewest = statistics.median(r["fewest_loads"] for r in runs)
            kept = statistics.median(r["kept_loads"] for r in runs)
            online = statistics.median(r["online_loads"] for r in runs)
            row = {
                "loads": statistics.median(r["adapter_loads"] for r in runs),
                "ttft_p50": statistics.median(r["ttft_s"]["p50"] for r in runs),
                "ttft_p99": statistics.median(r["ttft_s"]["p99"] for r in runs),
                "e2e_p50": statistics.median(r["e2e_s"]["p50"] for r in runs),
                "hit": statistics.median(r["cache_hit_ratio"] for r in runs),
                "errors": sum(r["errors"] for r in runs),
            }
            rows[label] = row
            lines.append(f"| {zipf:g}, {rate:g} req/s | {label} | {row['loads']:,.0f} | {_ms(row['ttft_p50'])} | "
                         f"{_ms(row['ttft_p99'])} | {_ms(row['e2e_p50'])} | {row['hit']:.3f} | {row['errors']} |")
            print(f"  zipf {zipf:g}, {rate:g} req/s, {label}: {row['loads']:.0f} loads, TTFT p99 {_ms(row['ttft_p99'])}, "
                  f"hit {row['hit']:.3f}", file=sys.stderr)
        blind, aware = rows[POLICIES[0][0]], rows[POLICIES[3][0]]
        fewer = blind["loads"] / aware["loads"] if aware["loads"] else float("inf")
        lower = blind["ttft_p99"] / aware["ttft_p99"] if aware["ttft_p99"] else float("inf")
        lines.append(f"| {zipf:g}, {rate:g} req/s | fixed placement, all slots kept | {fewest:,.0f} | | | | | |")
        lines.append(f"| {zipf:g}, {rate:g} req/s | fixed placement, one slot free per replica | {kept:,.0f} | | | | | |")
        lines.append(f"| {zipf:g}, {rate:g} req/s | fixed placement, one slot free in the fleet | {online:,.0f} | | | | | |")
        verdicts.append(
            f"- zipf {zipf:g}, {rate:g} req/s: adapter-aware against adapter-blind `cache_aware`: {fewer:.1f}x fewer adapter "
            f"loads (goal: at least 3x), TTFT p99 {lower:.1f}x lower (goal: at least 2x), cache hit "
            f"{aware['hit']:.3f} against {blind['hit']:.3f} (goal: no lower); {aware['loads'] / kept:.2f}x the "
            f"loads of the fixed placement with one slot free per replica, adapter-blind {blind['loads'] / kept:.2f}x "
            f"({aware['loads'] / fewest:.2f}x and {blind['loads'] / fewest:.2f}x those of all slots kept); "
            f"no policy loading on demand expects fewer than {online:,.0f} loads, "
            f"{blind['loads'] / online:.1f}x fewer than adapter-blind."
        )
    return "\n".join([*lines, "", *verdicts, ""]), verdicts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for report.md")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated workload and policy seeds")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    text, verdicts = report(seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
