"""Failover: before the first byte, a failed replica hands the request to the next one."""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp
from multidict import CIMultiDict

from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, hanging_app, status_app

BODY = {"model": "stub-model", "prompt": "p", "max_tokens": 2}


async def post(url: str, body: dict = BODY) -> tuple[int, CIMultiDict, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            return resp.status, CIMultiDict(resp.headers), await resp.json(content_type=None)


async def test_connect_error_moves_to_next_replica() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with AsyncExitStack() as stack:
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        settings = make_settings([{"url": dead, "name": "dead"}, {"url": good, "name": "good"}],
                                 policy={"name": "round_robin"})
        running = await stack.enter_async_context(run_balancer(settings))
        for _ in range(4):  # round robin puts the dead replica first every other time
            status, headers, _ = await post(running.url)
            assert status == 200
            assert headers["x-kvlb-replica"] == "good"
        assert all(r.in_flight == 0 for r in running.balancer.fleet.replicas)


async def test_503_and_502_move_on_and_are_never_retried_on_the_same_replica() -> None:
    seen503, seen502 = Seen(), Seen()
    async with AsyncExitStack() as stack:
        r503 = await stack.enter_async_context(serve_app(status_app(seen503, 503)))
        r502 = await stack.enter_async_context(serve_app(status_app(seen502, 502)))
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        settings = make_settings(
            [{"url": r503, "name": "a"}, {"url": r502, "name": "b"}, {"url": good, "name": "good"}],
            policy={"name": "round_robin"},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        for _ in range(3):
            status, headers, _ = await post(running.url)
            assert status == 200 and headers["x-kvlb-replica"] == "good"
        # Round robin started at a, then b, then good: each bad replica was tried at most once per request.
        assert seen503.requests <= 3 and seen502.requests <= 3
        assert seen503.requests + seen502.requests == 3


async def test_all_attempts_failing_gives_502_and_respects_max_attempts() -> None:
    seen = [Seen() for _ in range(4)]
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_app(status_app(s, 503))) for s in seen]
        settings = make_settings(urls, retries={"max_attempts": 3})
        running = await stack.enter_async_context(run_balancer(settings))
        status, headers, body = await post(running.url)
        assert status == 502
        assert body["error"]["code"] == "upstream_failed"
        assert "503" in body["error"]["message"]
        assert sum(s.requests for s in seen) == 3
        assert max(s.requests for s in seen) == 1
        assert "x-request-id" in headers


async def test_first_byte_timeout_moves_on() -> None:
    hung = Seen()
    async with AsyncExitStack() as stack:
        slow = await stack.enter_async_context(serve_app(hanging_app(hung)))
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        settings = make_settings([{"url": slow, "name": "slow"}, {"url": good, "name": "good"}],
                                 policy={"name": "round_robin"}, timeouts={"first_byte_s": 0.3})
        running = await stack.enter_async_context(run_balancer(settings))
        for _ in range(2):
            status, headers, _ = await post(running.url)
            assert status == 200 and headers["x-kvlb-replica"] == "good"
        assert hung.requests == 1


async def test_other_errors_pass_through_unretried() -> None:
    seen500, seen400 = Seen(), Seen()
    async with AsyncExitStack() as stack:
        r500 = await stack.enter_async_context(serve_app(status_app(seen500, 500)))
        r400 = await stack.enter_async_context(serve_app(status_app(seen400, 400)))
        for url, seen, code in ((r500, seen500, 500), (r400, seen400, 400)):
            good = await stack.enter_async_context(serve_app(make_stub_app("good")))
            settings = make_settings([{"url": url, "name": "bad"}, {"url": good, "name": "good"}],
                                     policy={"name": "round_robin"})
            running = await stack.enter_async_context(run_balancer(settings))
            status, headers, body = await post(running.url)
            assert status == code and headers["x-kvlb-replica"] == "bad"
            assert body["error"]["message"] == f"upstream says {code}"
            assert seen.requests == 1
