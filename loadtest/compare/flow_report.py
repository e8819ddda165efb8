"""Flow control against first come, first served, on one fleet, offline and live, in one report.

    python -m loadtest.compare.flow_report --out docs/compare/flow [--live] [--time-scale 4]

The fleet is 4 replicas with kvlb capping each at 4 requests at once. Its capacity (requests a
second) is measured first, offline: 16 places over the mean end-to-end time of the scenario's
requests run one at a time. Then, each scenario with flow control off (one first-come-first-
served line, `limits`) and on (`flow_control` as below, the same limits):

- noisy neighbour: two steady tenants at 20 % of capacity between them, and one tenant
  sending 4x capacity for a minute; the steady tenants alone give the baseline;
- overload: interactive traffic (classes critical and standard) beside a batch job, at 2x
  capacity; critical has a 2 s TTFT target;
- goodput: the same mix at 1.5x, every class with a target (critical 2 s, standard 5 s,
  batch 20 s): requests a second served within their target.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import copy
import dataclasses
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from balancer.config import PolicySettings, RoutingSettings, Settings, parse_settings
from loadtest.client.summary import RequestRecord, percentile
from loadtest.client.workloads import Workload, load_workload
from loadtest.compare.flow_figures import (
    GroupFigures,
    figures_table,
    goodput_per_s,
    group_figures,
    span_s,
)
from loadtest.simulator.fleetspec import FleetPlan, uniform_fleet
from loadtest.simulator.simulator import simulate

REPLICAS, CAP = 4, 4
POLICY = "predictive"
SEED = 0  # the policy's tie-breaks, offline and live: one command, one report
CLASSES = [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"}, {"name": "batch", "sheddable": True}]
GOODPUT_CLASSES = [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard", "ttft_slo_ms": 5000},
                   {"name": "batch", "ttft_slo_ms": 20000, "sheddable": True}]
NOISY = "noisy-neighbour,steady_tenants=2,duration_s=90,burst_start_s=15,burst_s=60"
MIX = "interactive-batch,critical_share=0.3,batch_share=0.5"


def flow_config(classes: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """kvlb's configuration sections for a run: flow control on with `classes`, or off."""
    config: dict[str, Any] = {"limits": {"max_in_flight": 1024, "max_queued": 1024, "queue_timeout_s": 10}}
    if classes is not None:
        config["flow_control"] = {"enabled": True, "trust_headers": True, "classes": list(classes),
                                  "default_class": "standard"}
    return config


def settings_of(config: Mapping[str, Any]) -> Settings:
    return parse_settings({"replicas": [{"url": "http://127.0.0.1:9"}], **config})


def capacity_per_s(shape: str, fleet: FleetPlan) -> float:
    """Places over the mean time a request of `shape` holds one when run alone."""
    alone = load_workload(f"{shape},seed=7").requests[:40]
    spaced = [dataclasses.replace(r, arrival_s=30.0 * i) for i, r in enumerate(alone)]
    result = simulate(uniform_fleet(REPLICAS), spaced, PolicySettings(name=POLICY, seed=SEED), RoutingSettings())
    e2e = statistics.mean(r.e2e_s for r in result.records if r.ok and r.e2e_s is not None)
    return REPLICAS * CAP / e2e


def offline(workload: Workload, config: Mapping[str, Any]) -> list[RequestRecord]:
    settings = settings_of(config)
    flow = settings if settings.flow_control.enabled else None
    fleet = uniform_fleet(REPLICAS, max_concurrency=CAP)
    return simulate(fleet, workload.requests, PolicySettings(name=POLICY, seed=SEED), RoutingSettings(),
                    limits=settings.limits, flow=flow).records


def live_runner(time_scale: float) -> Callable[[Workload, Mapping[str, Any]], list[RequestRecord]]:
    from loadtest.client.runner import run_load
    from loadtest.compare.livefleet import LiveFleet

    async def run(workload: Workload, config: Mapping[str, Any]) -> list[RequestRecord]:
        async with LiveFleet(REPLICAS, time_scale=time_scale) as fleet:
            await fleet.start_replicas()
            target = await fleet.start_kvlb(POLICY, seed=SEED, max_concurrency=CAP, extra=in_real_time(config, time_scale))
            records, _ = await run_load(target, workload.requests, time_scale=time_scale, progress=False,
                                        max_concurrency=4096, timeout_s=120)
            return records

    return lambda workload, config: asyncio.run(run(workload, config))


