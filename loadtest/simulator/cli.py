"""`kvlb simulate`: one policy, one workload, one virtual fleet, in virtual time.

Writes the same `requests.jsonl` and `summary.json` as `kvlb loadtest`, so an offline run
and a live one compare field by field.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from balancer.config import (
    ConfigError,
    DisaggregationSettings,
    Limits,
    ModelSettings,
    PolicySettings,
    RoutingSettings,
    Settings,
    parse_settings,
)
from loadtest.client.summary import RequestRecord, model_lines, summarize, write_results
from loadtest.client.workloads import Workload, WorkloadError, load_workload
from loadtest.replica.profiles import DEFAULT_PROFILE, PROFILES
from loadtest.simulator.fleetspec import FleetError, FleetPlan, load_fleet, uniform_fleet
from loadtest.simulator.ideal import fleet_ideal_ttfts
from loadtest.simulator.simulator import MODEL, simulate

HELP = "replay a workload through a routing policy on a virtual fleet, offline"
PRECISE_HELP = (
    "precise mode: cache-aware policies route on the engines' own KV cache events (prompts as "
    "token ids, hashed in engine blocks) instead of predicting what each replica caches; "
    "no effect on policies that do not read the prompt"
)


# The balancer's limits in every load-test run, live or offline, so both see the same
# admission: a load test is many clients at once, and no admission queue should stand in the
# way of what is measured.
HARNESS_LIMITS = Limits(max_in_flight=100_000)


class SetupError(Exception):
    """Bad arguments or files: printed as one line, exit status 2."""


def per_model_settings(config_path: str | None) -> tuple[ModelSettings, ...]:
    """The configuration's `per_model`: models with a policy or a bound of their own."""
    return () if config_path is None else read_config(config_path).per_model


def policy_settings(name: str, config_path: str | None, seed: int) -> tuple[PolicySettings, RoutingSettings]:
    """The policy called `name`, with its parameters and the routing section from a kvlb
    configuration file when that file configures the same policy (its `replicas` may be left
    out)."""
    if config_path is None:
        return PolicySettings(name=name, seed=seed), RoutingSettings()
    settings = read_config(config_path)
    params = settings.policy.params if settings.policy.name == name else {}
    return PolicySettings(name=name, params=params, seed=seed), settings.routing


def disaggregation_settings(config_path: str | None) -> DisaggregationSettings:
    """The configuration's `disaggregation` section: how a fleet with roles splits requests."""
    return DisaggregationSettings() if config_path is None else read_config(config_path).disaggregation


def flow_settings(config_path: str | None) -> Settings | None:
    """The configuration, when it turns flow control on: its `flow_control`, `auth.tenants`
    and `limits` then run offline as `kvlb serve` runs them."""
    if config_path is None:
        return None
    settings = read_config(config_path)
    return settings if settings.flow_control.enabled else None


FLOW_SECTIONS = ("flow_control", "auth", "limits")


def flow_sections(config_path: str | None) -> dict[str, Any]:
    """The configuration's sections that flow control reads, as written, for a live kvlb;
    none when it does not turn flow control on."""
    if flow_settings(config_path) is None:
        return {}
    assert config_path is not None
    data = _config_data(config_path)
    return {key: data[key] for key in FLOW_SECTIONS if key in data}


