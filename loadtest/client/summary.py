"""Per-request records and the summary statistics of one run.

Shared by the live load client (`loadtest.client.runner`) and the offline fleet simulator, so a live
run and a simulated one produce the same `requests.jsonl` and `summary.json`. All times are
model time: a live run against a replica sped up by its time scale reports what the modelled
GPUs would have taken.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson


@dataclass(slots=True)
class RequestRecord:
    index: int
    send_s: float
    status: int
    error: str | None
    replica: str | None
    session: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itl_s: list[float] = field(default_factory=list)
    # The routing's predicted hit on the replica that served it, in the replica's tokens;
    # None where nothing was predicted (a policy blind to the prompt, a live run).
    predicted_cached_tokens: int | None = None
    # Its TTFT on an ideal fleet (loadtest/simulator/ideal.py), where the run knows the fleet.
    ideal_ttft_s: float | None = None
    # Flow control: who it was for, its class and target, its wait, why it was refused.
    tenant: str | None = None
    priority: str | None = None
    ttft_slo_s: float | None = None
    queued_s: float | None = None
    reject_reason: str | None = None
    # The model its workload named (`model=`), None where it named none.
    model: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestRecord:
        values = {name: data[name] for name in _FIELDS if name in data}
        values["itl_s"] = list(values.get("itl_s") or ())
        return cls(**values)


_FIELDS = tuple(f.name for f in fields(RequestRecord))
# Runs by name (a policy, another router): each one's summary and records.
Results = dict[str, tuple[dict[str, Any], list[RequestRecord]]]


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _present(values: Iterable[float | None]) -> list[float]:
    return sorted(v for v in values if v is not None)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    replicas: Sequence[str] = (),
    meta: Mapping[str, Any] | None = None,
    block_size: int = 16,
) -> dict[str, Any]:
    """`block_size` is the engines' KV block in tokens: a prediction off by less than one
    block is as right as a block-granular cache lets it be."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    error_kinds = error_kinds_of([r.error or f"HTTP {r.status}" for r in errors])

    ttft = _present(r.ttft_s for r in ok)
    tpot = _present(r.tpot_s for r in ok)
    e2e = _present(r.e2e_s for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    predicted = [r for r in ok if r.predicted_cached_tokens is not None]
    within_block = sum(abs(r.predicted_cached_tokens - r.cached_tokens) <= block_size for r in predicted)  # type: ignore[operator]

    per_replica: dict[str, int] = dict.fromkeys(replicas, 0)
    for r in ok:
        if r.replica is not None:
            per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    counts = list(per_replica.values())
    ratio = max(counts) / min(counts) if counts and min(counts) > 0 else None

    def rate(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    with_ideal = [r for r in ok if r.ideal_ttft_s is not None and r.ttft_s is not None]
    ideal = sorted(r.ideal_ttft_s for r in with_ideal)  # type: ignore[type-var]
    against = sorted(r.ttft_s for r in with_ideal)  # type: ignore[type-var]

    summary: dict[str, Any] = {
        "requests": len(records),
        "errors": len(errors),
        "error_kinds": dict(error_kinds.most_common()),
        "duration_s": duration_s,
        "throughput": {"requests_per_s": rate(len(ok)), "output_tokens_per_s": rate(output)},
        "ttft_s": {
            "mean": sum(ttft) / len(ttft) if ttft else None,
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
            "p99": percentile(ttft, 99),
        },
        "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        "e2e_s": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "predicted_within_one_block": within_block / len(predicted) if predicted else None,
        "requests_per_replica": dict(sorted(per_replica.items())),
        "replica_max_min_ratio": ratio,
        "ideal_ttft_s": _ideal(ideal),
        "ttft_over_ideal": _over(against, ideal),
    }
    models = sorted({r.model for r in records if r.model is not None})
    if len(models) > 1:
        summary["by_model"] = {model: _model_summary([r for r in records if r.model == model], duration_s)
                               for model in models}
    # The statistics keep their meaning whatever a caller passes along with them.
    for key, value in (meta or {}).items():
        summary.setdefault(key, value)
    return summary


def _model_summary(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """One model's share of a run with several behind one endpoint: a few of the figures
    `summarize` gives for its records alone."""
    whole = summarize(records, duration_s)
    return {
        "requests": whole["requests"],
        "errors": whole["errors"],
        "cache_hit_ratio": whole["cache_hit_ratio"],
        "ttft_s": {"p50": whole["ttft_s"]["p50"], "p99": whole["ttft_s"]["p99"]},
        "e2e_s": whole["e2e_s"],
    }


# A number in an error's text, unless it is the status of "HTTP 503".
_NUMBER = re.compile(r"(?<!HTTP )(?<![\w.])(\d+(?:\.\d+)?)(?![\w.])")


def error_kinds_of(texts: Sequence[str]) -> Counter[str]:
    """Errors counted by kind: texts that differ only in their numbers are one kind (an
    engine names each request's own lengths: "134773 prompt tokens ... exceed the limit of
    131072"), named by their text with each number that differs among them as N."""
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for text in texts:
        parts = _NUMBER.split(text)  # words, number, words, number, ..., words
        groups.setdefault(tuple(parts[0::2]), []).append(parts[1::2])
    kinds: Counter[str] = Counter()
    for words, numbers in groups.items():
        first = numbers[0]
        shown = [n if all(other[i] == n for other in numbers) else "N" for i, n in enumerate(first)]
        kinds["".join(w + (shown[i] if i < len(shown) else "") for i, w in enumerate(words))] = len(numbers)
    return kinds


def error_digest(summary: Mapping[str, Any]) -> str:
    """The commonest error kinds, for a one-line message."""
    return "; ".join(f"{n}x {kind}" for kind, n in list(summary["error_kinds"].items())[:3])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def format_summary(summary: Mapping[str, Any]) -> str:
    """A few lines for people: counts, latency percentiles, cache hits, spread."""
    ttft, tpot = summary["ttft_s"], summary["tpot_s"]
    errors = summary["errors"]
    lines = [
        f"{summary['requests']} requests, {errors} errors"
        + (f" ({error_digest(summary)})" if errors else "")
        + f", {summary['duration_s']:.2f} s model time"
        + (f" (time scale {scale:g})" if (scale := summary.get("time_scale")) else ""),
        f"TTFT p50 {_ms(ttft['p50'])}, p99 {_ms(ttft['p99'])}; TPOT p50 {_ms(tpot['p50'])}; "
        f"cache hit ratio {summary['cache_hit_ratio']:.3f}",
    ]
    per_replica = summary["requests_per_replica"]
    if per_replica:
        lines.append("per replica: " + ", ".join(f"{k}={v}" for k, v in per_replica.items()))
    lines.extend(model_lines(summary))
    return "\n".join(lines)


def model_lines(summary: Mapping[str, Any]) -> list[str]:
    """A line per model, for a run with several behind one endpoint."""
    return [
        f"  {model}: {m['requests']} requests, {m['errors']} errors, cache hit {m['cache_hit_ratio']:.3f}, "
        f"TTFT p50 {_ms(m['ttft_s']['p50'])} p99 {_ms(m['ttft_s']['p99'])}, "
        f"E2E p50 {_ms(m['e2e_s']['p50'])} p99 {_ms(m['e2e_s']['p99'])}"
        for model, m in (summary.get("by_model") or {}).items()
    ]


def write_results(
    out_dir: Path, records: Iterable[RequestRecord], summary: Mapping[str, Any]
) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "wb") as f:
        for record in records:
            f.write(orjson.dumps(record.to_json()) + b"\n")
    (out_dir / "summary.json").write_bytes(
        orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n"
    )


def with_replica_counts(summary: dict[str, Any], counts: Mapping[str, int], source: str) -> dict[str, Any]:
    """Requests per replica from elsewhere (the replicas' own counters), for a target that
    does not say which replica served each request."""
    summary["requests_per_replica"] = dict(sorted(counts.items()))
    values = list(counts.values())
    summary["replica_max_min_ratio"] = max(values) / min(values) if values and min(values) > 0 else None
    summary["requests_per_replica_source"] = source
    return summary


def _ideal(ideal: Sequence[float]) -> dict[str, float | None] | None:
    if not ideal:
        return None
    return {"mean": sum(ideal) / len(ideal), "p50": percentile(ideal, 50), "p99": percentile(ideal, 99)}


def _over(ttft: Sequence[float], ideal: Sequence[float]) -> dict[str, float | None] | None:
    """Mean and p99 TTFT of the requests with an ideal, over the ideal's mean and p99."""
    if not ideal:
        return None
    mean_ideal, p99_ideal = sum(ideal) / len(ideal), percentile(ideal, 99)
    return {
        "mean": (sum(ttft) / len(ttft)) / mean_ideal if mean_ideal else None,
        "p99": percentile(ttft, 99) / p99_ideal if p99_ideal else None,  # type: ignore[operator]
    }
