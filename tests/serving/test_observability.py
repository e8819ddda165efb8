"""What an operator sees: the kvlb_* metrics after real requests, the access line in text and
JSON, the debug line of each routing decision, and the Grafana dashboard against a live
/metrics page."""

from __future__ import annotations

import json
import logging
import re
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from balancer.logs import LOG_FIELDS, JsonFormatter
from balancer.routing.index import PrefixIndex
from balancer.serving.metrics import INDEX_BYTES_PER_ENTRY
from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, slow_sse_app

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana" / "kvlb.json"
# Exported by balancer/watchers/sync.py only while sync is on, so a plain kvlb's /metrics lacks them.
SYNC_METRICS = {
    "kvlb_sync_connected", "kvlb_sync_peers", "kvlb_sync_lag_seconds_bucket",
    "kvlb_sync_events_published_total", "kvlb_sync_events_applied_total", "kvlb_sync_errors_total",
}
SYNC_OPTIONAL = {"kvlb_sync_events_dropped_total"}
LONG_PROMPT = "You are a careful assistant. " * 70  # ~2,000 characters: ~31 blocks of 64


async def scrape_text(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


def samples_of(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> int:
    async with http.post(url, json=body) as resp:
        await resp.read()
        return resp.status


async def test_ttft_decision_time_failovers_and_model_label() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with AsyncExitStack() as stack:
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        sse = await stack.enter_async_context(serve_app(slow_sse_app(Seen(), chunks=2, gap_s=0.15)))
        settings = make_settings(
            [{"url": dead, "name": "dead", "model": "stub-model"},
             {"url": good, "name": "good", "model": "stub-model"},
             {"url": sse, "name": "sse", "model": "sse-model"}],
            policy={"name": "round_robin"},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            for _ in range(4):  # round robin ranks the dead replica first every other time
                assert await post(http, running.url + "/v1/completions",
                                  {"model": "stub-model", "prompt": "x", "max_tokens": 2}) == 200
            assert await post(http, running.url + "/v1/chat/completions",
                              {"model": "sse-model", "messages": [], "stream": True}) == 200
        samples = samples_of(await scrape_text(running.url))

    completions = (("route", "/v1/completions"),)
    chat = (("route", "/v1/chat/completions"),)
    assert samples[("kvlb_requests_total", (("model", "stub-model"), ("replica", "good"), *completions,
                                            ("status", "200")))] == 4
    assert samples[("kvlb_requests_total", (("model", "sse-model"), ("replica", "sse"), *chat,
                                            ("status", "200")))] == 1
    # Two of four were answered by their second choice, each after one connect error.
    assert samples[("kvlb_failovers_total", completions)] == 2
    assert samples[("kvlb_upstream_attempts_total", (("outcome", "connect_error"), ("replica", "dead")))] == 2
    assert ("kvlb_failovers_total", chat) not in samples
    # TTFT per route and replica: the stream's first event came at once, its end 0.3 s later.
    assert samples[("kvlb_time_to_first_token_seconds_count", (("replica", "good"), *completions))] == 4
    assert samples[("kvlb_time_to_first_token_seconds_count", (("replica", "sse"), *chat))] == 1
    assert samples[("kvlb_time_to_first_token_seconds_sum", (("replica", "sse"), *chat))] < 0.15
    assert samples[("kvlb_request_duration_seconds_sum", chat)] >= 0.3
    # Every routed request timed its decision, in microseconds to milliseconds.
    assert samples[("kvlb_routing_decision_seconds_count", completions)] == 4
    assert samples[("kvlb_routing_decision_seconds_count", chat)] == 1
    assert 0 < samples[("kvlb_routing_decision_seconds_sum", completions)] < 0.2
    # Without a prefix index (round robin) the index gauges are there, at zero.
    assert samples[("kvlb_prefix_index_entries", ())] == 0


async def test_prefix_index_size_evictions_and_hit_ratio_with_cache_aware() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        b = await stack.enter_async_context(serve_app(make_stub_app("b")))
        # 64 tokens of KV cache: 4 blocks of 16, so a ~31-block prompt evicts most of itself.
        settings = make_settings(
            [{"url": a, "name": "a", "kv_capacity_tokens": 64}, {"url": b, "name": "b", "kv_capacity_tokens": 64}],
            policy={"name": "cache_aware"},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            for turn in range(2):
                assert await post(http, running.url + "/v1/completions",
                                  {"model": "stub-model", "prompt": LONG_PROMPT + str(turn), "max_tokens": 2}) == 200
        samples = samples_of(await scrape_text(running.url))
        index = running.balancer.tracker.index

    entries = samples[("kvlb_prefix_index_entries", ())]
    assert 0 < entries == index.entries <= 8
    assert samples[("kvlb_prefix_index_bytes", ())] == entries * INDEX_BYTES_PER_ENTRY
    assert samples[("kvlb_prefix_index_evictions_total", (("reason", "capacity"),))] == index.evicted_capacity > 20
    assert samples[("kvlb_prefix_index_evictions_total", (("reason", "ttl"),))] == 0
    assert samples[("kvlb_prefix_index_evictions_total", (("reason", "budget"),))] == 0
    # The stub replicas report usage (0 cached): the prompt-token denominator of the hit ratio.
    prompt = sum(v for (name, _), v in samples.items() if name == "kvlb_prefix_prompt_tokens_total")
    actual = sum(v for (name, _), v in samples.items() if name == "kvlb_prefix_actual_cached_tokens_total")
    assert prompt >= 2 * 400 and actual == 0


def test_index_counts_ttl_and_budget_evictions() -> None:
    now = [0.0]
    index = PrefixIndex(tokens_per_block=16, ttl_s=10, max_entries=5, clock=lambda: now[0])
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2, 3])  # 6 entries over a budget of 5: one goes
    assert (index.evicted_budget, index.evicted_ttl, index.evicted_capacity) == (1, 0, 0)
    now[0] = 11.0
    index.match([1])  # everything has outlived its TTL
    assert index.evicted_ttl == 5 and index.entries == 0
    index.record("a", [7, 8])
    index.remove_replica("a")  # forgetting a replica is not an eviction
    assert (index.evicted_budget, index.evicted_ttl, index.evicted_capacity) == (1, 5, 0)


async def test_access_line_in_text_and_json_and_debug_decision_line(caplog: pytest.LogCaptureFixture) -> None:
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(make_stub_app("a")))
        settings = make_settings([{"url": replica, "name": "a", "model": "stub-model"}],
                                 logging={"access_log": True})
        running = await stack.enter_async_context(run_balancer(settings))
        caplog.set_level(logging.INFO, logger="kvlb.access")
        caplog.set_level(logging.DEBUG, logger="kvlb.server")
        async with aiohttp.ClientSession() as http:
            url = running.url
            assert await post(http, url + "/v1/completions",
                              {"model": "stub-model", "prompt": "one two three", "max_tokens": 3}) == 200
            assert await post(http, url + "/v1/chat/completions",
                              {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) == 200
            assert await post(http, url + "/generate",
                              {"text": "a b c d e", "sampling_params": {"max_new_tokens": 5}}) == 200
            assert await post(http, url + "/v1/completions", {"model": "nope", "prompt": "x"}) == 404

    access = [r for r in caplog.records if r.name == "kvlb.access"]
    assert len(access) == 4
    fields = [getattr(r, LOG_FIELDS) for r in access]
    completion, chat, generate, unknown = fields
    assert completion["route"] == "/v1/completions" and completion["model"] == "stub-model"
    assert completion["replica"] == "a" and completion["status"] == 200 and completion["attempts"] == 1
    assert (completion["prompt_tokens"], completion["cached_tokens"], completion["output_tokens"]) == (3, 0, 3)
    assert 0 < completion["ttft_ms"] <= completion["duration_ms"]
    assert len(completion["request_id"]) == 24 and completion["error"] is None
    # Streamed: the counts come from the final usage chunk; /generate: from meta_info.
    assert chat["output_tokens"] == 4 and chat["cached_tokens"] == 0 and chat["prompt_tokens"] > 0
    assert (generate["model"], generate["prompt_tokens"], generate["output_tokens"]) == ("", 5, 5)
    assert unknown["status"] == 404 and unknown["error"] == "model_not_found" and unknown["model"] == "nope"
    assert unknown["ttft_ms"] is None and unknown["prompt_tokens"] is None and unknown["replica"] == "none"

    text = access[0].getMessage()
    assert re.search(r" POST /v1/completions 200 replica=a model=stub-model attempts=1 ttft=[0-9.]+ms "
                     r"duration=[0-9.]+ms prompt_tokens=3 cached_tokens=0 output_tokens=3 error=- id=\w{24}$", text)
    assert "ttft=- " in access[3].getMessage() and "error=model_not_found" in access[3].getMessage()

    entry = json.loads(JsonFormatter().format(access[0]))
    assert entry["logger"] == "kvlb.access" and entry["message"] == text
    for key, value in completion.items():
        assert entry[key] == value

    decisions = [r.getMessage() for r in caplog.records if r.name == "kvlb.server" and r.levelno == logging.DEBUG]
    assert any("/v1/completions model stub-model: chosen=a" in line for line in decisions)


def dashboard_metric_names() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return set(re.findall(r"\bkvlb_[a-z0-9_]+", "\n".join(exprs)))


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape can hold: families without samples yet count too."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_uses_the_datasource_variable_and_covers_every_section() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["__inputs"][0]["name"] == "DS_PROMETHEUS"
    assert "DS_PROMETHEUS" in {v["name"] for v in board["templating"]["list"]}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["description"] and panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    used = dashboard_metric_names()
    assert SYNC_METRICS <= used
    for name in ("kvlb_requests_total", "kvlb_time_to_first_token_seconds_bucket",
                 "kvlb_request_duration_seconds_bucket", "kvlb_routing_decision_seconds_bucket",
                 "kvlb_in_flight_requests", "kvlb_queued_prefill_tokens", "kvlb_prefix_index_entries",
                 "kvlb_prefix_index_bytes", "kvlb_prefix_index_evictions_total", "kvlb_failovers_total",
                 "kvlb_upstream_attempts_total", "kvlb_replica_healthy", "kvlb_replica_breaker_state",
                 "kvlb_prefix_predicted_cached_tokens_total", "kvlb_prefix_actual_cached_tokens_total"):
        assert name in used, name


async def test_every_dashboard_metric_is_on_a_live_metrics_page() -> None:
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(make_stub_app("a")))
        settings = make_settings([replica], policy={"name": "cache_aware"})
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            assert await post(http, running.url + "/v1/completions",
                              {"model": "stub-model", "prompt": LONG_PROMPT, "max_tokens": 2}) == 200
        exposed = exposed_names(await scrape_text(running.url))
    missing = dashboard_metric_names() - exposed - SYNC_METRICS - SYNC_OPTIONAL
    assert not missing, f"the dashboard queries metrics kvlb does not export: {sorted(missing)}"
