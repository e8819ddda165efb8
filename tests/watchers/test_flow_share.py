"""Flow control across two kvlb instances sharing a real Redis (balancer/watchers/flow_share.py):
one per-tenant bound and one fair share between them, and each on its own when Redis goes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from tests.conftest import make_settings, run_balancer, serve_app
from tests.serving.test_flow_control import MINIMAL, post, queued
from tests.upstreams import ordered_app
from tests.watchers.test_sync import until


@contextlib.asynccontextmanager
async def two_instances(redis_server, order, hold_s, **flow):
    sync = redis_server.sync_settings(load_interval_s=0.05, load_ttl_s=0.5, timeout_s=0.2)
    async with serve_app(ordered_app(order, hold_s)) as url:
        settings = make_settings([{"url": url, "name": "only", "model": "m", "max_concurrency": 1}],
                                 flow_control={**MINIMAL, **flow}, sync=sync)
        async with run_balancer(settings) as a, run_balancer(settings) as b:
            await until(lambda: a.balancer.core.flow.remote_peers == 1 and b.balancer.core.flow.remote_peers == 1)
            yield a, b


def handed(metrics: str, direction: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(f'kvlb_flow_places_handed_total{{direction="{direction}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return None


def remote_queued(running, tenant: str) -> int:
    return running.balancer.core.flow.by_name["standard"].remote_queued.get(tenant, 0)


async def three_noisy_waiting_on_a(http, a, b, order):
    """A blocker holding the only place, through A, and three of tenant `noisy`'s waiting
    there, once B has heard of them. Returns the four requests' tasks."""
    blocker = asyncio.create_task(post(http, a.url, "blocker"))
    await until(lambda: "blocker" in order)
    waiting = [asyncio.create_task(post(http, a.url, f"noisy-{n}", {"x-kvlb-tenant": "noisy"}))
               for n in range(3)]
    await queued(a, 3)
    await until(lambda: b.balancer.fleet.replicas[0].in_flight >= 1 and remote_queued(b, "noisy") == 3)
    return [blocker, *waiting]


async def test_a_tenants_bound_on_waiting_requests_holds_across_instances(redis_server):
    order: list[str] = []
    async with two_instances(redis_server, order, {"blocker": 1.0}, max_queued_per_tenant=3) as (a, b), \
            aiohttp.ClientSession() as http:
        on_a = await three_noisy_waiting_on_a(http, a, b, order)
        status, headers, _ = await post(http, b.url, "noisy-b", {"x-kvlb-tenant": "noisy"})
        assert status == 429 and headers["x-kvlb-reject-reason"] == "tenant_queue_full"
        # Another tenant is not held to it.
        other = asyncio.create_task(post(http, b.url, "other", {"x-kvlb-tenant": "other"}))
        results = await asyncio.gather(other, *on_a)
    assert [status for status, _, _ in results] == [200] * 5


async def test_service_on_one_instance_counts_in_the_fair_share_on_another(redis_server):
    order: list[str] = []
    async with two_instances(redis_server, order, {"blocker": 0.5}, fairness_window_s=60) as (a, b), \
            aiohttp.ClientSession() as http:
        for n in range(10):  # the noisy tenant has used the fleet, all through A
            assert (await post(http, a.url, f"warm-{n}", {"x-kvlb-tenant": "noisy"}))[0] == 200
        standard = b.balancer.core.flow.by_name["standard"]
        await until(lambda: standard.remote.get("noisy", 0.0) > 0)
        blocker = asyncio.create_task(post(http, b.url, "blocker", {"x-kvlb-tenant": "third"}))
        await until(lambda: "blocker" in order)
        first = asyncio.create_task(post(http, b.url, "noisy-on-b", {"x-kvlb-tenant": "noisy"}))
        await queued(b, 1)
        second = asyncio.create_task(post(http, b.url, "steady-on-b", {"x-kvlb-tenant": "steady"}))
        await queued(b, 2)
        await asyncio.gather(blocker, first, second)
    # On B alone both tenants are new and the older request would go first; together, the
    # noisy tenant has had its share through A.
    assert order[-3:] == ["blocker", "steady-on-b", "noisy-on-b"]


async def test_a_place_that_frees_goes_to_the_instance_whose_tenant_should_go_next(redis_server):
    order: list[str] = []
    async with two_instances(redis_server, order, {"blocker": 0.5}, fairness_window_s=60) as (a, b), \
            aiohttp.ClientSession() as http:
        for n in range(5):  # tenant wide has used the fleet, through B
            assert (await post(http, b.url, f"warm-{n}", {"x-kvlb-tenant": "wide"}))[0] == 200
        blocker = asyncio.create_task(post(http, b.url, "blocker", {"x-kvlb-tenant": "wide"}))
        await until(lambda: "blocker" in order)
        wide = asyncio.create_task(post(http, b.url, "wide-on-b", {"x-kvlb-tenant": "wide"}))
        await queued(b, 1)
        await until(lambda: a.balancer.fleet.replicas[0].in_flight >= 1)  # A has heard the place is taken
        narrow = asyncio.create_task(post(http, a.url, "narrow-on-a", {"x-kvlb-tenant": "narrow"}))
        await queued(a, 1)
        await until(lambda: remote_queued(b, "narrow") == 1)
        results = await asyncio.gather(blocker, wide, narrow)
        async with http.get(b.url + "/metrics") as resp:
            sent = await resp.text()
        async with http.get(a.url + "/metrics") as resp:
            received = await resp.text()
    # B's own line has only `wide`; one fair share serves `narrow`, waiting on A, first.
    assert order[-3:] == ["blocker", "narrow-on-a", "wide-on-b"]
    assert [status for status, _, _ in results] == [200] * 3
    assert handed(sent, "sent") == 1.0
    assert handed(received, "received") == 1.0


