"""`kvlb tune`: search a policy's parameters on a workload and fleet with the offline
simulator, against an objective the user names, and write the best configuration.

    kvlb tune --workload SPEC [--replicas 8 | --fleet FILE] --policy predictive \
        --param queue_weight=0.25,0.5,1 --param decode_tokens_per_seq=16,32,64 \
        --objective ttft_p99 --out out/tune

Every combination of the `--param` values (a grid, on top of `--policy-config`'s parameters
where given) runs as one offline simulation, in parallel over `--jobs` processes. Each run is
deterministic, so the search is too. Writes `DIR/tune.md` (every run ranked by the objective;
runs no other run beats on both TTFT p99 and end-to-end p50 are marked as the frontier) and
`DIR/best.yaml` (the winning `policy` section, ready for a kvlb configuration).

Objectives, lowest wins: `ttft_mean`, `ttft_p50`, `ttft_p99`, `e2e_p50`, `e2e_p99`; highest
wins: `goodput` (requests per second meeting `--slo-ttft-ms` and `--slo-tpot-ms`, as in
`kvlb compare --sweep`) and `cache_hit`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from balancer.config import PolicySettings
from loadtest.compare.sweep import Slo, goodput
from loadtest.simulator.cli import (
    SetupError,
    add_fleet_arguments,
    fleet_from_args,
    policy_settings,
    run_offline,
    workload_from_args,
)

HELP = "search a policy's parameters offline against an objective; write the best configuration"
# What --objective may name; Trial.value reads each from a run.
OBJECTIVES = ("ttft_mean", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "goodput", "cache_hit")


@dataclass(frozen=True, slots=True)
class Trial:
    params: dict[str, Any]  # the searched parameters only
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    cache_hit: float
    goodput_per_s: float
    errors: int

    def value(self, objective: str) -> float:
        """The objective as a number where lower is better."""
        if objective == "goodput":
            return -self.goodput_per_s
        if objective == "cache_hit":
            return -self.cache_hit
        figure = getattr(self, f"{objective}_s")
        return float("inf") if figure is None else figure


def parse_param(text: str) -> tuple[str, list[Any]]:
    """`NAME=V1,V2,...`, each value read as YAML (numbers stay numbers)."""
    name, equals, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not equals or not name.strip() or not items:
        raise ValueError(f"--param {text!r}: expected NAME=V1,V2,... (for example queue_weight=0.25,0.5,1)")
    return name.strip(), [yaml.safe_load(v) for v in items]


def grid(params: Sequence[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    names = [name for name, _ in params]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values for _, values in params))]


def _trial(job: tuple[str, Any, PolicySettings, Any, dict[str, Any], Slo]) -> Trial:
    """One simulation, in a worker process: the workload is rebuilt from its spec there."""
    spec, fleet, policy, routing, searched, slo = job
    workload = workload_from_args(spec)
    summary, records = run_offline(workload, fleet, policy, routing, ideal={})
    _, per_s = goodput(records, summary["duration_s"], slo)
    return Trial(
        params=searched,
        ttft_mean_s=summary["ttft_s"]["mean"], ttft_p50_s=summary["ttft_s"]["p50"],
        ttft_p99_s=summary["ttft_s"]["p99"], e2e_p50_s=summary["e2e_s"]["p50"], e2e_p99_s=summary["e2e_s"]["p99"],
        cache_hit=summary["cache_hit_ratio"], goodput_per_s=per_s,
        errors=summary["errors"],
    )


def frontier(trials: Sequence[Trial]) -> set[int]:
    """Indexes of the runs no other run beats on both TTFT p99 and end-to-end p50."""
    def key(t: Trial) -> tuple[float, float]:
        return (t.value("ttft_p99"), t.value("e2e_p50"))

    keys = [key(t) for t in trials]
    return {
        i for i, (a, b) in enumerate(keys)
        if not any(x <= a and y <= b and (x, y) != (a, b) for x, y in keys)
    }


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.0f}"


def write_report(out_dir: Path, trials: Sequence[Trial], *, objective: str, policy: str,
                 base: Mapping[str, Any], workload: str, fleet: str, slo: Slo, command: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(trials)), key=lambda i: trials[i].value(objective))
    best = trials[order[0]]
    on_frontier = frontier(trials)
    names = list(best.params)
    lines = [
        "# Parameter search",
        "",
        f"- Policy: {policy}" + (f", on top of {dict(base)}" if base else ""),
        f"- Workload: `{workload}`",
        f"- Fleet: {fleet}",
        f"- Objective: {objective}" + (f" ({slo.describe()})" if objective == "goodput" else ""),
        f"- Reproduce: `{command}`",
        "",
        f"{len(trials)} runs, best first. Times in ms of model time; * marks the frontier (no other run "
        "has both a lower TTFT p99 and a lower end-to-end p50).",
        "",
        "| " + " | ".join(["rank", *names, "cache hit", "TTFT mean", "TTFT p50", "TTFT p99", "E2E p50",
                          "E2E p99", "goodput req/s", "errors", "frontier"]) + " |",
        "|" + "---:|" * (len(names) + 10),
    ]
    for rank, i in enumerate(order, 1):
        t = trials[i]
        cells = [str(rank), *(f"{t.params[n]:g}" if isinstance(t.params[n], int | float) else str(t.params[n])
                              for n in names),
                 f"{t.cache_hit:.3f}", _ms(t.ttft_mean_s), _ms(t.ttft_p50_s), _ms(t.ttft_p99_s), _ms(t.e2e_p50_s),
                 _ms(t.e2e_p99_s), f"{t.goodput_per_s:,.2f}", str(t.errors), "*" if i in on_frontier else ""]
        lines.append("| " + " | ".join(cells) + " |")
    report = out_dir / "tune.md"
    report.write_text("\n".join(lines) + "\n")
    best_yaml = out_dir / "best.yaml"
    best_yaml.write_text(
        f"# kvlb tune, objective {objective}: the best of {len(trials)} runs on {workload}\n"
        + yaml.safe_dump({"policy": {"name": policy, "params": {**base, **best.params}}}, sort_keys=False)
    )
    return report, best_yaml


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("tune", help=HELP, description=HELP)
    parser.add_argument("--workload", required=True, help="workload spec (see loadtest/client/workloads.py)")
    parser.add_argument("--policy", default="predictive", help="the policy to tune (default %(default)s)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=V1,V2,...", required=True,
                        help="a parameter and the values to try; repeat for a grid over several")
    parser.add_argument("--policy-config", help="kvlb config whose policy params and routing section are the base")
    parser.add_argument("--objective", choices=OBJECTIVES, default="ttft_p99", help="what to optimize (default %(default)s)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: time to first token (default 2000)")
    parser.add_argument("--slo-tpot-ms", type=float, help="goodput: time per output token (default: none)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel simulations (default: the cores)")
    parser.add_argument("--seed", type=int, default=0, help="the policy's random seed")
    parser.add_argument("--out", required=True, help="directory for tune.md and best.yaml")
    add_fleet_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    command = "kvlb tune " + shlex.join(sys.argv[2:]) if len(sys.argv) > 2 else "kvlb tune"
    try:
        if args.jobs < 1:
            raise SetupError("--jobs must be at least 1")
        searched = [parse_param(text) for text in args.param]
        workload_from_args(args.workload)  # a bad spec fails here, before any work
        fleet = fleet_from_args(args)
        base_policy, routing = policy_settings(args.policy, args.policy_config, args.seed)
        from policies.registry import make_policy

        slo = Slo(args.slo_ttft_ms / 1000, None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000)
        jobs = []
        for point in grid(searched):
            params = {**base_policy.params, **point}
            make_policy(args.policy, params)  # an unknown name or a bad value fails here
            policy = PolicySettings(name=args.policy, params=params, seed=args.seed)
            jobs.append((args.workload, fleet, policy, routing, point, slo))
    except (SetupError, ValueError, TypeError) as exc:
        print(f"kvlb tune: {exc}", file=sys.stderr)
        return 2
    print(f"kvlb tune: {len(jobs)} runs of {args.policy} on {args.jobs} process(es)", file=sys.stderr)
    if args.jobs == 1:
        trials = [_trial(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
            trials = list(pool.map(_trial, jobs))
    report, best = write_report(
        Path(args.out), trials, objective=args.objective, policy=args.policy, base=dict(base_policy.params),
        workload=args.workload, fleet=fleet.description, slo=slo, command=command,
    )
    winner = min(trials, key=lambda t: t.value(args.objective))
    print(f"best by {args.objective}: {winner.params} (TTFT p99 {_ms(winner.ttft_p99_s)} ms, "
          f"E2E p50 {_ms(winner.e2e_p50_s)} ms, cache hit {winner.cache_hit:.3f})")
    print(f"report: {report}\nconfiguration: {best}")
    return 0
