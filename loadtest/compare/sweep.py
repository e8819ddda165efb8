"""Load sweeps: the same comparison at several loads, and the highest load at which each
policy still meets a latency target (goodput).

`kvlb compare --sweep speedup=1,2,4` runs the whole comparison once per value of one workload
key (`speedup` or `rate`, or any other key the workload takes), each into `DIR/<key>-<value>/`
with its own report. It then writes `DIR/sweep.md` and `DIR/sweep.png`: per policy and load,
the cache hit, TTFT p50 and p99, end-to-end p50 and goodput.

Goodput is the rate of requests that met the SLO: a first token within `--slo-ttft-ms` and,
when given, a time per output token within `--slo-tpot-ms`. A request that failed met
nothing. A load meets the SLO when at least `--slo-attainment` of its requests did (default
0.99). The highest swept load that meets it is the policy's capacity under that SLO.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.client.summary import RequestRecord, Results


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float | None = None
    attainment: float = 0.99

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or record.tpot_s is None or record.tpot_s <= self.tpot_s

    def describe(self) -> str:
        parts = [f"TTFT <= {self.ttft_s * 1000:g} ms"]
        if self.tpot_s is not None:
            parts.append(f"TPOT <= {self.tpot_s * 1000:g} ms")
        return " and ".join(parts) + f" for at least {self.attainment:.0%} of requests"


@dataclass(frozen=True, slots=True)
class Point:
    """One policy at one load."""

    level: str
    cache_hit: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    attained: float  # the fraction of requests that met the SLO
    goodput_per_s: float


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """`KEY=V1,V2,...` into the key and its values, in the order given."""
    key, equals, values = text.partition("=")
    levels = [v.strip() for v in values.split(",") if v.strip()]
    if not equals or not key.strip() or not levels:
        raise ValueError(f"--sweep {text!r}: expected KEY=V1,V2,... (for example speedup=1,2,4)")
    return key.strip(), levels


def with_option(spec: str, key: str, value: str) -> str:
    """`spec` with `key` set to `value`, replacing the key where the spec gives it."""
    head, *items = [part.strip() for part in spec.split(",")]
    kept = [item for item in items if item.partition("=")[0].strip() != key]
    return ",".join([head, *kept, f"{key}={value}"])


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> tuple[float, float]:
    """(the fraction of requests that met the SLO, those requests per second)."""
    met = sum(slo.met_by(r) for r in records)
    return (met / len(records) if records else 0.0), (met / duration_s if duration_s > 0 else 0.0)


def point(level: str, summary: Mapping[str, Any], records: Sequence[RequestRecord], slo: Slo) -> Point:
    attained, per_s = goodput(records, summary["duration_s"], slo)
    return Point(
        level=level,
        cache_hit=summary["cache_hit_ratio"],
        ttft_p50_s=summary["ttft_s"]["p50"],
        ttft_p99_s=summary["ttft_s"]["p99"],
        e2e_p50_s=summary["e2e_s"]["p50"],
        attained=attained,
        goodput_per_s=per_s,
    )


def run_sweep(
    workload_spec: str, key: str, levels: Sequence[str], slo: Slo, out_dir: Path,
    compare_one: Callable[[str, Path], Results],
) -> dict[str, list[Point]]:
    """`compare_one(spec, out_dir)` runs one level's comparison; returns each policy's points."""
    curves: dict[str, list[Point]] = {}
    for level in levels:
        results = compare_one(with_option(workload_spec, key, level), out_dir / f"{key}-{level}")
        for name, (summary, records) in results.items():
            curves.setdefault(name, []).append(point(level, summary, records, slo))
    return curves


def capacity(points: Sequence[Point], slo: Slo) -> str | None:
    """The highest swept load (in the order swept) that met the SLO; None if none did.
    Loads after the first miss do not count: a policy that recovers at a higher load has
    been lucky, not fast."""
    best = None
    for p in points:
        if p.attained < slo.attainment:
            break
        best = p.level
    return best


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.0f}"


def write_sweep_report(out_dir: Path, curves: Mapping[str, Sequence[Point]], *, key: str, slo: Slo,
                       workload: str, fleet: str, command: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Load sweep",
        "",
        f"- Workload: `{workload}`, swept over `{key}`",
        f"- Fleet: {fleet}",
        f"- SLO: {slo.describe()}",
        f"- Reproduce: `{command}`",
        "",
        "Times in ms of model time. Goodput: requests per second that met the SLO. The run writes "
        f"each load's full report beside this one, in `{key}-<value>/report.md`.",
        "",
        "| policy | highest load meeting the SLO |",
        "|---|---:|",
    ]
    for name, points in curves.items():
        lines.append(f"| {name} | {capacity(points, slo) or 'none swept'} |")
    lines += ["", f"| policy | {key} | cache hit | TTFT p50 | TTFT p99 | E2E p50 | met SLO | goodput req/s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, points in curves.items():
        for p in points:
            lines.append(
                f"| {name} | {p.level} | {p.cache_hit:.3f} | {_ms(p.ttft_p50_s)} | {_ms(p.ttft_p99_s)} "
                f"| {_ms(p.e2e_p50_s)} | {p.attained:.1%} | {p.goodput_per_s:,.2f} |"
            )
    if _plot(out_dir / "sweep.png", curves, key, slo):
        lines += ["", "![sweep](sweep.png)"]
    path = out_dir / "sweep.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(path: Path, curves: Mapping[str, Sequence[Point]], key: str, slo: Slo) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, points in curves.items():
        x = [float(p.level) if _is_number(p.level) else i for i, p in enumerate(points)]
        axes[0].plot(x, [(p.ttft_p99_s or 0) * 1000 for p in points], marker="o", label=name)
        axes[1].plot(x, [p.cache_hit for p in points], marker="o", label=name)
        axes[2].plot(x, [p.goodput_per_s for p in points], marker="o", label=name)
    axes[0].axhline(slo.ttft_s * 1000, color="grey", linestyle="--", linewidth=1)
    axes[0].set_yscale("log")
    for ax, title in zip(axes, ("TTFT p99 (ms, log)", "cache hit", "goodput (req/s)"), strict=True):
        ax.set_xlabel(key)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
