"""The comparison report: one table and three plots a person reads at a glance.

Input is what each run wrote (`summary.json` and the per-request records); nothing here
measures anything, so a report can be redrawn from saved results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.client.summary import RequestRecord
from loadtest.compare.repeats import spread_lines

BASELINE = "random"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown table, one row per run; times in milliseconds of model time."""
    head = (
        "| policy | requests | errors | cache hit | TTFT mean | TTFT p50 | TTFT p90 | TTFT p99 "
        "| TPOT p50 | E2E p50 | E2E p99 | out tok/s | max/min per replica |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for name, s in summaries.items():
        ttft, ratio = s["ttft_s"], s["replica_max_min_ratio"]
        rows.append(
            f"| {name} | {s['requests']} | {s['errors']} | {s['cache_hit_ratio']:.3f} "
            f"| {_ms(ttft['mean'])} | {_ms(ttft['p50'])} | {_ms(ttft['p90'])} | {_ms(ttft['p99'])} "
            f"| {_ms(s['tpot_s']['p50'])} | {_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p99'])} "
            f"| {s['throughput']['output_tokens_per_s']:,.0f} | {'–' if ratio is None else f'{ratio:.2f}'} |"
        )
    return head + "\n".join(rows) + "\n"


def by_model(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per model, for runs with several models behind one endpoint: each run's share."""
    if not any(s.get("by_model") for s in summaries.values()):
        return []
    lines = [
        "Per model:",
        "",
        "| policy | model | requests | errors | cache hit | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        for model, m in (s.get("by_model") or {}).items():
            lines.append(
                f"| {name} | {model} | {m['requests']} | {m['errors']} | {m['cache_hit_ratio']:.3f} "
                f"| {_ms(m['ttft_s']['p50'])} | {_ms(m['ttft_s']['p99'])} | {_ms(m['e2e_s']['p50'])} "
                f"| {_ms(m['e2e_s']['p99'])} |"
            )
    return lines


def against_ideal(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The limit beside the result: the ideal fleet's TTFT, then each run's multiple of it."""
    ideal = next((s["ideal_ttft_s"] for s in summaries.values() if s.get("ideal_ttft_s")), None)
    if ideal is None:
        return []
    lines = [
        f"Ideal TTFT (an idle replica of the fleet's profile whose cache holds every earlier prompt, "
        f"without bound): mean {_ms(ideal['mean'])} ms, p50 {_ms(ideal['p50'])} ms, p99 {_ms(ideal['p99'])} ms.",
        "",
        "| policy | TTFT mean / ideal | TTFT p99 / ideal |",
        "|---|---:|---:|",
    ]
    for name, s in summaries.items():
        over = s.get("ttft_over_ideal") or {}
        lines.append(f"| {name} | {_times(over.get('mean'))} | {_times(over.get('p99'))} |")
    return lines


def router_cpu(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Live runs: what each router's own processes spent on CPU during its run. On a machine
    whose cores also run the replicas and the load client, a router's CPU is time taken from
    them, which its latencies alone do not show."""
    rows = [(name, s["router_cpu_s"], s.get("requests") or 0) for name, s in summaries.items()
            if s.get("router_cpu_s") is not None]
    if not rows:
        return []
    lines = ["| router | CPU during the run (user + system) | per request |", "|---|---:|---:|"]
    for name, seconds, requests in rows:
        per = f"{seconds * 1000 / requests:.2f} ms" if requests else "–"
        lines.append(f"| {name} | {seconds:.2f} s | {per} |")
    return lines


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}x"


def against_baseline(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per run: its cache-hit ratio and TTFT p99 as multiples of random's."""
    base = summaries.get(BASELINE)
    if base is None:
        return []
    lines = []
    for name, s in summaries.items():
        if name == BASELINE:
            continue
        hit = s["cache_hit_ratio"] / base["cache_hit_ratio"] if base["cache_hit_ratio"] else None
        p99, base_p99 = s["ttft_s"]["p99"], base["ttft_s"]["p99"]
        faster = base_p99 / p99 if p99 and base_p99 else None
        parts = []
        if hit is not None:
            parts.append(f"{hit:.2f}x the cache-hit ratio")
        if faster is not None:
            parts.append(f"TTFT p99 {faster:.2f}x lower" if faster >= 1 else f"TTFT p99 {1 / faster:.2f}x higher")
        lines.append(f"- **{name}** against {BASELINE}: " + ", ".join(parts or ["no comparable figures"]))
    return lines


def plot(records: Mapping[str, Sequence[RequestRecord]], summaries: Mapping[str, Mapping[str, Any]], out_dir: Path) -> list[str]:
    """Write the PNGs; returns their file names (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display on a server
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = list(records)
    files = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in names:
        ttft = sorted(r.ttft_s for r in records[name] if r.ok and r.ttft_s is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, model time, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    files.append("ttft_cdf.png")

    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.2 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        per_replica: dict[str, list[float]] = {}
        for r in sorted(records[name], key=lambda r: r.send_s):
            if r.ok and r.replica is not None:
                per_replica.setdefault(r.replica, []).append(r.send_s)
        for replica in sorted(per_replica):
            times = per_replica[replica]
            ax.step(times, range(1, len(times) + 1), where="post", linewidth=1)
        title = "requests per replica (one line each)" if per_replica else "the target did not name the serving replica"
        ax.set_title(f"{name}: {title}", fontsize=9)
        ax.set_ylabel("requests")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("send time (s, model time)")
    fig.tight_layout()
    fig.savefig(out_dir / "requests_per_replica.png", dpi=110)
    plt.close(fig)
    files.append("requests_per_replica.png")

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ratios = [summaries[name]["cache_hit_ratio"] for name in names]
    bars = ax.bar(names, ratios, color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in ratios])
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("cache-hit ratio")
    ax.set_ylim(0, max(ratios + [0.1]) * 1.2)
    fig.tight_layout()
    fig.savefig(out_dir / "cache_hit.png", dpi=110)
    plt.close(fig)
    files.append("cache_hit.png")
    return files


def write_report(
    out_dir: Path,
    summaries: Mapping[str, Mapping[str, Any]],
    records: Mapping[str, Sequence[RequestRecord]],
    *,
    workload: str,
    fleet: str,
    seed: int,
    mode: str,
    command: str,
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(records, summaries, out_dir)
    lines = [
        "# Routing policy comparison",
        "",
        f"- Workload: {workload}",
        f"- Fleet: {fleet}",
        f"- Mode: {mode}",
        f"- Seed: {seed}",
        f"- Reproduce: `{command}`",
        "",
        "Times are model time in milliseconds (a live run against sped-up replicas is scaled back). "
        "Cache hit is cached over prompt tokens, as the replicas reported them; max/min is the "
        "busiest replica's request count over the idlest's.",
        "",
        table(summaries),
    ]
    spread = spread_lines(summaries)
    if spread:
        lines += spread + [""]
    models = by_model(summaries)
    if models:
        lines += models + [""]
    baseline = against_baseline(summaries)
    if baseline:
        lines += baseline + [""]
    cpu = router_cpu(summaries)
    if cpu:
        lines += cpu + [""]
    limit = against_ideal(summaries)
    if limit:
        lines += limit + [""]
    if plots:
        lines += [f"![{name}]({name})" for name in plots]
    else:
        lines.append("Plots skipped: install matplotlib (`pip install 'kvlb[loadtest]'`).")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
