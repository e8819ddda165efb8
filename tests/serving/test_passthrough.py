"""Bytes pass through: the replica gets the client's body as sent, the client the replica's."""

from __future__ import annotations

import asyncio
import gzip
import time
from contextlib import AsyncExitStack

import aiohttp
import orjson
from aiohttp import web

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, echo_app, slow_sse_app


async def test_request_body_reaches_replica_byte_for_byte() -> None:
    seen = Seen()
    # Odd spacing, key order, unicode escapes and fields no OpenAI schema has: a proxy that
    # re-serialized would change every one of them.
    body = (b'{ "model" :"m",  "messages":[{"role":"user","content":"caf\\u00e9 \xe2\x9c\x93"}],'
            b'"chat_template_kwargs": {"enable_thinking": false}, "zzz": 1.50, "aaa": [ ] }')
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(echo_app(seen)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        async with aiohttp.ClientSession() as http:
            async with http.post(
                running.url + "/v1/chat/completions?trace=1",
                data=body,
                headers={"Content-Type": "application/json", "Authorization": "Bearer sk-test",
                         "X-Custom-Client": "yes", "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1",
                         "Proxy-Authorization": "secret"},
            ) as resp:
                echoed = await resp.read()
                assert resp.status == 200
                assert resp.headers["x-upstream-custom"] == "kept"
                assert resp.headers["x-seen-path"] == "/v1/chat/completions?trace=1"
                assert resp.headers["Content-Type"] == "application/octet-stream"
    assert seen.bodies == [body]
    assert echoed == body
    headers = {k.lower(): v for k, v in seen.headers[0].items()}
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["x-custom-client"] == "yes"
    assert headers["content-type"] == "application/json"
    assert "x-drop-me" not in headers  # named by Connection: hop-by-hop
    assert "proxy-authorization" not in headers
    assert len(headers["x-request-id"]) >= 16


async def test_compressed_response_passes_through_undecoded() -> None:
    payload = b'{"object": "list", "data": []}' * 50
    packed = gzip.compress(payload)

    async def gz(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=packed, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    app = web.Application()
    app.router.add_post("/v1/completions", gz)
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(app))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with http.post(running.url + "/v1/completions", json={"model": "m", "prompt": "p"}) as resp:
                assert resp.headers["Content-Encoding"] == "gzip"
                assert await resp.read() == packed


async def test_sse_chunks_are_relayed_as_they_arrive() -> None:
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(slow_sse_app(seen, chunks=4, gap_s=0.2)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        arrivals: list[float] = []
        raw = b""
        async with aiohttp.ClientSession() as http:
            async with http.post(running.url + "/v1/completions",
                                 json={"model": "m", "prompt": "p", "stream": True}) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                async for line in resp.content:
                    raw += line
                    if line.startswith(b"data: {"):
                        arrivals.append(time.monotonic())
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert [e["i"] for e in events] == [0, 1, 2, 3]
    assert raw.endswith(b"data: [DONE]\n\n")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert min(gaps) >= 0.18, gaps


async def test_broken_stream_ends_with_an_error_event_not_a_clean_finish() -> None:
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(slow_sse_app(seen, chunks=5, gap_s=0.01, break_after=2)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        async with aiohttp.ClientSession() as http:
            async with http.post(running.url + "/v1/chat/completions",
                                 json={"model": "m", "messages": [], "stream": True}) as resp:
                raw = await asyncio.wait_for(resp.read(), 5)
    lines = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert len(lines) == 3
    assert b"[DONE]" not in raw
    last = orjson.loads(lines[-1][6:])
    assert last["error"]["code"] == "stream_broken"
    assert seen.requests == 1  # started streams are never retried