def in_real_time(config: Mapping[str, Any], time_scale: float) -> dict[str, Any]:
    """The configuration's times (model time) as kvlb must read them in front of replicas
    running `time_scale` times faster than their profile: its clock is the real one."""
    out = copy.deepcopy(dict(config))
    out["limits"]["queue_timeout_s"] = config["limits"]["queue_timeout_s"] / time_scale
    flow = out.get("flow_control")
    if flow is not None:
        flow["fairness_window_s"] = 10.0 / time_scale
        for klass in flow["classes"]:
            if "ttft_slo_ms" in klass:
                klass["ttft_slo_ms"] = klass["ttft_slo_ms"] / time_scale
    return out


def scenarios(fleet_capacity: Mapping[str, float]) -> list[dict[str, Any]]:
    noisy_cap, mix_cap = fleet_capacity["noisy"], fleet_capacity["mix"]
    noisy = f"{NOISY},steady_rate={0.2 * noisy_cap:.3f},noisy_rate={4 * noisy_cap:.3f}"
    two_x = f"{MIX},rate={2 * mix_cap:.3f},requests={round(2 * mix_cap * 90)}"
    one_half = f"{MIX},rate={1.5 * mix_cap:.3f},requests={round(1.5 * mix_cap * 90)}"
    return [
        {"name": "noisy neighbour", "spec": noisy, "by": "tenant", "targets": {},
         "runs": {"steady alone": (flow_config(None), lambda r: r.tenant != "noisy"),
                  "first come, first served": (flow_config(None), None),
                  "flow control": (flow_config(CLASSES), None)}},
        {"name": "2x overload, interactive beside batch", "spec": two_x, "by": "priority",
         "targets": {"critical": 2.0},
         "runs": {"first come, first served": (flow_config(None), None),
                  "flow control": (flow_config(CLASSES), None)}},
        {"name": "1.5x overload, goodput", "spec": one_half, "by": "priority",
         "targets": {"critical": 2.0, "standard": 5.0, "batch": 20.0},
         "runs": {"first come, first served": (flow_config(None), None),
                  "flow control": (flow_config(GOODPUT_CLASSES), None)}},
    ]


def run_all(run: Callable[[Workload, Mapping[str, Any]], list[RequestRecord]], plan: list[dict[str, Any]],
            mode: str, out: Path, tag: str) -> list[str]:
    lines = [f"## {mode}", ""]
    for scenario in plan:
        workload = load_workload(scenario["spec"])
        by = scenario["by"]
        figures: dict[str, dict[str, GroupFigures]] = {}
        records: dict[str, list[RequestRecord]] = {}
        for name, (config, keep) in scenario["runs"].items():
            chosen = workload if keep is None else Workload(workload.spec, workload.description,
                                                            tuple(r for r in workload.requests if keep(r)),
                                                            workload.seed, ())
            print(f"  {mode}: {scenario['name']}: {name} ({len(chosen.requests)} requests)", file=sys.stderr)
            recs = records[name] = run(chosen, config)
            figures[name] = group_figures(recs, lambda r, by=by: getattr(r, by), scenario["targets"])
        lines += [f"### {scenario['name']}", "", f"Workload `{scenario['spec']}`: {workload.description}.", ""]
        lines += figures_table(figures, by)
        lines += [""] + verdict(scenario, figures, records) + [""]
        name = f"{tag}-{scenario['name'].split(',')[0].replace(' ', '-').replace('.', '_')}.png"
        if plot_groups(records, by, out / name, f"{scenario['name']} ({tag})"):
            lines += [f"![TTFT per {by} over time]({name})", ""]
    return lines