async def test_a_request_handed_a_place_is_not_handed_another_for_a_snapshot_taken_before(redis_server):
    """A peer's snapshot read just after a hand-off, but taken before the peer took the
    place, still shows the request waiting; the next place to free is not handed for it
    again, until the peer's second snapshot since still shows it waiting."""
    order: list[str] = []
    redis = aioredis.Redis.from_url(redis_server.url)
    ghost_share = f"{redis_server.prefix}:flow:ghost"
    sync = redis_server.sync_settings(load_interval_s=0.05, load_ttl_s=30.0, timeout_s=0.2)

    async def ghost_waits(taken: float) -> None:
        await redis.set(ghost_share, orjson.dumps({"t": taken, "s": [["standard", "narrow", 0.0, 1]]}), px=30_000)

    try:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(f"{redis_server.prefix}:flow-places:ghost")
        received: list[bytes] = []

        async def listen() -> None:
            while True:
                message = await pubsub.get_message(timeout=0.05)
                if message is not None:
                    received.append(message["data"])

        listener = asyncio.create_task(listen())
        await ghost_waits(time.time())
        async with serve_app(ordered_app(order, {"first": 0.2, "second": 0.6})) as url:
            settings = make_settings([{"url": url, "name": "only", "model": "m", "max_concurrency": 2}],
                                     flow_control=MINIMAL, sync=sync)
            async with run_balancer(settings) as a, aiohttp.ClientSession() as http:
                await until(lambda: remote_queued(a, "narrow") == 1)
                first = asyncio.create_task(post(http, a.url, "first"))
                second = asyncio.create_task(post(http, a.url, "second"))
                await until(lambda: len(received) == 1)  # `first` ended: its place went to the ghost
                await asyncio.gather(first, second)
                await asyncio.sleep(0.2)  # exchanges that read the ghost's snapshot from before
                assert len(received) == 1  # `second`'s place was not handed for the same request
                await ghost_waits(time.time())  # may predate taking the place
                await asyncio.sleep(0.2)
                await ghost_waits(time.time() + 0.001)  # the second since: still waiting
                await until(lambda: remote_queued(a, "narrow") == 1)
                assert (await post(http, a.url, "late"))[0] == 200
                await until(lambda: len(received) == 2)  # `late`'s place goes to it
                async with http.get(a.url + "/metrics") as resp:
                    assert handed(await resp.text(), "sent") == 2.0
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await pubsub.aclose()
    finally:
        await redis.aclose()


async def test_a_higher_class_waiting_on_another_instance_takes_the_place_that_frees_here(redis_server):
    order: list[str] = []
    async with two_instances(redis_server, order, {"blocker": 0.5}) as (a, b), aiohttp.ClientSession() as http:
        blocker = asyncio.create_task(post(http, b.url, "blocker"))
        await until(lambda: "blocker" in order)
        standard = asyncio.create_task(post(http, b.url, "standard-on-b"))
        await queued(b, 1)
        await until(lambda: a.balancer.fleet.replicas[0].in_flight >= 1)  # A has heard the place is taken
        critical = asyncio.create_task(post(http, a.url, "critical-on-a", {"x-kvlb-priority": "critical"}))
        await queued(a, 1)
        await until(lambda: b.balancer.core.flow.by_name["critical"].remote_queued.get("default", 0) == 1)
        results = await asyncio.gather(blocker, standard, critical)
    assert order[-3:] == ["blocker", "critical-on-a", "standard-on-b"]
    assert [status for status, _, _ in results] == [200] * 3


async def test_without_redis_each_instance_enforces_on_its_own(redis_server):
    if not redis_server.private:
        pytest.skip("needs a private redis-server to stop")
    order: list[str] = []
    async with two_instances(redis_server, order, {"blocker": 1.5}, max_queued_per_tenant=3) as (a, b), \
            aiohttp.ClientSession() as http:
        on_a = await three_noisy_waiting_on_a(http, a, b, order)
        redis_server.stop()
        await until(lambda: b.balancer.core.flow.remote_peers == 0)
        async with http.get(b.url + "/metrics") as resp:
            assert "kvlb_flow_shared_peers 0.0" in await resp.text()
        # B's own bound again: the tenant has nothing waiting on B.
        late = asyncio.create_task(post(http, b.url, "noisy-b", {"x-kvlb-tenant": "noisy"}))
        results = await asyncio.gather(late, *on_a)
        redis_server.start()
    assert [status for status, _, _ in results] == [200] * 5
