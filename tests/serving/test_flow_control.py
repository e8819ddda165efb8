"""Flow control through kvlb's sockets: classes, tenants, targets and refusals with reasons."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack

import aiohttp

from balancer.logs import LOG_FIELDS
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import ordered_app

MINIMAL = {
    "enabled": True,
    "trust_headers": True,
    "classes": [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"}, {"name": "batch", "sheddable": True}],
    "default_class": "standard",
}


async def post(http, url, prompt, headers=None):
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    async with http.post(url + "/v1/completions", json=body, headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def queued(running, count: int) -> None:
    flow = running.balancer.core.flow
    for _ in range(300):
        if flow.queued >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{flow.queued} queued, expected {count}")


async def start(stack, order, hold_s, flow=None, **sections):
    url = await stack.enter_async_context(serve_app(ordered_app(order, hold_s)))
    settings = make_settings([{"url": url, "name": "only", "model": "m", "max_concurrency": 1}],
                             flow_control=flow or MINIMAL, **sections)
    return await stack.enter_async_context(run_balancer(settings))


async def test_a_saturated_fleet_serves_higher_classes_first():
    order: list[str] = []
    async with AsyncExitStack() as stack:
        running = await start(stack, order, {"blocker": 0.4})
        async with aiohttp.ClientSession() as http:
            blocker = asyncio.create_task(post(http, running.url, "blocker"))
            while not order:
                await asyncio.sleep(0.01)
            waiting = []
            for n, klass in enumerate(["batch", "batch", "standard", "critical", "batch"]):
                waiting.append(asyncio.create_task(
                    post(http, running.url, f"{klass}-{n}", {"x-kvlb-priority": klass, "x-kvlb-tenant": "acme"})))
                await queued(running, n + 1)
            results = await asyncio.gather(blocker, *waiting)
    assert all(status == 200 for status, _, _ in results)
    assert order == ["blocker", "critical-3", "standard-2", "batch-0", "batch-1", "batch-4"]


async def test_a_flooding_tenant_cannot_take_the_queue_from_a_steady_one():
    order: list[str] = []
    async with AsyncExitStack() as stack:
        running = await start(stack, order, {"blocker": 0.4}, limits={"max_queued": 4})
        async with aiohttp.ClientSession() as http:
            blocker = asyncio.create_task(post(http, running.url, "blocker", {"x-kvlb-tenant": "noisy"}))
            while not order:
                await asyncio.sleep(0.01)
            noisy = [asyncio.create_task(post(http, running.url, f"noisy-{n}", {"x-kvlb-tenant": "noisy"}))
                     for n in range(4)]
            await queued(running, 4)
            # The queue is full of the noisy tenant's: its next is refused, with the reason.
            status, headers, body = await post(http, running.url, "noisy-4", {"x-kvlb-tenant": "noisy"})
            assert status == 429 and headers["x-kvlb-reject-reason"] == "queue_full"
            assert body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
            # A steady tenant still gets in: the noisy tenant's newest gives up its place.
            steady = asyncio.create_task(post(http, running.url, "steady", {"x-kvlb-tenant": "steady"}))
            results = await asyncio.gather(blocker, steady, *noisy)
    statuses = [status for status, _, _ in results]
    assert statuses[:2] == [200, 200]
    displaced = [r for r in results[2:] if r[0] == 429]
    assert len(displaced) == 1 and displaced[0][1]["x-kvlb-reject-reason"] == "displaced"
    assert order[:2] == ["blocker", "steady"]


async def test_a_request_that_cannot_meet_its_target_is_told_at_once():
    order: list[str] = []
    async with AsyncExitStack() as stack:
        running = await start(stack, order, {"blocker": 1.0})
        async with aiohttp.ClientSession() as http:
            # Some history: places free about every 50 ms.
            for n in range(6):
                assert (await post(http, running.url, f"warm-{n}"))[0] == 200
            blocker = asyncio.create_task(post(http, running.url, "blocker"))
            while "blocker" not in order:
                await asyncio.sleep(0.01)
            backlog = [asyncio.create_task(post(http, running.url, f"a-{n}", {"x-kvlb-tenant": "a"}))
                       for n in range(20)]
            await queued(running, 20)
            began = time.monotonic()
            status, headers, body = await post(http, running.url, "urgent",
                                               {"x-kvlb-tenant": "a", "x-kvlb-ttft-slo-ms": "300"})
            elapsed = time.monotonic() - began
            assert status == 429 and headers["x-kvlb-reject-reason"] == "ttft_slo_unattainable", body
            assert elapsed < 0.25 and "target" in body["error"]["message"]
            # Queued with a target it could meet at first, a request leaves once it cannot.
            began = time.monotonic()
            status, headers, _ = await post(http, running.url, "other",
                                            {"x-kvlb-tenant": "b", "x-kvlb-ttft-slo-ms": "1000000"})
            await asyncio.gather(blocker, *backlog)
    assert status == 200
    assert "urgent" not in order


async def test_a_prompt_too_long_to_prefill_within_its_target_is_told_at_once():
    """With the predictive policy the judgement is the request's own: while the replica is
    busy, a 36,000-token prompt, whose prefill alone the policy puts past its 800 ms target,
    is refused at once; a short one with the same target waits its turn and is served."""
    order: list[str] = []
    async with AsyncExitStack() as stack:
        running = await start(stack, order, {"blocker": 0.2}, policy={"name": "predictive"})
        async with aiohttp.ClientSession() as http:
            blocker = asyncio.create_task(post(http, running.url, "blocker"))
            while "blocker" not in order:
                await asyncio.sleep(0.01)
            target = {"x-kvlb-ttft-slo-ms": "800"}
            began = time.monotonic()
            status, headers, body = await post(http, running.url, "lorem ipsum " * 12000, target)
            elapsed = time.monotonic() - began
            assert status == 429 and headers["x-kvlb-reject-reason"] == "ttft_slo_unattainable", body
            assert "predicted time to first token" in body["error"]["message"] and elapsed < 0.15
            status, _, _ = await post(http, running.url, "a short one", target)
            await blocker
    assert status == 200 and order == ["blocker", "a short one"]


async def test_tenants_come_from_api_keys_and_show_in_the_log_and_metrics(caplog):
    order: list[str] = []
    auth = {"tenants": [{"name": "acme", "api_keys": ["key-acme"], "priority": "critical"},
                        {"name": "bulk", "api_keys": ["key-bulk"], "priority": "batch", "weight": 0.5}]}
    flow = dict(MINIMAL, trust_headers=False)
    async with AsyncExitStack() as stack:
        running = await start(stack, order, {}, flow=flow, auth=auth, logging={"access_log": True})
        async with aiohttp.ClientSession() as http:
            with caplog.at_level(logging.INFO, logger="kvlb.access"):
                # Untrusted headers are ignored: the key decides.
                status, _, _ = await post(http, running.url, "hello", {
                    "Authorization": "Bearer key-bulk", "x-kvlb-priority": "critical", "x-kvlb-tenant": "acme"})
                assert status == 200
                status, _, _ = await post(http, running.url, "hi", {"Authorization": "Bearer key-acme"})
                assert status == 200
            async with http.get(running.url + "/metrics", headers={"Authorization": "Bearer key-acme"}) as resp:
                metrics = await resp.text()
    fields = [getattr(r, LOG_FIELDS) for r in caplog.records if r.name == "kvlb.access"]
    seen = {(f.get("tenant"), f.get("class")) for f in fields}
    assert {("bulk", "batch"), ("acme", "critical")} <= seen, fields
    assert not any("key-" in str(f) for f in fields)
    assert 'kvlb_flow_served_requests_total{class="batch",tenant="bulk"} 1.0' in metrics
    assert 'kvlb_flow_ttft_slo_total{class="critical",met="true",tenant="acme"} 1.0' in metrics


async def test_bad_flow_headers_get_clear_errors():
    async with AsyncExitStack() as stack:
        running = await start(stack, [], {})
        async with aiohttp.ClientSession() as http:
            for headers, code in (({"x-kvlb-priority": "urgent"}, "invalid_priority"),
                                  ({"x-kvlb-ttft-slo-ms": "soon"}, "invalid_ttft_slo"),
                                  ({"x-kvlb-ttft-slo-ms": "-5"}, "invalid_ttft_slo"),
                                  ({"x-kvlb-tenant": "a b"}, "invalid_tenant")):
                status, _, body = await post(http, running.url, "x", headers)
                assert status == 400 and body["error"]["code"] == code, (headers, body)
            assert (await post(http, running.url, "fine", {"x-kvlb-priority": "batch"}))[0] == 200


async def test_a_client_that_leaves_while_waiting_gives_its_place_back():
    order: list[str] = []
    async with AsyncExitStack() as stack:
        running = await start(stack, order, {"blocker": 0.5})
        flow = running.balancer.core.flow
        async with aiohttp.ClientSession() as http:
            blocker = asyncio.create_task(post(http, running.url, "blocker"))
            while "blocker" not in order:
                await asyncio.sleep(0.01)
            leaving = asyncio.create_task(post(http, running.url, "leaving"))
            await queued(running, 1)
            leaving.cancel()  # the client closes its connection
            for _ in range(100):
                if flow.queued == 0:
                    break
                await asyncio.sleep(0.01)
            assert flow.queued == 0
            status, _, _ = await post(http, running.url, "next")
            await blocker
        assert status == 200 and "leaving" not in order
        assert flow.in_flight == 0 and flow.queued == 0


async def test_a_requests_ttft_target_reaches_the_ranking_from_its_class_or_header():
    # One replica is busy prefilling a long prompt, the other idle: a request with a 100 ms
    # target can meet it only on the idle one, and the busy one, ranked next, pays for its
    # predicted excess. A request without a target pays nothing anywhere.
    blocker = "word " * 20000
    order: list[str] = []
    flow = {**MINIMAL, "classes": [{"name": "critical", "ttft_slo_ms": 100}, {"name": "standard"}]}
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_app(ordered_app(order, {blocker: 0.6}))) for _ in range(2)]
        settings = make_settings([{"url": url, "name": f"r{n}", "model": "m"} for n, url in enumerate(urls)],
                                 flow_control=flow, routing={"route_header": True},
                                 policy={"name": "predictive", "params": {"ttft_target_weight": 10}})
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            busy = asyncio.create_task(post(http, running.url, blocker))
            while not order:
                await asyncio.sleep(0.01)
            answers = [await post(http, running.url, "a short question", headers)
                       for headers in ({"x-kvlb-ttft-slo-ms": "100"}, {"x-kvlb-priority": "critical"}, {})]
            assert (await busy)[0] == 200
    for (status, headers, _), targeted in zip(answers, (True, True, False), strict=True):
        assert status == 200
        chosen, following = headers["x-kvlb-route"].split("; next=")
        assert "target_ms=" not in chosen
        assert ("target_ms=" in following) is targeted
