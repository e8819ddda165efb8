"""`kvlb compare`: every policy on the same workload, side by side, in one report.

Offline by default (the simulator, seconds per policy). `--live` runs each policy through
real processes: fresh simulated replicas per policy, so no run inherits another's warm
caches, and kvlb in front. `--external NAME=COMMAND` adds another router started from a
command template pointed at the same kind of fresh replicas (see LiveFleet.start_external).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from loadtest.client.summary import Results, summarize, with_replica_counts, write_results
from loadtest.client.workloads import Workload
from loadtest.compare.livefleet import LiveFleet
from loadtest.compare.repeats import median_summary, run_order
from loadtest.compare.report import against_baseline, against_ideal, table, write_report
from loadtest.compare.sweep import (
    Slo,
    capacity,
    parse_sweep,
    run_sweep,
    with_option,
    write_sweep_report,
)
from loadtest.simulator.cli import (
    PRECISE_HELP,
    SetupError,
    add_fleet_arguments,
    fleet_from_args,
    flow_sections,
    flow_settings,
    ideal_for,
    per_model_settings,
    policy_settings,
    run_offline,
    workload_from_args,
)
from loadtest.simulator.fleetspec import FleetPlan, uniform_fleet

HELP = "compare routing policies on one workload (offline by default) and write report.md"


def compare_offline(
    workload: Workload, fleet: FleetPlan, policies: list[str], out_dir: Path, seed: int = 0,
    policy_config: str | None = None, progress: bool = True, precise: bool = False,
) -> Results:
    """`precise` applies to the cache-aware policies (those that read the prompt)."""
    results: Results = {}
    ideal = ideal_for(workload, fleet)  # the same limit for every policy
    flow = flow_settings(policy_config)
    per_model = per_model_settings(policy_config)
    for name in policies:
        policy, routing = policy_settings(name, policy_config, seed)
        results[name] = run_offline(
            workload, fleet, policy, routing, out_dir / name, progress=progress, precise=precise, ideal=ideal,
            flow=flow, per_model=per_model,
        )
    return results


async def compare_live(
    workload: Workload, policies: list[str], out_dir: Path, *, replicas: int, profile: str,
    time_scale: float, seed: int = 0, externals: dict[str, str] | None = None,
    policy_config: str | None = None, timeout_s: float = 300.0, progress: bool = True,
    replica_args: list[str] | None = None, replica_settings: dict[str, Any] | None = None,
    repeat: int = 1,
) -> Results:
    """`repeat`: runs per router, in alternating order; each figure is then their median
    (loadtest/compare/repeats.py)."""
    from loadtest.client.runner import run_load

    results: Results = {}
    # The limit on the replicas' own profile, as offline (their extra flags aside).
    ideal = ideal_for(workload, uniform_fleet(replicas, profile))
    commands: dict[str, str | None] = {name: None for name in policies}
    commands.update(externals or {})
    runs: dict[str, list[tuple[dict[str, Any], list[Any]]]] = {name: [] for name in commands}
    async with LiveFleet(replicas, profile, time_scale, replica_args=replica_args or (),
                         replica_settings=replica_settings) as fleet:
        for run, name in run_order(list(commands), repeat):
            command = commands[name]
            await fleet.start_replicas()
            if command is None:
                policy, routing = policy_settings(name, policy_config, seed)
                target = await fleet.start_kvlb(name, dict(policy.params), seed, dataclasses.asdict(routing),
                                                extra=flow_sections(policy_config))
            else:
                target = await fleet.start_external(command)
            if progress:
                which = f" (run {run + 1} of {repeat})" if repeat > 1 else ""
                print(f"  {name}{which}: {len(workload.requests)} requests live through {target}", file=sys.stderr)
            cpu_before = fleet.routers_cpu_seconds()
            try:
                records, meta = await run_load(
                    target, workload.requests, model=fleet.model, time_scale=time_scale,
                    timeout_s=timeout_s, progress=progress,
                )
                router_cpu_s = fleet.routers_cpu_seconds() - cpu_before
            finally:
                fleet.stop_router()
            meta.update({
                "mode": "live", "policy": name, "workload": workload.spec,
                "workload_description": workload.description,
                "fleet": f"{replicas} x {profile} (simulated replica processes, time scale {time_scale:g})",
                "replicas": replicas, "seed": seed, "target": command or "kvlb",
                "router_cpu_s": round(router_cpu_s, 3),
            })
            duration = meta.pop("duration_s")
            for record in records:
                record.ideal_ttft_s = ideal.get(record.index)
            summary = summarize(records, duration, replicas=fleet.replica_names, meta=meta)
            if all(record.replica is None for record in records):
                # A router that does not name the serving replica: ask the replicas instead.
                with_replica_counts(summary, await fleet.replica_request_counts(), "replica metrics")
            write_results(out_dir / name / f"run-{run + 1}" if repeat > 1 else out_dir / name, records, summary)
            runs[name].append((summary, records))
    for name, done in runs.items():
        if repeat == 1:
            results[name] = done[0]
            continue
        # The first run's requests draw the plots; the table takes every figure's median.
        merged = median_summary([summary for summary, _ in done])
        write_results(out_dir / name, done[0][1], merged)
        results[name] = (merged, done[0][1])
    return results


def finish(results: Results, out_dir: Path, *, workload: Workload, fleet: str, seed: int, mode: str, command: str) -> Path:
    summaries = {name: summary for name, (summary, _) in results.items()}
    records = {name: recs for name, (_, recs) in results.items()}
    return write_report(
        out_dir, summaries, records, workload=f"{workload.description} (`{workload.spec}`)",
        fleet=fleet, seed=seed, mode=mode, command=command,
    )


def print_comparison(results: Results) -> None:
    summaries = {name: summary for name, (summary, _) in results.items()}
    print(table(summaries), end="")
    for line in against_baseline(summaries):
        print(line.replace("**", ""))
    for line in against_ideal(summaries):
        print(line)


def _external(text: str) -> tuple[str, str]:
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise argparse.ArgumentTypeError("expected NAME=COMMAND")
    return name, command


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("compare", help=HELP, description=HELP)
    parser.add_argument("--workload", required=True, help="workload spec (see loadtest/client/workloads.py)")
    parser.add_argument("--policies", default="random,round_robin,least_load,cache_aware,sglang_cache_aware,predictive",
                        help="comma-separated policy names (default: %(default)s)")
    parser.add_argument("--policy-config", help="kvlb config whose policy params apply to that policy; "
                        "offline, its per_model entries apply too")
    parser.add_argument("--live", action="store_true", help="through real replica and kvlb processes")
    parser.add_argument("--external", action="append", type=_external, default=[], metavar="NAME=COMMAND",
                        help="another router for live runs; COMMAND may use {port}, {workers}, {workers_csv}")
    parser.add_argument("--time-scale", type=float, default=10.0, help="live replicas' speed-up (default 10)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="live: per-request deadline, real seconds")
    parser.add_argument("--repeat", type=int, default=1,
                        help="live: runs per router, in alternating order; the report gives each figure's "
                             "median and every run's figures beside it (default 1)")
    parser.add_argument("--precise", action="store_true", help=PRECISE_HELP + "; offline only (refused with --live)")
    parser.add_argument("--seed", type=int, default=0, help="policies' random seed")
    parser.add_argument("--out", required=True, help="directory for report.md, plots and per-run results")
    parser.add_argument("--no-progress", action="store_true")
    sweep = parser.add_argument_group("load sweep (loadtest/compare/sweep.py)")
    sweep.add_argument("--sweep", metavar="KEY=V1,V2,...",
                       help="run the comparison once per value of a workload key, e.g. speedup=1,2,4 or rate=5,10,20")
    sweep.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="SLO: time to first token (default 2000)")
    sweep.add_argument("--slo-tpot-ms", type=float, help="SLO: time per output token (default: none)")
    sweep.add_argument("--slo-attainment", type=float, default=0.99,
                       help="fraction of requests that must meet the SLO (default 0.99)")
    add_fleet_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    out_dir = Path(args.out)
    command = "kvlb compare " + shlex.join(sys.argv[2:]) if len(sys.argv) > 2 else "kvlb compare"
    try:
        if args.external and not args.live:
            raise SetupError("--external needs --live")
        if args.live and args.precise:
            raise SetupError("--precise is offline only: a live run's kvlb predicts the cache")
        if args.repeat < 1:
            raise SetupError("--repeat must be at least 1")
        if args.repeat > 1 and not args.live:
            raise SetupError("--repeat is for live runs: an offline run is the same every time (vary --seed)")
        if args.live and args.fleet:
            raise SetupError("--live starts identical replicas: use --replicas and --profile, not --fleet")
        sweep = parse_sweep(args.sweep) if args.sweep else None
        slo = Slo(args.slo_ttft_ms / 1000, None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000,
                  args.slo_attainment)
        if not 0 < slo.attainment <= 1:
            raise SetupError("--slo-attainment must be in (0, 1]")
        specs = [args.workload] if sweep is None else [with_option(args.workload, sweep[0], v) for v in sweep[1]]
        workloads = {spec: workload_from_args(spec) for spec in specs}
        for name in policies:
            policy_settings(name, args.policy_config, args.seed)
        from policies.registry import make_policy

        for name in policies:
            make_policy(name)
        fleet = None if args.live else fleet_from_args(args)
    except (SetupError, ValueError) as exc:
        print(f"kvlb compare: {exc}", file=sys.stderr)
        return 2
    if args.live:
        fleet_text = f"{args.replicas} x {args.profile} (simulated replica processes, time scale {args.time_scale:g})"
    else:
        assert fleet is not None
        fleet_text = fleet.description

    def compare_one(spec: str, run_dir: Path) -> Results:
        results = _run(args, workloads[spec], policies, run_dir, fleet)
        mode = ("live" if args.live else
                "offline (kvlb simulate, precise mode)" if args.precise else "offline (kvlb simulate)")
        report = finish(results, run_dir, workload=workloads[spec], fleet=fleet_text, seed=args.seed,
                        mode=mode, command=command)
        print_comparison(results)
        print(f"report: {report}")
        return results

    if sweep is None:
        compare_one(args.workload, out_dir)
        return 0
    key, levels = sweep
    curves = run_sweep(args.workload, key, levels, slo, out_dir, compare_one)
    report = write_sweep_report(out_dir, curves, key=key, slo=slo, workload=args.workload, fleet=fleet_text,
                                command=command)
    print(f"SLO: {slo.describe()}")
    for name, points in curves.items():
        print(f"  {name}: highest {key} meeting it: {capacity(points, slo) or 'none swept'}; goodput "
              + ", ".join(f"{p.level}: {p.goodput_per_s:.2f}/s" for p in points))
    print(f"sweep report: {report}")
    return 0


def _run(args: argparse.Namespace, workload: Workload, policies: list[str], out_dir: Path,
         fleet: FleetPlan | None) -> Results:
    progress = not args.no_progress
    if args.live:
        replica_args = []
        if args.kv_capacity_tokens:
            replica_args += ["--kv-capacity-tokens", str(args.kv_capacity_tokens)]
        if args.context_limit != 131072:
            replica_args += ["--context-limit", str(args.context_limit)]
        replica_settings: dict[str, Any] = {}
        if args.max_loras > 0:
            # Replicas serving every adapter the workload names, with vLLM's flags; kvlb is told
            # the load time, and reads the slots from the engines as it would in production.
            adapters = sorted({r.adapter for r in workload.requests if r.adapter is not None})
            replica_args += ["--enable-lora", "--max-loras", str(args.max_loras),
                             "--lora-load-ms", f"{args.lora_load_ms:g}"]
            if adapters:
                replica_args += ["--lora-modules", *(f"{name}=/adapters/{name}" for name in adapters)]
            replica_settings["lora_load_ms"] = args.lora_load_ms
        return asyncio.run(compare_live(
            workload, policies, out_dir, replicas=args.replicas, profile=args.profile,
            time_scale=args.time_scale, seed=args.seed, externals=dict(args.external),
            policy_config=args.policy_config, timeout_s=args.timeout_s, progress=progress,
            replica_args=replica_args, replica_settings=replica_settings, repeat=args.repeat,
        ))
    assert fleet is not None
    return compare_offline(
        workload, fleet, policies, out_dir, args.seed, args.policy_config, progress, precise=args.precise
    )
