"""Health: replicas that fail their checks leave the rankings and come back when they recover."""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp
from aiohttp import web

from balancer.watchers.health import HealthChecker
from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from tests.conftest import make_settings, run_balancer, serve_app
from tests.watchers.test_sync import until


async def test_unhealthy_replica_leaves_rankings_and_returns() -> None:
    flaky_ok = {"value": True}
    async with AsyncExitStack() as stack:
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        flaky = await stack.enter_async_context(
            serve_app(make_stub_app("flaky", is_healthy=lambda: flaky_ok["value"]))
        )
        settings = make_settings([{"url": good, "name": "good"}, {"url": flaky, "name": "flaky"}],
                                 policy={"name": "round_robin"},
                                 health={"unhealthy_threshold": 2, "healthy_threshold": 1})
        running = await stack.enter_async_context(run_balancer(settings))
        fleet = running.balancer.fleet
        checker = HealthChecker(fleet, settings.health, running.balancer.session)

        async def served_by(n: int) -> set[str]:
            served = set()
            async with aiohttp.ClientSession() as http:
                for _ in range(n):
                    async with http.post(running.url + "/v1/completions",
                                         json={"model": "stub-model", "prompt": "p"}) as resp:
                        assert resp.status == 200
                        served.add(resp.headers["x-kvlb-replica"])
            return served

        async def ready() -> tuple[int, dict]:
            async with aiohttp.ClientSession() as http:
                async with http.get(running.url + "/ready") as resp:
                    return resp.status, await resp.json()

        assert await served_by(4) == {"good", "flaky"}
        flaky_ok["value"] = False
        await checker.check_once()
        assert fleet.by_name["flaky"].healthy  # one failure is below the threshold
        await checker.check_once()
        assert not fleet.by_name["flaky"].healthy
        assert await served_by(4) == {"good"}
        assert (await ready()) == (200, {"status": "ready", "healthy_replicas": 1, "replicas": 2})

        flaky_ok["value"] = True
        await checker.check_once()
        assert await served_by(4) == {"good", "flaky"}


async def test_ready_is_503_when_no_replica_is_healthy_and_health_stays_200() -> None:
    ok = {"value": True}
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(make_stub_app("a", is_healthy=lambda: ok["value"])))
        settings = make_settings([url], health={"unhealthy_threshold": 1})
        running = await stack.enter_async_context(run_balancer(settings))
        checker = HealthChecker(running.balancer.fleet, settings.health, running.balancer.session)
        ok["value"] = False
        await checker.check_once()
        async with aiohttp.ClientSession() as http:
            async with http.get(running.url + "/ready") as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_healthy_replica"
            async with http.get(running.url + "/health") as resp:
                assert resp.status == 200


async def test_a_replica_that_starts_after_kvlb_is_listed_at_its_first_answer() -> None:
    """Until a replica is listed it is sent any model; one still starting when kvlb did is
    listed as soon as a health check finds it answering, not at the next refresh round."""
    port = free_port()
    settings = make_settings([{"url": f"http://127.0.0.1:{port}", "name": "late"}], models={"refresh_s": 3600})
    async with AsyncExitStack() as stack:
        running = await stack.enter_async_context(run_balancer(settings))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        late = running.balancer.fleet.by_name["late"]
        assert late.discovered_models is None  # nothing answered when kvlb started
        runner = web.AppRunner(make_stub_app("late", model="m"), access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await running.balancer._health.check_once()
        await until(lambda: late.discovered_models is not None)
        async with http.post(running.url + "/v1/completions", json={"model": "other", "prompt": "p"}) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 404 and error["code"] == "model_not_found", error
            assert "x-kvlb-replica" not in resp.headers
        async with http.post(running.url + "/v1/completions", json={"model": "m", "prompt": "p"}) as resp:
            assert resp.status == 200 and resp.headers["x-kvlb-replica"] == "late"
