"""Live runs repeated: one figure per router from several runs, and the runs beside it.

A live comparison shares the machine's cores with the replicas and the load client, so one
run's figures move by a few per cent from run to run, as much as two good routers differ.
`kvlb compare --live --repeat N` runs every router N times, alternating their order so that
a drift over the session weighs on each alike, and reports each figure's median, with every
run's own figures beside it: a difference smaller than the runs' spread is not one.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

# The figures a reader compares routers by, per run: (label, path into a summary).
SPREAD_FIGURES = (
    ("cache hit", ("cache_hit_ratio",)),
    ("TTFT p50", ("ttft_s", "p50")),
    ("TTFT p99", ("ttft_s", "p99")),
    ("E2E p50", ("e2e_s", "p50")),
    ("E2E p99", ("e2e_s", "p99")),
)


def run_order(names: Sequence[str], repeat: int) -> list[tuple[int, str]]:
    """(run number, router) in the order to run them: forwards, then backwards, and so on."""
    order: list[tuple[int, str]] = []
    for run in range(repeat):
        order += [(run, name) for name in (names if run % 2 == 0 else list(reversed(names)))]
    return order


def median_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every number the median of the runs' (recursively, in nested figures); anything else
    as the first run has it. The runs' own key figures go under `runs`."""
    merged = _median(summaries)
    merged["runs"] = [{label: _figure(s, path) for label, path in SPREAD_FIGURES} for s in summaries]
    return merged


def _median(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) for v in values):
        return {key: _median([v.get(key) for v in values]) for key in first}
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if numbers and len(numbers) == len(values):
        middle = statistics.median(numbers)
        return round(middle) if all(isinstance(v, int) for v in numbers) else middle
    return first


def _figure(summary: Mapping[str, Any], path: Sequence[str]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value if isinstance(value, int | float) else None


def spread_lines(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The runs behind each median, one row per router: each figure's runs in run order."""
    repeated = {name: s["runs"] for name, s in summaries.items() if len(s.get("runs") or ()) > 1}
    if not repeated:
        return []
    count = max(len(runs) for runs in repeated.values())
    lines = [
        f"The table's figures are medians over {count} runs per router, their order alternating "
        "from run to run. Each run's own (ms of model time):",
        "",
        "| router | " + " | ".join(label for label, _ in SPREAD_FIGURES) + " |",
        "|---|" + "---:|" * len(SPREAD_FIGURES),
    ]
    for name, runs in repeated.items():
        cells = []
        for label, _ in SPREAD_FIGURES:
            values = [run.get(label) for run in runs]
            cells.append(" / ".join(_cell(label, v) for v in values))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _cell(label: str, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if label == "cache hit" else f"{value * 1000:,.0f}"
