"""The admin API: operators see the fleet, add replicas, drain and remove them, with a token."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import pytest

from balancer.app import start_balancer
from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from tests.conftest import make_settings, run_balancer, serve_app

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "stub-model", "prompt": "x"}


async def served_by(http: aiohttp.ClientSession, url: str, n: int) -> set[str]:
    names = set()
    for _ in range(n):
        async with http.post(url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
            names.add(resp.headers["x-kvlb-replica"])
    return names


async def test_list_add_drain_remove(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLB_ADMIN_TOKEN", TOKEN)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        b = await stack.enter_async_context(serve_app(make_stub_app("b")))
        settings = make_settings([{"url": a, "name": "a"}], policy={"name": "round_robin"},
                                 admin={"token_env": "KVLB_ADMIN_TOKEN"})
        running = await stack.enter_async_context(run_balancer(settings))
        url = running.url
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/admin/replicas", headers=ADMIN) as resp:
                listed = (await resp.json())["replicas"]
                assert [r["name"] for r in listed] == ["a"]
                assert listed[0]["healthy"] and listed[0]["breaker"] == "closed"
            async with http.post(url + "/admin/replicas", headers=ADMIN, json={"url": b, "name": "b"}) as resp:
                assert resp.status == 201
            assert await served_by(http, url, 4) == {"a", "b"}
            async with http.post(url + "/admin/replicas", headers=ADMIN, json={"url": "ftp://x", "name": "c"}) as resp:
                assert resp.status == 400 and "not an http(s) URL" in (await resp.json())["error"]["message"]
            async with http.post(url + "/admin/replicas", headers=ADMIN, json={"url": b, "name": "b"}) as resp:
                assert resp.status == 409
            async with http.post(url + "/admin/replicas/a/drain", headers=ADMIN) as resp:
                assert (await resp.json())["draining"] is True
            assert await served_by(http, url, 4) == {"b"}
            async with http.post(url + "/admin/replicas/a/undrain", headers=ADMIN) as resp:
                assert resp.status == 200
            async with http.delete(url + "/admin/replicas/b", headers=ADMIN) as resp:
                assert (await resp.json())["removed"] == "b"
            assert await served_by(http, url, 3) == {"a"}
            async with http.get(url + "/admin/replicas/b", headers=ADMIN) as resp:
                assert resp.status == 404
            async with http.get(url + "/admin/replicas", headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401
            async with http.get(url + "/admin/replicas") as resp:
                assert resp.status == 401


async def test_admin_api_is_off_without_a_token() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        running = await stack.enter_async_context(run_balancer(make_settings([a])))
        async with aiohttp.ClientSession() as http:
            async with http.get(running.url + "/admin/replicas") as resp:
                assert resp.status == 404


async def test_reload_through_the_admin_api(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KVLB_ADMIN_TOKEN", TOKEN)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        b = await stack.enter_async_context(serve_app(make_stub_app("b")))
        settings = make_settings([{"url": a, "name": "a"}], admin={"token_env": "KVLB_ADMIN_TOKEN"},
                                 policy={"name": "least_load"})
        running = await stack.enter_async_context(run_balancer(settings))
        config = tmp_path / "kvlb.yaml"
        running.balancer.config_path = str(config)
        async with aiohttp.ClientSession() as http:
            config.write_text("replicas: [{url: 'ftp://nope'}]\n")
            async with http.post(running.url + "/admin/reload", headers=ADMIN) as resp:
                assert resp.status == 400
                assert "replicas[0].url" in (await resp.json())["error"]["message"]
            config.write_text(f"replicas: [{{url: '{b}', name: b}}]\npolicy: {{name: round_robin}}\n"
                              "admin: {token_env: KVLB_ADMIN_TOKEN}\ntimeouts: {total_s: 300}\n"
                              "routing: {block_chars: 32}\nlimits: {max_in_flight: 7}\n")
            async with http.post(running.url + "/admin/reload", headers=ADMIN) as resp:
                result = await resp.json()
                assert resp.status == 200, result
            assert result["added"] == ["b"] and result["removed"] == ["a"] and result["policy_changed"]
            assert result["restart_needed"] == ["routing"]  # bound at start
            live = running.balancer
            assert live.settings.timeouts.total_s == 300 and live.admission.queue.max_in_flight == 7
            assert live.settings.routing.block_chars == 64
            assert await served_by(http, running.url, 3) == {"b"}


async def test_admin_api_on_its_own_address_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLB_ADMIN_TOKEN", TOKEN)
    async with serve_app(make_stub_app("a")) as a:
        admin_port = free_port()
        settings = make_settings([{"url": a, "name": "a"}],
                                 admin={"token_env": "KVLB_ADMIN_TOKEN", "listen_host": "127.0.0.1",
                                        "listen_port": admin_port})
        running = await start_balancer(settings, port=free_port())
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{running.port}/admin/replicas", headers=ADMIN) as resp:
                    assert resp.status == 404  # not on the client port
                async with http.get(f"http://127.0.0.1:{admin_port}/admin/replicas", headers=ADMIN) as resp:
                    assert resp.status == 200
                async with http.post(f"http://127.0.0.1:{admin_port}/v1/completions", json=BODY) as resp:
                    assert resp.status == 404  # and the admin port proxies nothing
        finally:
            await running.close(grace_s=0.5)


async def test_a_reload_reaches_the_client_connections_limits(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KVLB_ADMIN_TOKEN", TOKEN)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        settings = make_settings([{"url": a, "name": "a"}], admin={"token_env": "KVLB_ADMIN_TOKEN"})
        running = await stack.enter_async_context(run_balancer(settings))
        config = tmp_path / "kvlb.yaml"
        running.balancer.config_path = str(config)
        config.write_text(f"replicas: [{{url: '{a}', name: a}}]\nadmin: {{token_env: KVLB_ADMIN_TOKEN}}\n"
                          "timeouts: {client_head_s: 0.3}\nlimits: {max_connections: 3}\n")
        async with aiohttp.ClientSession() as http:
            async with http.post(running.url + "/admin/reload", headers=ADMIN) as resp:
                result = await resp.json()
                assert resp.status == 200 and result["restart_needed"] == [], result
        port = int(running.url.rsplit(":", 1)[1])
        # A head that never ends now gets its 408 within the reloaded 0.3 s, not 30 s.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer = await asyncio.wait_for(reader.read(), 3)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ")
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await asyncio.wait_for(reader.read(), 3)).startswith(b"HTTP/1.1 503 ")
        for _, w in [*held, (reader, writer)]:
            w.close()
