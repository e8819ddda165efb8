"""Flow control's figures from a run's records: per tenant or class, what was served, how
fast, what was refused and why, and how many met their time-to-first-token target."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from loadtest.client.summary import RequestRecord, percentile


@dataclass(frozen=True, slots=True)
class GroupFigures:
    requests: int
    served: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    queued_p99_s: float | None  # offline only: a live client does not see kvlb's queue
    refused: Mapping[str, int] = field(default_factory=dict)  # by reason
    met: int = 0  # served within its target
    with_target: int = 0


def group_figures(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str | None],
                  targets: Mapping[str, float]) -> dict[str, GroupFigures]:
    """`targets`: the TTFT target (s) of each class, for requests whose record names none."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(key(record) or "-", []).append(record)
    out = {}
    for name in sorted(groups):
        rows = groups[name]
        served = [r for r in rows if r.ok]
        ttfts = sorted(r.ttft_s for r in served if r.ttft_s is not None)
        queued = sorted(r.queued_s for r in rows if r.queued_s is not None)
        refused = Counter(r.reject_reason or f"http {r.status}" for r in rows if not r.ok)
        with_target = [r for r in rows if target_of(r, targets) is not None]
        met = sum(1 for r in with_target if within_target(r, targets))
        out[name] = GroupFigures(len(rows), len(served), percentile(ttfts, 50), percentile(ttfts, 99),
                                 percentile(queued, 99) if queued else None, dict(refused), met, len(with_target))
    return out


def target_of(record: RequestRecord, targets: Mapping[str, float]) -> float | None:
    if record.ttft_slo_s is not None:
        return record.ttft_slo_s
    return targets.get(record.priority or "")


def within_target(record: RequestRecord, targets: Mapping[str, float]) -> bool:
    target = target_of(record, targets)
    return record.ok and record.ttft_s is not None and (target is None or record.ttft_s <= target)


def goodput_per_s(records: Sequence[RequestRecord], targets: Mapping[str, float], duration_s: float) -> float:
    """Requests a second that were served within their class's target (served at all, for a
    class without one)."""
    return sum(1 for r in records if within_target(r, targets)) / max(duration_s, 1e-9)


def span_s(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last arrival: the window goodput is counted over."""
    sends = [r.send_s for r in records]
    return max(sends) - min(sends) if sends else 0.0


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def figures_table(runs: Mapping[str, Mapping[str, GroupFigures]], what: str) -> list[str]:
    lines = [f"| run | {what} | requests | served | TTFT p50 | TTFT p99 | queued p99 | met target | refused |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for run, groups in runs.items():
        for name, g in groups.items():
            refused = ", ".join(f"{reason} {count}" for reason, count in sorted(g.refused.items())) or "-"
            met = f"{g.met / g.with_target:.1%} of {g.with_target}" if g.with_target else "-"
            lines.append(f"| {run} | {name} | {g.requests} | {g.served} | {ms(g.ttft_p50_s)} | {ms(g.ttft_p99_s)} "
                         f"| {ms(g.queued_p99_s)} | {met} | {refused} |")
    return lines
