"""Bad input gets a clear answer in the OpenAI error format, and never disturbs other clients."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import orjson
import pytest

from balancer.app import start_balancer
from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from policies.base import Policy
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, hanging_app, slow_sse_app


def assert_openai_error(body: bytes, code: str) -> dict:
    parsed = orjson.loads(body)
    error = parsed["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == code, error
    assert error["message"]
    return error


@pytest.fixture
async def balancer_url():
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(serve_app(make_stub_app("a")))
        running = await stack.enter_async_context(
            run_balancer(make_settings([replica], limits={"max_body_bytes": 4096, "max_header_bytes": 2048}))
        )
        yield running.url


CASES = [
    # (name, path, body, headers, status, code)
    ("malformed json", "/v1/chat/completions", b'{"model": "stub-model", "messages": [', {}, 400, "invalid_json"),
    ("empty body", "/v1/completions", b"", {}, 400, "invalid_json"),
    ("json array", "/v1/completions", b'[{"model": "stub-model"}]', {}, 400, "invalid_json"),
    ("json string", "/v1/completions", b'"hello"', {}, 400, "invalid_json"),
    ("not utf-8", "/v1/completions", b'{"model": "stub-model", "prompt": "\xff\xfe"}', {}, 400, "invalid_encoding"),
    ("missing model", "/v1/chat/completions", b'{"messages": []}', {}, 400, "missing_model"),
    ("model not a string", "/v1/completions", b'{"model": 7, "prompt": "x"}', {}, 400, "invalid_model"),
    ("unknown model", "/v1/completions", b'{"model": "nope", "prompt": "x"}', {}, 404, "model_not_found"),
    ("body over limit", "/v1/completions", b'{"model": "stub-model", "prompt": "' + b"x" * 5000 + b'"}', {}, 413,
     "request_too_large"),
]


@pytest.mark.parametrize("name,path,body,headers,status,code", CASES, ids=[c[0] for c in CASES])
async def test_bad_request_answers(balancer_url, name, path, body, headers, status, code) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(balancer_url + path, data=body, headers=headers) as resp:
            assert resp.status == status
            assert resp.content_type == "application/json"
            assert resp.headers["x-request-id"]
            assert_openai_error(await resp.read(), code)


@pytest.mark.parametrize("body,kind", [(b"null", "null"), (b"[1]", "an array"), (b'"hi"', "a string"),
                                       (b"true", "a boolean"), (b"7", "a number")])
async def test_a_body_that_is_not_an_object_is_named_in_json_terms(balancer_url, body, kind) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(balancer_url + "/v1/completions", data=body) as resp:
            assert resp.status == 400
            error = assert_openai_error(await resp.read(), "invalid_json")
            assert error["message"] == f"request body must be a JSON object, got {kind}"


async def test_chunked_body_over_limit_is_413(balancer_url) -> None:
    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    async with aiohttp.ClientSession() as http:
        async with http.post(balancer_url + "/v1/completions", data=chunks()) as resp:
            assert resp.status == 413
            assert_openai_error(await resp.read(), "request_too_large")


async def test_missing_content_type_is_read_as_json(balancer_url) -> None:
    async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as http:
        async with http.post(balancer_url + "/v1/completions", data=b'{"model": "stub-model", "prompt": "x"}') as resp:
            assert resp.status == 200
            assert (await resp.json())["object"] == "text_completion"


async def test_unknown_path_and_wrong_method(balancer_url) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(balancer_url + "/v1/nothing", json={}) as resp:
            assert resp.status == 404
            assert_openai_error(await resp.read(), "unknown_url")
        async with http.get(balancer_url + "/v1/chat/completions") as resp:
            assert resp.status == 405
            assert_openai_error(await resp.read(), "method_not_allowed")


async def test_huge_header_gets_431_in_openai_format(balancer_url) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(balancer_url + "/v1/completions", json={"model": "stub-model", "prompt": "x"},
                             headers={"X-Huge": "h" * 10_000}) as resp:
            assert resp.status == 431
            assert_openai_error(await resp.read(), "headers_too_large")


async def test_no_healthy_replica_is_503_with_retry_after() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    settings = make_settings(dead, health={"unhealthy_threshold": 1})
    async with run_balancer(settings) as running:
        async with aiohttp.ClientSession() as http:
            async with http.post(running.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 503
                assert int(resp.headers["Retry-After"]) > 0
                assert_openai_error(await resp.read(), "no_healthy_replica")
            async with http.get(running.url + "/ready") as resp:
                assert resp.status == 503


async def test_bad_requests_do_not_disturb_streams_in_flight() -> None:
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(slow_sse_app(seen, chunks=10, gap_s=0.05)))
        running = await stack.enter_async_context(run_balancer(make_settings([url], limits={"max_header_bytes": 2048})))
        async with aiohttp.ClientSession() as http:

            async def one_stream() -> bytes:
                async with http.post(running.url + "/v1/completions",
                                     json={"model": "m", "prompt": "p", "stream": True}) as resp:
                    return await resp.read()

            async def garbage() -> None:
                bad = [b"{", b"\xff", b"[]", b'{"prompt": 1}', b"x" * 100]
                for i in range(25):
                    async with http.post(running.url + "/v1/completions", data=bad[i % len(bad)]) as resp:
                        assert 400 <= resp.status < 500
                        await resp.read()
                    await asyncio.sleep(0.01)
                # A raw connection sending junk that is not HTTP at all.
                reader, writer = await asyncio.open_connection("127.0.0.1", int(running.url.rsplit(":", 1)[1]))
                writer.write(b"\x00\x01 NOT HTTP\r\n\r\n")
                await writer.drain()
                await reader.read()
                writer.close()

            results = await asyncio.gather(*(one_stream() for _ in range(5)), garbage())
        for raw in results[:5]:
            assert raw.count(b"data: {") == 10
            assert raw.endswith(b"data: [DONE]\n\n")


async def test_replica_max_concurrency_sends_work_to_replicas_with_room() -> None:
    hung = Seen()
    async with AsyncExitStack() as stack:
        slow = await stack.enter_async_context(serve_app(hanging_app(hung)))
        good = await stack.enter_async_context(serve_app(make_stub_app("good")))
        settings = make_settings(
            [{"url": slow, "name": "slow", "max_concurrency": 1}, {"url": good, "name": "good", "max_concurrency": 1}],
            policy={"name": "round_robin"},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            body = {"model": "stub-model", "prompt": "x"}
            # Round robin sends the first request to the hanging replica, which is then full.
            first = asyncio.create_task(http.post(running.url + "/v1/completions", json=body))
            while hung.requests == 0:
                await asyncio.sleep(0.01)
            for _ in range(3):  # every other request now goes to the replica with room
                async with http.post(running.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200 and resp.headers["x-kvlb-replica"] == "good"
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)



async def test_unexpected_error_is_500_naming_the_request_id_and_logged(caplog) -> None:
    class BrokenPolicy(Policy):
        name = "broken"

        def rank(self, request, replicas):
            raise RuntimeError("policy bug")

    async with serve_app(make_stub_app("a")) as replica:
        running = await start_balancer(make_settings([replica]), BrokenPolicy(), port=free_port())
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{running.port}/v1/completions",
                                     json={"model": "stub-model", "prompt": "x"},
                                     headers={"x-request-id": "req-500"}) as resp:
                    assert resp.status == 500
                    error = assert_openai_error(await resp.read(), "internal_error")
                    assert "req-500" in error["message"]
                # The balancer keeps serving.
                async with http.get(f"http://127.0.0.1:{running.port}/health") as resp:
                    assert resp.status == 200
        finally:
            await running.close(grace_s=0.5)
    assert any("req-500" in r.getMessage() and r.exc_info for r in caplog.records)
