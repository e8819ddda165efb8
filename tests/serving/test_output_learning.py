"""The predictive policy learns how long answers run from the replicas' usage, through kvlb."""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp
import orjson
from aiohttp import web

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import healthy

MODEL = "m"
NATURAL_LENGTH = 20  # what this model writes when nothing stops it


def engine_app() -> web.Application:
    """Answers with NATURAL_LENGTH tokens, or fewer when max_tokens says so."""

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bound = body.get("max_tokens")
        out = NATURAL_LENGTH if bound is None else min(bound, NATURAL_LENGTH)
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": out,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x " * out}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(out):
            await resp.write(b'data: {"choices": [{"text": "x "}]}\n\n')
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", healthy)
    return app


def expected_output(headers: dict) -> float:
    chosen = headers["x-kvlb-route"].split(";")[0]
    return float(next(t for t in chosen.split() if t.startswith("output_tokens=")).split("=")[1])


async def test_expected_output_is_learned_from_answers_that_ended_on_their_own() -> None:
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(engine_app()))
        settings = make_settings([{"url": url, "name": "r0", "model": MODEL}],
                                 policy={"name": "predictive"}, routing={"route_header": True})
        running = await stack.enter_async_context(run_balancer(settings))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def send(n: int, **extra) -> float:
            body = {"model": MODEL, "prompt": f"question {n} " * 50, **extra}
            async with http.post(running.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
                return expected_output(dict(resp.headers))

        # Answers cut at their max_tokens say nothing of how long the model would write.
        for n in range(6):
            assert await send(n, max_tokens=5) == 5
        assert await send(99) == 256  # default_output_tokens: nothing learned yet
        # Streamed with usage, and not streamed: both teach.
        seen = [await send(100 + n, stream=n % 2 == 0, stream_options={"include_usage": True}) for n in range(8)]
        assert seen[-1] == NATURAL_LENGTH
        # max_tokens still bounds what is expected.
        assert await send(200, max_tokens=8) == 8
