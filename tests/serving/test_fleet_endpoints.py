"""The engines' utility routes through kvlb, in front of simulated replicas: cache resets for
the whole fleet, token counts from a replica, and what kvlb says of itself."""

from __future__ import annotations

from contextlib import AsyncExitStack, ExitStack

import aiohttp
import pytest

from loadtest.replica.launch import ReplicaProcess
from tests.conftest import make_settings, run_balancer

MODEL = "m"
PROMPT = "a long shared system prompt that every request of this test repeats " * 40


async def complete(http: aiohttp.ClientSession, url: str) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.json()


@pytest.mark.parametrize("route", ["/reset_prefix_cache", "/flush_cache"])
async def test_a_cache_reset_reaches_every_replica_and_kvlbs_own_index(route: str) -> None:
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(["--model", MODEL, "--time-scale", "20"]))
                    for _ in range(2)]
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": r.url, "name": f"r{i}"} for i, r in enumerate(replicas)],
                                     policy={"name": "cache_aware", "seed": 0})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                await complete(http, running.url)
                assert (await complete(http, running.url))["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                index = running.balancer.core.tracker.index
                assert index.entries > 0
                async with http.post(running.url + route) as resp:
                    assert resp.status == 200
                    answer = await resp.json()
                assert answer["succeeded"] == 2 and answer["failed"] == 0
                assert sorted(r["replica"] for r in answer["replicas"]) == ["r0", "r1"]
                assert index.entries == 0
                # Every replica's cache is empty: the prompt is computed again.
                assert (await complete(http, running.url))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_reset_that_fails_somewhere_says_where_and_an_admin_token_guards_it(monkeypatch) -> None:
    monkeypatch.setenv("KVLB_TEST_ADMIN_TOKEN", "admin-secret")
    with ExitStack() as processes:
        replica = processes.enter_context(ReplicaProcess(["--model", MODEL, "--time-scale", "20"]))
        async with AsyncExitStack() as stack:
            settings = make_settings(
                [{"url": replica.url, "name": "alive", "model": MODEL},
                 {"url": "http://127.0.0.1:9", "name": "gone", "model": MODEL}],
                admin={"token_env": "KVLB_TEST_ADMIN_TOKEN"},
            )
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                async with http.post(running.url + "/reset_prefix_cache") as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error"]["code"] == "invalid_admin_token"
                headers = {"Authorization": "Bearer admin-secret"}
                async with http.post(running.url + "/reset_prefix_cache", headers=headers) as resp:
                    assert resp.status == 502
                    answer = await resp.json()
                assert answer["error"]["code"] == "fleet_partial_failure"
                by_name = {r["replica"]: r for r in answer["replicas"]}
                assert by_name["alive"]["ok"] and not by_name["gone"]["ok"] and by_name["gone"]["error"]


async def test_tokenize_goes_to_a_replica_and_kvlb_answers_for_itself() -> None:
    with ExitStack() as processes:
        replica = processes.enter_context(ReplicaProcess(["--model", MODEL, "--time-scale", "20"]))
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": replica.url, "name": "r0"}], auth={"api_keys": ["k"]})
            running = await stack.enter_async_context(run_balancer(settings))
            key = {"Authorization": "Bearer k"}
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": "one two three"}
                async with http.post(running.url + "/tokenize", json=body, headers=key) as resp:
                    via_kvlb = (resp.status, await resp.json())
                async with http.post(replica.url + "/tokenize", json=body) as resp:
                    direct = (resp.status, await resp.json())
                assert via_kvlb == direct and via_kvlb[0] == 200
                async with http.post(running.url + "/tokenize", json={**body, "model": "nope"}, headers=key) as resp:
                    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
                # What kvlb is and what it knows of its replicas needs a key as the API does.
                async with http.get(running.url + "/get_server_info") as resp:
                    assert resp.status == 401
                async with http.get(running.url + "/get_server_info", headers=key) as resp:
                    info = await resp.json()
                assert info["server"] == "kvlb" and info["version"]
                assert [r["name"] for r in info["replicas"]] == ["r0"] and info["replicas"][0]["models"] == [MODEL]
                async with http.get(running.url + "/version", headers=key) as resp:
                    assert (await resp.json())["version"] == info["version"]