def plot_groups(records: Mapping[str, Sequence[RequestRecord]], by: str, path: Path, title: str) -> bool:
    """Each run's served requests, TTFT against send time, one colour per tenant or class;
    refused ones as crosses at the bottom. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = list(records)
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 * len(runs) + 0.6), sharex=True, squeeze=False)
    groups = sorted({getattr(r, by) or "-" for recs in records.values() for r in recs})
    colours = {g: f"C{i}" for i, g in enumerate(groups)}
    for ax, run in zip(axes[:, 0], runs, strict=True):
        for group in groups:
            rows = [r for r in records[run] if (getattr(r, by) or "-") == group]
            ok = [r for r in rows if r.ok and r.ttft_s]
            ax.scatter([r.send_s for r in ok], [r.ttft_s for r in ok], s=3, color=colours[group], label=group)
            refused = [r.send_s for r in rows if not r.ok]
            ax.scatter(refused, [0.002] * len(refused), s=6, marker="x", color=colours[group], alpha=0.3)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(run, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=7, markerscale=3, loc="upper left")
    axes[-1, 0].set_xlabel("send time (s, model time); crosses: refused")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def verdict(scenario: Mapping[str, Any], figures: Mapping[str, Mapping[str, GroupFigures]],
            records: Mapping[str, Sequence[RequestRecord]]) -> list[str]:
    name = scenario["name"]
    fcfs, flow = "first come, first served", "flow control"
    if name.startswith("noisy"):
        out = []
        for tenant in sorted(t for t in figures[flow] if t.startswith("steady")):
            alone = figures["steady alone"][tenant].ttft_p99_s or 0.0
            with_flow = figures[flow][tenant].ttft_p99_s or 0.0
            out.append(f"- {tenant}: TTFT p99 {alone * 1000:,.0f} ms alone, {with_flow * 1000:,.0f} ms beside the "
                       f"noisy tenant with flow control (+{(with_flow - alone) * 1000:,.0f} ms), "
                       f"{(figures[fcfs][tenant].ttft_p99_s or 0.0) * 1000:,.0f} ms first come, first served.")
        place = wait_for_a_place(records[flow], lambda r: (r.tenant or "").startswith("steady"))
        if place is not None:
            out.append(f"- The wait for one place on the fleet (from a steady request's arrival during the burst "
                       f"to the next request ending anywhere on the fleet): p50 {place[0] * 1000:,.0f} ms, "
                       f"p99 {place[1] * 1000:,.0f} ms.")
        return out
    if name.startswith("2x"):
        out = []
        for run in (fcfs, flow):
            critical = figures[run].get("critical")
            if critical is not None and critical.with_target:
                out.append(f"- {run}: critical met its 2 s TTFT target {critical.met / critical.with_target:.1%} "
                           f"of the time ({critical.met} of {critical.with_target}).")
        return out
    targets = scenario["targets"]
    rates = {run: goodput_per_s(recs, targets, span_s(recs)) for run, recs in records.items()}
    ratio = rates[flow] / rates[fcfs] if rates[fcfs] > 0 else float("inf")
    return [f"- goodput (requests a second served within their class's target): {rates[fcfs]:.2f}/s first come, "
            f"first served; {rates[flow]:.2f}/s with flow control ({ratio:.2f}x)."]


def wait_for_a_place(records: Sequence[RequestRecord], chosen: Callable[[RequestRecord], bool]
                     ) -> tuple[float, float] | None:
    """For the chosen requests that arrived while others waited (the fleet saturated), the
    time from their arrival to the next request ending: what a request first in line waits
    for. (p50, p99), or None when none arrived then."""
    ends = sorted(r.send_s + r.e2e_s for r in records if r.ok and r.e2e_s is not None)
    saturated = [r for r in records if not r.ok or (r.queued_s or 0.0) > 0]
    if not ends or not saturated:
        return None
    start, stop = min(r.send_s for r in saturated), max(r.send_s for r in saturated)
    waits = []
    for r in records:
        if chosen(r) and start <= r.send_s <= stop:
            i = bisect.bisect_right(ends, r.send_s)
            if i < len(ends):
                waits.append(ends[i] - r.send_s)
    if not waits:
        return None
    waits.sort()
    return percentile(waits, 50) or 0.0, percentile(waits, 99) or 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for report.md")
    parser.add_argument("--live", action="store_true", help="also through kvlb and simulated replica processes")
    parser.add_argument("--time-scale", type=float, default=4.0, help="live replicas' speed-up (default 4)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capacity = {"noisy": capacity_per_s(NOISY, uniform_fleet(REPLICAS)), "mix": capacity_per_s(MIX, uniform_fleet(REPLICAS))}
    plan = scenarios(capacity)
    lines = ["# Flow control against first come, first served", "",
             f"{REPLICAS} simulated replicas (llama-3.1-8b-h100 profile), kvlb capping each at {CAP} requests "
             f"at once, policy `{POLICY}`. Capacity, measured offline (16 places over the mean time of a "
             f"request run alone): noisy-neighbour requests {capacity['noisy']:.2f}/s, the interactive-batch "
             f"mix {capacity['mix']:.2f}/s. Limits in every run: max_in_flight 1024, max_queued 1024, "
             "queue_timeout_s 10. Flow control: classes critical (2 s TTFT target), standard, batch "
             "(sheddable); the goodput run gives standard 5 s and batch 20 s targets too. Times are model "
             "time. `python -m loadtest.compare.flow_report --out DIR" + (" --live" if args.live else "")
             + "` writes this report.", ""]
    lines += run_all(offline, plan, "offline (kvlb simulate)", out, "offline")
    if args.live:
        lines += run_all(live_runner(args.time_scale), plan,
                         f"live (kvlb serve, simulated replica processes at time scale {args.time_scale:g})", out, "live")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