def _config_data(config_path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SetupError(f"cannot read policy config {config_path}: {exc}") from None
    if not isinstance(data, dict):
        raise SetupError(f"{config_path}: expected a kvlb configuration (a mapping)")
    return data


def read_config(config_path: str) -> Settings:
    data = _config_data(config_path)
    if not data.get("replicas") and not data.get("replica_sets"):
        data = dict(data, replicas=[{"url": "http://127.0.0.1:9"}])
    try:
        return parse_settings(data)
    except ConfigError as exc:
        raise SetupError(f"{config_path}: " + "; ".join(exc.problems)) from None


def fleet_from_args(args: argparse.Namespace) -> FleetPlan:
    try:
        if args.fleet:
            return load_fleet(args.fleet)
        if args.max_loras < 0 or args.lora_load_ms < 0:
            raise SetupError("--max-loras and --lora-load-ms must not be negative")
        return uniform_fleet(args.replicas, args.profile, args.kv_capacity_tokens, args.context_limit,
                             args.max_concurrency, args.max_loras, args.lora_load_ms)
    except FleetError as exc:
        raise SetupError(str(exc)) from None


def workload_from_args(spec: str) -> Workload:
    try:
        workload = load_workload(spec)
    except WorkloadError as exc:
        raise SetupError(str(exc)) from None
    for warning in workload.warnings[:20]:
        print(f"warning: {warning}", file=sys.stderr)
    if len(workload.warnings) > 20:
        print(f"warning: ... and {len(workload.warnings) - 20} more", file=sys.stderr)
    if not workload.requests:
        raise SetupError(f"workload {spec!r} has no requests")
    return workload


def run_offline(
    workload: Workload,
    fleet: FleetPlan,
    policy: PolicySettings,
    routing: RoutingSettings,
    out_dir: Path | None = None,
    progress: bool = False,
    precise: bool = False,
    ideal: Mapping[int, float] | None = None,
    flow: Settings | None = None,
    disaggregation: DisaggregationSettings | None = None,
    per_model: Sequence[ModelSettings] = (),
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Simulate, summarize, and write the results when `out_dir` is given. `ideal` is each
    request's TTFT on the ideal fleet (`ideal_for`), computed once for several runs; `flow`
    runs its flow control (`flow_settings`)."""
    total = len(workload.requests)
    started = time.process_time()
    last = [0.0]

    def show(done: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.25 or done == total:
            last[0] = now
            print(f"\r  {policy.name}: {done}/{total} requests simulated", end="", file=sys.stderr, flush=True)

    result = simulate(fleet, workload.requests, policy, routing, show if progress else None, precise=precise,
                      limits=HARNESS_LIMITS, flow=flow, disaggregation=disaggregation, per_model=per_model)
    if progress:
        print(file=sys.stderr)
    cpu_s = time.process_time() - started
    meta = {
        "mode": "offline",
        "flow_control": flow is not None,
        "policy": policy.name,
        "policy_params": dict(policy.params),
        "workload": workload.spec,
        "workload_description": workload.description,
        "fleet": fleet.description,
        "replicas": len(fleet.replicas),
        "seed": policy.seed,
        "time_scale": 1.0,
        "precise": result.precise,
        "simulation": {
            "cpu_seconds": round(cpu_s, 3),
            "events": result.events,
            "engine_iterations": result.iterations,
            "decode_runs": result.decode_runs,
        },
        "adapter_loads": result.adapter_loads,
    }
    if ideal is None:
        ideal = ideal_for(workload, fleet)
    for record in result.records:
        record.ideal_ttft_s = ideal.get(record.index)
    summary = summarize(
        result.records, result.duration_s, replicas=result.replicas, meta=meta, block_size=result.block_size
    )
    if out_dir is not None:
        write_results(out_dir, result.records, summary)
    return summary, result.records


def ideal_for(workload: Workload, fleet: FleetPlan) -> dict[int, float]:
    """Each request's TTFT on an idle replica holding every earlier prompt (loadtest/simulator/ideal.py)."""
    return fleet_ideal_ttfts(workload.requests, fleet, MODEL)


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group("virtual fleet (offline runs)")
    fleet.add_argument("--fleet", help="fleet YAML (groups of replicas, regions, tiers)")
    fleet.add_argument("--replicas", type=int, default=8, help="identical replicas when no --fleet (default 8)")
    fleet.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    fleet.add_argument("--kv-capacity-tokens", type=int, default=None, help="default: the profile's")
    fleet.add_argument("--context-limit", type=int, default=131072, help="longest prompt + output a replica takes")
    fleet.add_argument("--max-concurrency", type=int, default=None,
                       help="the balancer's cap on requests at once per replica (its max_concurrency)")
    fleet.add_argument("--max-loras", type=int, default=0,
                       help="LoRA adapter slots per replica (0: no adapters; every adapter the workload names is served)")
    fleet.add_argument("--lora-load-ms", type=float, default=100.0, help="model ms to load an adapter into a slot")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("simulate", help=HELP, description=HELP)
    parser.add_argument("--workload", required=True, help="workload spec (see loadtest/client/workloads.py)")
    parser.add_argument("--policy", default="predictive")
    parser.add_argument("--policy-config", help="kvlb config whose policy params, routing section and per_model "
                        "entries apply, and its flow_control (with auth.tenants and limits) when enabled")
    parser.add_argument("--seed", type=int, default=0, help="the policy's random seed")
    parser.add_argument("--out", required=True, help="directory for requests.jsonl and summary.json")
    parser.add_argument("--precise", action="store_true", help=PRECISE_HELP)
    parser.add_argument("--no-progress", action="store_true")
    add_fleet_arguments(parser)
    parser.set_defaults(func=main)


def precise_applies(name: str) -> bool:
    """Whether precise mode changes anything for the policy called `name`."""
    from policies.registry import make_policy

    return make_policy(name).needs_prompt


def print_summary(summary: dict[str, Any]) -> None:
    ttft = summary["ttft_s"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    ratio = summary["replica_max_min_ratio"]
    within = summary.get("predicted_within_one_block")
    print(
        f"{summary['policy']}{' (precise)' if summary.get('precise') else ''}: "
        f"{summary['requests']} requests, {summary['errors']} errors, "
        f"cache hit {summary['cache_hit_ratio']:.3f}, TTFT p50 {ms(ttft['p50'])} p99 {ms(ttft['p99'])}, "
        f"TPOT p50 {ms(summary['tpot_s']['p50'])}, max/min per replica "
        + ("-" if ratio is None else f"{ratio:.2f}")
        + ("" if within is None else f", predicted hit within a block {within:.3f}")
    )
    ideal, over = summary.get("ideal_ttft_s"), summary.get("ttft_over_ideal")
    if ideal and over and over["mean"] is not None and over["p99"] is not None:
        print(f"  ideal fleet (idle, holding every earlier prompt): TTFT p50 {ms(ideal['p50'])} "
              f"p99 {ms(ideal['p99'])}; this run's mean is {over['mean']:.1f}x its mean, p99 {over['p99']:.1f}x")
    for line in model_lines(summary):
        print(line)


def main(args: argparse.Namespace) -> int:
    try:
        workload = workload_from_args(args.workload)
        fleet = fleet_from_args(args)
        policy, routing = policy_settings(args.policy, args.policy_config, args.seed)
        flow = flow_settings(args.policy_config)
        disaggregation = disaggregation_settings(args.policy_config)
        per_model = per_model_settings(args.policy_config)
        if args.policy_config is None:
            from policies.registry import make_policy

            make_policy(policy.name)  # an unknown name fails here, before any work
        if args.precise and not precise_applies(policy.name):
            print(f"kvlb simulate: --precise has no effect: {policy.name} does not read the prompt", file=sys.stderr)
    except (SetupError, ValueError) as exc:
        print(f"kvlb simulate: {exc}", file=sys.stderr)
        return 2
    summary, _ = run_offline(
        workload, fleet, policy, routing, Path(args.out), progress=not args.no_progress, precise=args.precise,
        flow=flow, disaggregation=disaggregation, per_model=per_model,
    )
    print_summary(summary)
    sim = summary["simulation"]
    print(f"simulated {summary['duration_s']:.1f} s of traffic in {sim['cpu_seconds']:.1f} s of CPU; wrote {args.out}")
    return 0
