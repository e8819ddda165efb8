"""Outlier ejection: live traffic takes a failing replica out at once and lets it back in
through a single probe."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
from aiohttp import web

from balancer.routing.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerSettings
from loadtest.compare.stub_replica import make_stub_app
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, status_app


def test_opens_after_consecutive_failures_and_backs_off_exponentially() -> None:
    b = Breaker(BreakerSettings(consecutive_failures=3, base_ejection_s=10, max_ejection_s=25))
    assert not b.failed(0) and not b.failed(1)
    b.succeeded()  # a success in between resets the count
    assert not b.failed(2) and not b.failed(3)
    assert b.failed(4) and b.state(4) == OPEN and not b.allows(13.9)
    assert b.state(14) == HALF_OPEN and b.allows(14)
    b.started(14)
    assert not b.allows(14)  # one probe at a time
    assert b.failed(15)  # the probe failed: open again, for twice as long
    assert b.state(34.9) == OPEN and b.state(35) == HALF_OPEN
    b.started(35)
    assert b.failed(35) and b.open_until == 60  # capped at max_ejection_s
    b.started(60)
    b.succeeded()
    assert b.state(60) == CLOSED and b.ejections == 0 and b.ejected_total == 3


def test_a_probe_without_verdict_lets_the_next_one_through() -> None:
    b = Breaker(BreakerSettings(consecutive_failures=1, base_ejection_s=1))
    b.failed(0)
    assert b.started(1) and not b.allows(1)
    b.abandoned()
    assert b.allows(1)


def test_retry_after_holds_the_replica_off_without_counting_a_failure() -> None:
    b = Breaker(BreakerSettings(consecutive_failures=1))
    b.hold_off(100, 30)
    assert b.state(129) == OPEN and b.allows(130) and b.failures == 0


def test_ejections_in_a_row_never_overflow_the_back_off() -> None:
    b = Breaker(BreakerSettings(consecutive_failures=1, base_ejection_s=1, max_ejection_s=60))
    now = 0.0
    for _ in range(2000):
        assert b.failed(now)
        now = b.open_until
        b.started(now)
    assert b.open_until - now <= 60 and b.ejections == 2000


def test_500s_from_one_client_never_eject_however_many() -> None:
    b = Breaker(BreakerSettings(min_requests=5, min_clients=3, success_threshold=0.5))
    for i in range(500):
        assert not b.answered(i * 0.01, False, "key-0")
    assert b.state(5) == CLOSED


def test_500s_from_several_clients_eject_by_success_rate() -> None:
    b = Breaker(BreakerSettings(min_requests=6, min_clients=3, success_threshold=0.5, window_s=10))
    for i, client in enumerate(["a", "a", "b", "b"]):
        assert not b.answered(i, False, client)
    b.answered(4, True, "d")
    assert b.answered(5, False, "c")  # 1 of 6 succeeded, failures from 3 clients
    assert b.state(5) == OPEN


def test_the_success_rate_forgets_answers_older_than_its_window() -> None:
    b = Breaker(BreakerSettings(min_requests=4, min_clients=2, success_threshold=0.5, window_s=10))
    b.answered(0, False, "a")
    b.answered(1, False, "b")
    b.answered(2, False, "c")
    assert not b.answered(20, False, "d")  # the others are out of the window: one answer
    assert b.state(20) == CLOSED


async def test_failing_replica_is_ejected_then_probed_back() -> None:
    state = {"fail": True}
    seen = Seen()

    async def flaky(request: web.Request) -> web.Response:
        await request.read()
        seen.requests += 1
        if state["fail"]:
            return web.json_response({"error": {"message": "boom", "type": "x", "code": None}}, status=500)
        return web.json_response({"object": "text_completion", "choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", flaky)
    async with AsyncExitStack() as stack:
        bad = await stack.enter_async_context(serve_app(app))
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        settings = make_settings(
            [{"url": bad, "name": "bad", "model": "stub-model"}, {"url": good, "name": "good"}],
            policy={"name": "round_robin"},
            health={"ejection_base_s": 0.3, "success_rate_min_requests": 3,
                    "success_rate_min_clients": 3},
            auth={"api_keys": ["k1", "k2", "k3"]},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:

            async def send(key: str = "k1") -> tuple[int, str]:
                async with http.post(running.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"model": "stub-model", "prompt": "x"}) as resp:
                    return resp.status, resp.headers["x-kvlb-replica"]

            results = [await send(key) for key in ["k1", "k1", "k2", "k2", "k3", "k3", "k1", "k1"]]
            # A 500 passes through (not retried); once three clients saw them, the replica is out.
            assert results[:6] == [(500, "bad"), (200, "good")] * 3
            assert results[-2:] == [(200, "good")] * 2
            assert seen.requests == 3
            assert running.balancer.fleet.by_name["bad"].breaker.state(0) != CLOSED
            await asyncio.sleep(0.35)
            state["fail"] = False
            results = [await send() for _ in range(4)]
            assert (200, "bad") in results  # the probe went through and closed the breaker
            assert running.balancer.fleet.by_name["bad"].breaker.ejections == 0


async def test_429_with_retry_after_moves_on_and_keeps_away() -> None:
    limited = Seen()
    async with AsyncExitStack() as stack:
        busy = await stack.enter_async_context(serve_app(status_app(limited, 429, retry_after="60")))
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        settings = make_settings([{"url": busy, "name": "busy", "model": "stub-model"}, {"url": good, "name": "good"}],
                                 policy={"name": "round_robin"})
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            for _ in range(6):
                async with http.post(running.url + "/v1/completions",
                                     json={"model": "stub-model", "prompt": "x"}) as resp:
                    assert resp.status == 200 and resp.headers["x-kvlb-replica"] == "good"
        assert limited.requests == 1  # asked once, then left alone for its 60 s


async def test_flapping_simulated_replica_is_ejected_and_returns_through_half_open() -> None:
    async with AsyncExitStack() as stack:
        flaky = await stack.enter_async_context(running_replica(ReplicaConfig(model="m", time_scale=100)))
        steady = await stack.enter_async_context(running_replica(ReplicaConfig(model="m", time_scale=100)))
        flaky_url = f"http://127.0.0.1:{flaky.port}"
        settings = make_settings(
            [{"url": flaky_url, "name": "flaky"}, {"url": f"http://127.0.0.1:{steady.port}", "name": "steady"}],
            policy={"name": "round_robin"},
            health={"eject_after_failures": 2, "ejection_base_s": 0.3},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        breaker = running.balancer.fleet.by_name["flaky"].breaker
        async with aiohttp.ClientSession() as http:

            async def send() -> str:
                async with http.post(running.url + "/v1/completions",
                                     json={"model": "m", "prompt": "a b c", "max_tokens": 2}) as resp:
                    assert resp.status == 200  # a 503 from the flaky one fails over: clients see none
                    return resp.headers["x-kvlb-replica"]

            async with http.post(flaky_url + "/admin/fault", json={"error_rate": 1.0}) as resp:
                assert resp.status == 200
            assert {await send() for _ in range(6)} == {"steady"}
            assert breaker.state(asyncio.get_running_loop().time()) == "open"
            async with http.post(flaky_url + "/admin/fault", json={}) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.35)
            assert "flaky" in {await send() for _ in range(4)}  # the half-open probe succeeded
            assert breaker.state(asyncio.get_running_loop().time()) == "closed"
