"""Upstream servers with one behaviour each, for proxy tests: they show what reached them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass
class Seen:
    """What an upstream observed, for assertions."""

    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    requests: int = 0
    disconnected_at: list[float] = field(default_factory=list)


async def healthy(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def echo_app(seen: Seen) -> web.Application:
    """Answers with the exact bytes it received, and the headers as a JSON header."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.requests += 1
        seen.bodies.append(body)
        seen.headers.append(dict(request.headers))
        return web.Response(body=body, content_type="application/octet-stream",
                            headers={"x-upstream-custom": "kept", "x-seen-path": request.path_qs})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("POST", "/{tail:.*}", echo)
    app.router.add_get("/health", healthy)
    return app


def slow_sse_app(seen: Seen, *, chunks: int = 4, gap_s: float = 0.2, break_after: int | None = None) -> web.Application:
    """Streams `chunks` SSE events `gap_s` apart; with `break_after`, drops the connection."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.requests += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            if break_after is not None and i == break_after:
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(b"data: " + orjson.dumps({"i": i, "t": time.monotonic()}) + b"\n\n")
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", stream)
    app.router.add_get("/health", healthy)
    return app


def status_app(seen: Seen, status: int, retry_after: str | None = None) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.requests += 1
        headers = {"Retry-After": retry_after} if retry_after else None
        return web.json_response({"error": {"message": f"upstream says {status}", "type": "x", "code": None}},
                                 status=status, headers=headers)

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", answer)
    app.router.add_get("/health", healthy)
    return app


def hanging_app(seen: Seen) -> web.Application:
    """Never answers; records when the balancer closes the connection."""

    async def hang(request: web.Request) -> web.Response:
        await request.read()
        seen.requests += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.disconnected_at.append(time.monotonic())
            raise
        return web.Response()

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", hang)
    app.router.add_get("/health", healthy)
    return app


def endless_stream_app(seen: Seen, gap_s: float = 0.02) -> web.Application:
    """Streams SSE events forever; records when the balancer closes the connection."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.requests += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b'data: {"tick": 1}\n\n')
                await asyncio.sleep(gap_s)
        except (asyncio.CancelledError, ConnectionResetError):
            seen.disconnected_at.append(time.monotonic())
            raise

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", stream)
    app.router.add_get("/health", healthy)
    return app


def usage_reporting_app(*, natural_length: int = 20, token_gap_s: float = 0.0,
                        report_cached: bool = True,
                        first_token_s: Callable[[int], float] | None = None) -> web.Application:
    """A completions engine that counts one token per word and reports usage as vLLM does:
    `natural_length` tokens, or fewer when max_tokens says so, streamed `token_gap_s` apart,
    the usage chunk only when the client asked for it. Without `report_cached` it leaves out
    `prompt_tokens_details`, as vLLM does without --enable-prompt-tokens-details.
    `first_token_s(prompt tokens)`: how long its prefill takes before the first token."""

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bound = body.get("max_tokens")
        out = natural_length if bound is None else min(bound, natural_length)
        usage: dict = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": out}
        if first_token_s is not None:
            await asyncio.sleep(first_token_s(usage["prompt_tokens"]))
        if report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x " * out}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(out):
            await resp.write(b'data: {"choices": [{"text": "x "}]}\n\n')
            if token_gap_s:
                await asyncio.sleep(token_gap_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", healthy)
    return app


def ordered_app(order: list[str], hold_s: dict[str, float], default_s: float = 0.05) -> web.Application:
    """Answers each completion after a pause (its prompt's entry in `hold_s`), noting the
    order prompts arrived in."""

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        order.append(body["prompt"])
        await asyncio.sleep(hold_s.get(body["prompt"], default_s))
        return web.json_response({"id": "x", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", healthy)
    return app
