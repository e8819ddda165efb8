"""/metrics tells an operator what each replica served, how it went, and what is in flight."""

from __future__ import annotations

import asyncio
import gc
from contextlib import AsyncExitStack

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, hanging_app


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_requests_by_route_replica_status_and_in_flight() -> None:
    hung = Seen()
    async with AsyncExitStack() as stack:
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        slow = await stack.enter_async_context(serve_app(hanging_app(hung)))
        dead = f"http://127.0.0.1:{free_port()}"
        settings = make_settings([
            {"url": good, "name": "good", "model": "stub-model"},
            {"url": slow, "name": "slow", "model": "slow-model"},
            {"url": dead, "name": "dead", "model": "dead-model"},
        ])
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(running.url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}) as r:
                    assert r.status == 200
            async with http.post(running.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
                assert r.status == 404
            async with http.post(running.url + "/v1/completions", json={"model": "dead-model", "prompt": "x"}) as r:
                assert r.status == 502
            pending = asyncio.create_task(
                http.post(running.url + "/v1/chat/completions", json={"model": "slow-model", "messages": []})
            )
            while hung.requests == 0:
                await asyncio.sleep(0.01)
            samples = await scrape(running.url)
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)

    def requests(model: str, replica: str, status: str, route: str = "/v1/completions") -> float:
        labels = (("model", model), ("replica", replica), ("route", route), ("status", status))
        return samples[("kvlb_requests_total", labels)]

    assert requests("stub-model", "good", "200") == 3
    assert requests("other", "none", "404") == 1  # a model nobody serves stays out of the labels
    assert requests("dead-model", "dead", "502") == 1
    assert samples[("kvlb_request_duration_seconds_count", (("route", "/v1/completions"),))] == 5
    assert samples[("kvlb_in_flight_requests", (("replica", "slow"),))] == 1
    assert samples[("kvlb_in_flight_requests", (("replica", "good"),))] == 0
    assert samples[("kvlb_upstream_attempts_total", (("outcome", "connect_error"), ("replica", "dead")))] == 1
    assert samples[("kvlb_replica_healthy", (("replica", "good"),))] == 1


async def test_garbage_collector_pauses_and_what_they_freed_by_generation() -> None:
    """A full collection stops every request in flight; /metrics shows how long, and how
    much cyclic garbage it freed, so an operator can tell such stalls from slow replicas."""
    callbacks_before = len(gc.callbacks)
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(make_stub_app("good")))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        before = await scrape(running.url)
        cycles = []
        for _ in range(1000):
            pair: list = []
            pair.append(pair)  # garbage only the cyclic collector can free
            cycles.append(pair)
        del cycles, pair
        gc.collect()
        after = await scrape(running.url)
    full = (("generation", "2"),)
    assert after[("kvlb_gc_pause_seconds_count", full)] >= before[("kvlb_gc_pause_seconds_count", full)] + 1
    assert after[("kvlb_gc_pause_seconds_sum", full)] > before[("kvlb_gc_pause_seconds_sum", full)]
    assert (after[("kvlb_gc_collected_objects_total", full)]
            >= before[("kvlb_gc_collected_objects_total", full)] + 1000)
    assert len(gc.callbacks) == callbacks_before  # a stopped balancer leaves the collector alone
