"""API keys: without one the balancer answers 401; with one, the request goes through, and
the replicas see either the client's key or the configured replica key."""

from __future__ import annotations

import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import openai
import pytest

from balancer.serving.auth import TokenBucket
from loadtest.compare.stub_replica import make_stub_app
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, echo_app


async def test_keys_from_config_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nsk-file-1\n\nsk-file-2  # second\n")
    monkeypatch.setenv("KVLB_TEST_KEYS", "sk-env-1, sk-env-2")
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(make_stub_app("a")))
        settings = make_settings([replica], auth={"api_keys": ["sk-inline"], "api_keys_file": str(keys_file),
                                                  "api_keys_env": "KVLB_TEST_KEYS"})
        running = await stack.enter_async_context(run_balancer(settings))
        for key in ("sk-inline", "sk-file-1", "sk-file-2", "sk-env-2"):
            async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key=key, max_retries=0) as oai:
                answer = await oai.completions.create(model="stub-model", prompt="x", max_tokens=2)
                assert answer.choices[0].text
                assert [m.id for m in (await oai.models.list()).data] == ["stub-model"]
        async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="sk-wrong", max_retries=0) as oai:
            with pytest.raises(openai.AuthenticationError) as info:
                await oai.completions.create(model="stub-model", prompt="x")
            assert info.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await oai.models.list()
        async with aiohttp.ClientSession() as http:
            async with http.post(running.url + "/v1/completions", json={"model": "stub-model"}) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "missing_api_key"
            async with http.get(running.url + "/health") as resp:
                assert resp.status == 200  # probes need no key


async def test_client_key_forwarded_or_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = Seen()
    monkeypatch.setenv("KVLB_REPLICA_KEY", "sk-replica")
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(echo_app(seen)))
        open_fleet = await stack.enter_async_context(run_balancer(make_settings([url])))
        keyed = await stack.enter_async_context(run_balancer(make_settings(
            [url], auth={"api_keys": ["sk-client"], "replica_api_key_env": "KVLB_REPLICA_KEY"})))
        async with aiohttp.ClientSession() as http:
            for running in (open_fleet, keyed):
                async with http.post(running.url + "/v1/completions", json={"model": "m"},
                                     headers={"Authorization": "Bearer sk-client"}) as resp:
                    assert resp.status == 200
    auth = [{k.lower(): v for k, v in h.items()}["authorization"] for h in seen.headers]
    assert auth == ["Bearer sk-client", "Bearer sk-replica"]


def test_missing_key_source_stops_serve_with_a_clear_message(tmp_path: Path) -> None:
    config = tmp_path / "kvlb.yaml"
    config.write_text("replicas: [{url: 'http://127.0.0.1:9'}]\nauth: {api_keys_env: KVLB_NOT_SET_ANYWHERE}\n")
    run = subprocess.run([sys.executable, "-m", "balancer", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "KVLB_NOT_SET_ANYWHERE is not set" in run.stderr


async def test_keys_never_reach_logs(caplog: pytest.LogCaptureFixture) -> None:
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(make_stub_app("a")))
        settings = make_settings([replica], auth={"api_keys": ["sk-secret-123"]},
                                 logging={"access_log": True, "level": "debug"})
        running = await stack.enter_async_context(run_balancer(settings))
        caplog.set_level("DEBUG")
        async with aiohttp.ClientSession() as http:
            for key in ("sk-secret-123", "sk-guess-456"):
                async with http.post(running.url + "/v1/completions", json={"model": "stub-model", "prompt": "x"},
                                     headers={"Authorization": f"Bearer {key}"}) as resp:
                    await resp.read()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "kvlb.access" in {r.name for r in caplog.records}
    assert "sk-secret-123" not in text and "sk-guess-456" not in text


def test_token_bucket_rate_and_burst() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == 0.5  # empty: one more token in half a second
    assert bucket.take(0.5) == 0.0
    assert bucket.take(10.0) == 0.0 and bucket.tokens == 2  # refills up to the burst only


async def test_a_key_over_its_rate_gets_429_others_do_not() -> None:
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(make_stub_app("a")))
        settings = make_settings([replica], auth={"api_keys": ["sk-1", "sk-2"], "rate_limit_per_s": 0.5,
                                                  "rate_limit_burst": 2})
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:

            async def send(key: str) -> aiohttp.ClientResponse:
                async with http.post(running.url + "/v1/completions", json={"model": "stub-model", "prompt": "x"},
                                     headers={"Authorization": f"Bearer {key}"}) as resp:
                    await resp.read()
                    return resp

            assert [(await send("sk-1")).status for _ in range(2)] == [200, 200]
            limited = await send("sk-1")
            assert limited.status == 429 and int(limited.headers["Retry-After"]) >= 1
            assert (await send("sk-2")).status == 200
