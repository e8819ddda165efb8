from __future__ import annotations

import json

import orjson
import pytest

from loadtest.client.summary import (
    RequestRecord,
    format_summary,
    percentile,
    summarize,
    write_results,
)

SUMMARY_KEYS = {
    "requests", "errors", "error_kinds", "duration_s", "throughput", "ttft_s", "tpot_s", "e2e_s",
    "prompt_tokens", "cached_tokens", "output_tokens", "cache_hit_ratio", "requests_per_replica",
    "replica_max_min_ratio",
}  # fmt: skip


def record(index: int, **fields) -> RequestRecord:
    values = dict(
        index=index, send_s=index * 0.1, status=200, error=None, replica="r0", session=None,
        prompt_tokens=100, cached_tokens=0, output_tokens=10, ttft_s=0.1, e2e_s=1.0,
        tpot_s=0.1, itl_s=[],
    )  # fmt: skip
    values.update(fields)
    return RequestRecord(**values)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 50) == 5.0
    assert percentile(values, 90) == 9.0
    assert percentile(values, 99) == 10.0
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summary_statistics_over_successes():
    records = [
        record(i, ttft_s=float(i + 1), tpot_s=0.01 * (i + 1), e2e_s=10.0 + i) for i in range(10)
    ]
    summary = summarize(records, duration_s=5.0)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["requests"] == 10 and summary["errors"] == 0 and summary["error_kinds"] == {}
    assert summary["ttft_s"] == {"mean": 5.5, "p50": 5.0, "p90": 9.0, "p99": 10.0}
    assert summary["tpot_s"] == {"p50": pytest.approx(0.05), "p99": pytest.approx(0.10)}
    assert summary["e2e_s"] == {"p50": 14.0, "p99": 19.0}
    assert summary["throughput"] == {"requests_per_s": 2.0, "output_tokens_per_s": 20.0}
    assert summary["prompt_tokens"] == 1000 and summary["output_tokens"] == 100


def test_errors_are_counted_but_left_out_of_throughput_and_cache_ratio():
    records = [
        record(0, prompt_tokens=100, cached_tokens=50, replica="a"),
        record(1, prompt_tokens=100, cached_tokens=0, replica="b"),
        # Failures: an HTTP error, no answer at all, and a 200 whose stream broke.
        record(
            2, status=503, error="overloaded", prompt_tokens=1000, cached_tokens=1000, replica="a"
        ),
        record(3, status=0, error="connect error (ConnectionRefusedError)", replica=None),
        record(4, status=200, error="connection lost", prompt_tokens=500, cached_tokens=500),
        record(5, status=500, error=None, ttft_s=99.0),  # a status alone makes it an error
    ]
    summary = summarize(records, duration_s=2.0)
    assert summary["requests"] == 6
    assert summary["errors"] == 4
    assert summary["error_kinds"] == {
        "overloaded": 1, "connect error (ConnectionRefusedError)": 1, "connection lost": 1,
        "HTTP 500": 1,
    }  # fmt: skip
    assert summary["throughput"]["requests_per_s"] == 1.0
    assert summary["throughput"]["output_tokens_per_s"] == 10.0
    assert summary["prompt_tokens"] == 200 and summary["cached_tokens"] == 50
    assert summary["cache_hit_ratio"] == 0.25
    assert summary["ttft_s"]["p99"] == 0.1
    assert summary["requests_per_replica"] == {"a": 1, "b": 1}
    assert summary["replica_max_min_ratio"] == 1.0


def test_nothing_succeeded():
    summary = summarize([record(0, status=503, error="busy")], duration_s=0.0)
    assert summary["cache_hit_ratio"] == 0.0
    assert summary["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summary["throughput"] == {"requests_per_s": 0.0, "output_tokens_per_s": 0.0}
    assert summary["requests_per_replica"] == {}
    assert summary["replica_max_min_ratio"] is None
    assert summarize([], duration_s=1.0)["requests"] == 0


def test_every_named_replica_appears_and_an_idle_one_makes_the_ratio_null():
    records = [record(0, replica="a"), record(1, replica="a"), record(2, replica="b")]
    summary = summarize(records, 1.0, replicas=["a", "b", "c"])
    assert summary["requests_per_replica"] == {"a": 2, "b": 1, "c": 0}
    assert summary["replica_max_min_ratio"] is None
    assert summarize(records, 1.0, replicas=["a", "b"])["replica_max_min_ratio"] == 2.0


def test_meta_is_merged_at_top_level_without_replacing_statistics():
    meta = {"workload": "shared-prefix", "seed": 3, "time_scale": 10.0, "requests": "not this"}
    summary = summarize([record(0)], 1.0, meta=meta)
    assert summary["workload"] == "shared-prefix" and summary["seed"] == 3
    assert summary["time_scale"] == 10.0
    assert summary["requests"] == 1


def test_write_results_round_trip(tmp_path):
    records = [
        record(0, itl_s=[0.01, 0.02], session="group-1"),
        record(1, status=0, error="timeout after 5 s", ttft_s=None, e2e_s=None, tpot_s=None),
    ]
    summary = summarize(records, 1.5, replicas=["r0"], meta={"policy": "cache_aware"})
    out = tmp_path / "run" / "one"
    write_results(out, records, summary)

    lines = (out / "requests.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line) for line in lines] == [r.to_json() for r in records]
    assert [RequestRecord.from_json(orjson.loads(line)) for line in lines] == records
    text = (out / "summary.json").read_text()
    assert "\n  " in text  # indented for people
    assert json.loads(text) == summary


def test_format_summary_for_people():
    records = [record(0, replica="a"), record(1, status=503, error="busy", replica="b")]
    text = format_summary(summarize(records, 2.0, replicas=["a", "b"], meta={"time_scale": 10}))
    assert "2 requests, 1 errors (1x busy), 2.00 s model time (time scale 10)" in text
    assert "TTFT p50 100.0 ms" in text and "cache hit ratio 0.000" in text
    assert "per replica: a=1, b=0" in text
    assert "time scale" not in format_summary(summarize([], 1.0))


def test_errors_that_differ_only_in_their_numbers_are_one_kind():
    # An engine's refusal names each request's own lengths; a report of ten kinds of one
    # request each would hide that every error is the same one.
    refusals = [f"{p} prompt tokens plus {o} output tokens exceed the limit of 131072 tokens"
                for p, o in ((134773, 382), (191374, 7), (191373, 10))]
    records = [record(i, status=400, error=text) for i, text in enumerate(refusals)]
    records += [record(3, status=503, error=None), record(4, status=429, error=None),
                record(5, status=503, error=None), record(6, status=0, error="timeout after 30 s")]
    summary = summarize(records, duration_s=1.0)
    assert summary["error_kinds"] == {
        "N prompt tokens plus N output tokens exceed the limit of 131072 tokens": 3,
        "HTTP 503": 2, "HTTP 429": 1, "timeout after 30 s": 1,
    }  # fmt: skip
