"""Fault injection: 503s, hangs, cut streams, failing health, and a crashing process."""

import asyncio
import time
import urllib.request

import aiohttp
import openai
import pytest

from loadtest.replica.config import ReplicaConfig
from loadtest.replica.faults import Faults
from loadtest.replica.launch import ReplicaProcess, running_replica

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


@pytest.fixture
async def replica():
    async with running_replica(ReplicaConfig(time_scale=1000)) as server:
        yield server


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def set_faults(http, url, spec) -> dict:
    async with http.post(url + "/admin/fault", json=spec) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def chat_status(http, url, body=CHAT) -> int:
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


async def test_error_rate_fails_that_fraction_exactly(replica, http):
    await set_faults(http, replica.url, {"error_rate": 0.25})
    statuses = [await chat_status(http, replica.url) for _ in range(12)]
    assert statuses.count(503) == 3
    assert set(statuses) == {200, 503}
    async with http.get(replica.url + "/admin/fault") as response:
        assert (await response.json())["error_rate"] == 0.25
    assert await set_faults(http, replica.url, {}) == Faults().to_json()
    assert [await chat_status(http, replica.url) for _ in range(4)] == [200] * 4


async def test_injected_503_in_openai_error_shape(replica, http):
    await set_faults(http, replica.url, {"error_rate": 1.0})
    async with http.post(replica.url + "/v1/chat/completions", json=CHAT) as response:
        assert response.status == 503
        error = (await response.json())["error"]
    assert set(error) >= {"message", "type", "code"}
    sdk = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            await sdk.chat.completions.create(model="m", **CHAT)
        assert raised.value.status_code == 503
    finally:
        await sdk.close()


async def test_hang_before_first_byte_and_release_on_clear(replica, http):
    await set_faults(http, replica.url, {"hang_s": 0.3})
    started = time.monotonic()
    assert await chat_status(http, replica.url) == 200
    assert time.monotonic() - started >= 0.3

    await set_faults(http, replica.url, {"hang_s": 60})
    hung = asyncio.create_task(chat_status(http, replica.url))
    await asyncio.sleep(0.2)
    assert not hung.done()
    await set_faults(http, replica.url, {})
    assert await asyncio.wait_for(hung, timeout=2) == 200


async def test_hang_holds_the_client_until_its_timeout(replica):
    async with aiohttp.ClientSession() as session:
        await set_faults(session, replica.url, {"hang_s": 60})
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                replica.url + "/v1/chat/completions",
                json=CHAT,
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
    assert not replica.engine.has_work


async def test_cut_stream_after_n_tokens(replica, http):
    await set_faults(http, replica.url, {"cut_after_tokens": 3})
    body = dict(CHAT, max_tokens=20, stream=True)
    received = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: "):
                    received.append(line)
    assert len(received) == 3
    assert b"[DONE]" not in b"".join(received)
    await asyncio.sleep(0.05)
    assert replica.engine.cache.used_blocks == 0  # the cut request left the engine

    sdk = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.APIError):
            stream = await sdk.chat.completions.create(model="m", **body)
            async for _ in stream:
                pass
        # A non-streaming request is dropped without an answer.
        with pytest.raises(openai.APIConnectionError):
            await sdk.chat.completions.create(model="m", **CHAT)
    finally:
        await sdk.close()


async def test_unhealthy(replica, http):
    await set_faults(http, replica.url, {"unhealthy": True})
    for path in ("/health", "/health_generate"):
        async with http.get(replica.url + path) as response:
            assert response.status == 503
    await set_faults(http, replica.url, {})
    async with http.get(replica.url + "/health") as response:
        assert response.status == 200


@pytest.mark.parametrize(
    "spec",
    [
        {"error_rate": 2},
        {"error_rate": "half"},
        {"hang_s": -1},
        {"cut_after_tokens": 1.5},
        {"unhealthy": "yes"},
        {"explode": True},
        [],
    ],
)
async def test_bad_fault_specs_are_refused(replica, http, spec):
    async with http.post(replica.url + "/admin/fault", json=spec) as response:
        assert response.status == 400
        assert "error" in await response.json()


def test_exit_fault_kills_the_process():
    with ReplicaProcess(["--time-scale", "100"]) as replica:
        request = urllib.request.Request(
            replica.url + "/admin/fault",
            data=b'{"exit_after_s": 0}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        assert replica.process.wait(timeout=5) == 1


def test_exit_fault_from_the_command_line():
    started = time.monotonic()
    with ReplicaProcess(["--fault-exit-after-s", "0.5"]) as replica:
        assert replica.process.wait(timeout=10) == 1
    assert time.monotonic() - started >= 0.5
