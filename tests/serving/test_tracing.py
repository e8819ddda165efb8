"""OpenTelemetry traces through real sockets: kvlb exports its spans over OTLP/HTTP to a small
receiver on 127.0.0.1, under the client's `traceparent`, and passes its own to the replica."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import make_settings, run_balancer, serve_app

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def otlp_receiver(spans: list) -> web.Application:
    async def export(request: web.Request) -> web.Response:
        message = trace_service.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
        return web.Response(body=trace_service.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    return app


def upstream(seen: list[dict]) -> web.Application:
    """Answers completions, noting the trace headers each attempt brought."""
    async def complete(request: web.Request) -> web.Response:
        seen.append({"traceparent": request.headers.get("traceparent")})
        return web.json_response({"id": "x", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    return app


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = next(getattr(value, f) for f in ("string_value", "int_value", "double_value", "bool_value")
                           if value.HasField(f))
    return out


async def test_a_request_is_one_span_with_its_decision_and_attempts_under_the_clients_trace() -> None:
    spans: list = []
    seen: list[dict] = []
    async with AsyncExitStack() as stack:
        collector = await stack.enter_async_context(serve_app(otlp_receiver(spans)))
        replica = await stack.enter_async_context(serve_app(upstream(seen)))
        settings = make_settings([{"url": replica, "name": "r0", "model": "m"}],
                                 policy={"name": "cache_aware"},
                                 tracing={"otlp_endpoint": collector + "/v1/traces", "export_interval_s": 0.1})
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            body = {"model": "m", "prompt": "say hello to the tracing test", "max_tokens": 1}
            async with http.post(running.url + "/v1/completions", json=body,
                                 headers={"traceparent": traceparent}) as resp:
                assert resp.status == 200
        for _ in range(100):
            if len(spans) >= 3:
                break
            await asyncio.sleep(0.05)
    by_name = {span.name: span for span in spans}
    assert set(by_name) == {"kvlb.request", "kvlb.route", "kvlb.attempt"}, [s.name for s in spans]
    root, route, attempt = by_name["kvlb.request"], by_name["kvlb.route"], by_name["kvlb.attempt"]
    # Under the client's trace and span; the decision and the attempt under kvlb's own.
    assert all(span.trace_id.hex() == CLIENT_TRACE for span in spans)
    assert root.parent_span_id.hex() == CLIENT_SPAN
    assert route.parent_span_id == attempt.parent_span_id == root.span_id
    assert attributes(root)["http.response.status_code"] == 200 and attributes(root)["kvlb.replica"] == "r0"
    decision = attributes(route)
    assert decision["kvlb.chosen"] == "r0" and decision["kvlb.candidates"] == 1
    assert "kvlb.predicted_cached_tokens" in decision and "kvlb.term.cost" in decision
    assert attributes(attempt)["kvlb.replica"] == "r0" and attributes(attempt)["kvlb.outcome"] == "http_200"
    assert [event.name for event in attempt.events] == ["first_byte"]
    # The replica was handed the attempt's own context.
    assert seen == [{"traceparent": f"00-{CLIENT_TRACE}-{attempt.span_id.hex()}-01"}]


async def test_without_an_endpoint_nothing_is_traced_and_no_header_is_added() -> None:
    seen: list[dict] = []
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(upstream(seen)))
        running = await stack.enter_async_context(run_balancer(make_settings([{"url": replica, "model": "m"}])))
        assert running.balancer.tracing is None
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "p", "max_tokens": 1}
            async with http.post(running.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
    assert seen == [{"traceparent": None}]
