"""Live against offline: the same workload through real processes and through the simulator.

The simulator is only worth its speed if it tells the truth about the live system. This runs
one workload both ways (kvlb in front of simulated replica processes at a time scale, and
`kvlb simulate` on the same fleet) and compares the cache-hit ratio and TTFT p50.

    python -m loadtest.compare.agreement                       # benchmark: the cases below
    python -m loadtest.compare.agreement --time-scale 10       # see what a faster clock costs

Time scale: a live run pays a few milliseconds of real time per request in processes the
model does not have (the client, kvlb, and the replica parsing and hashing a long prompt on a
shared 2-core machine), and each of those milliseconds counts `time_scale` times in model
time. At time scale 2 that overhead stays a few percent of TTFT; at 10 it adds about 40 ms
of model time per request of the shared trace.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

from balancer.config import PolicySettings, RoutingSettings
from loadtest.client.workloads import load_workload
from loadtest.compare.compare import compare_live
from loadtest.simulator.cli import run_offline
from loadtest.simulator.fleetspec import uniform_fleet

# The first 300 requests of the shared trace, shipped with the tests.
TRACE = Path(__file__).resolve().parents[2] / "tests" / "data" / "mooncake_head300.jsonl"
HIT_TOLERANCE = 0.03
TTFT_TOLERANCE = 0.25
PROFILE = "llama-3.1-8b-h100"
# Offline seeds a random policy's live run is compared against.
RANDOM_SEEDS = 12


@dataclass(frozen=True)
class Agreement:
    spec: str
    policy: str
    live_hit: float
    offline_hit: float
    live_ttft_p50: float
    offline_ttft_p50: float
    live_errors: int
    offline_errors: int
    # Median over requests of live TTFT / offline TTFT, request by request.
    ttft_ratio_median: float
    # The offline hit ratios over every seed run (seed 0 first): a policy that draws at random
    # gets a spread of outcomes, and a live run is one more draw from it.
    offline_hits: tuple[float, ...] = ()

    @property
    def hit_gap(self) -> float:
        """How far live is from the offline runs: 0 inside their range, else to its nearest end."""
        lo, hi = (min(self.offline_hits), max(self.offline_hits)) if self.offline_hits else (self.offline_hit,) * 2
        return self.live_hit - hi if self.live_hit > hi else min(self.live_hit - lo, 0.0)

    @property
    def ttft_gap(self) -> float:
        """Live TTFT p50 relative to offline, as a signed fraction."""
        return self.live_ttft_p50 / self.offline_ttft_p50 - 1.0

    @property
    def within(self) -> bool:
        return abs(self.hit_gap) <= HIT_TOLERANCE and abs(self.ttft_gap) <= TTFT_TOLERANCE


async def measure(
    spec: str, policy: str = "cache_aware", replicas: int = 4, time_scale: float = 2.0, offline_seeds: int = 1
) -> Agreement:
    """`offline_seeds` > 1 for a policy whose choices are random draws: the live run draws in
    its own arrival order (a reordered pair shifts every later draw), so it is compared with
    the range of offline outcomes over that many seeds, not with seed 0's."""
    workload = load_workload(spec)
    fleet = uniform_fleet(replicas, PROFILE)
    offline, offline_records = run_offline(workload, fleet, PolicySettings(name=policy, seed=0), RoutingSettings())
    offline_hits = [offline["cache_hit_ratio"]]
    for seed in range(1, offline_seeds):
        other, _ = run_offline(workload, fleet, PolicySettings(name=policy, seed=seed), RoutingSettings())
        offline_hits.append(other["cache_hit_ratio"])
    with tempfile.TemporaryDirectory(prefix="kvlb-agreement-") as tmp:
        results = await compare_live(
            workload, [policy], Path(tmp), replicas=replicas, profile=PROFILE, time_scale=time_scale,
            progress=False,
        )
    live, live_records = results[policy]
    offline_ttft = {r.index: r.ttft_s for r in offline_records if r.ok and r.ttft_s}
    ratios = sorted(r.ttft_s / offline_ttft[r.index] for r in live_records if r.ok and r.ttft_s and r.index in offline_ttft)
    return Agreement(
        spec, policy, live["cache_hit_ratio"], offline["cache_hit_ratio"], live["ttft_s"]["p50"],
        offline["ttft_s"]["p50"], live["errors"], offline["errors"],
        ratios[len(ratios) // 2] if ratios else float("nan"), tuple(offline_hits),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    cases = [
        (f"mooncake:{TRACE}", "cache_aware"),
        (f"mooncake:{TRACE}", "random"),
        ("multi-turn,sessions=40,turns=5,system_tokens=6000,user_tokens=200,output_tokens=64,think_s=4,rate=3", "cache_aware"),
        ("multi-turn,sessions=40,turns=5,system_tokens=6000,user_tokens=200,output_tokens=64,think_s=4,rate=3", "random"),
    ]
    print(f"{args.replicas} x {PROFILE}; live at time scale {args.time_scale:g}; "
          f"bounds: cache hit ±{HIT_TOLERANCE}, TTFT p50 ±{TTFT_TOLERANCE:.0%}\n")
    print(f"{'workload':<34} {'policy':<12} {'hit live':>8} {'offline':>8} {'TTFT p50 live':>14} {'offline':>8} {'gap':>6} "
          f"{'per request':>11}  ok")
    for spec, policy in cases:
        if spec.startswith("mooncake:") and not TRACE.exists():
            print(f"{spec[:34]:<34} skipped: no shared trace")
            continue
        a = asyncio.run(measure(spec, policy, args.replicas, args.time_scale, RANDOM_SEEDS if policy == "random" else 1))
        name = "shared trace, first 300" if spec.startswith("mooncake:") else spec.split(",")[0]
        print(f"{name:<34} {policy:<12} {a.live_hit:>8.3f} {a.offline_hit:>8.3f} "
              f"{a.live_ttft_p50 * 1000:>11.0f} ms {a.offline_ttft_p50 * 1000:>5.0f} ms {a.ttft_gap:>+6.0%} "
              f"{a.ttft_ratio_median - 1:>+11.0%}  {'yes' if a.within else 'NO'}")


if __name__ == "__main__":
    main()
