"""A minimal stand-in for an OpenAI-compatible engine: answers at once (or with a fixed delay
per token) and says which replica it is. For demos and proxy tests where no engine timing
matters; `kvlb replica` is the calibrated simulation."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import orjson
from aiohttp import web

WORDS = ("kv", "cache", "aware", "routing", "keeps", "prefixes", "warm")


def _completion_text(name: str, n_tokens: int) -> list[str]:
    return [f"[{name}]"] + [WORDS[i % len(WORDS)] for i in range(max(n_tokens - 1, 0))]


def make_stub_app(
    name: str,
    model: str = "stub-model",
    token_delay_s: float = 0.0,
    is_healthy: Callable[[], bool] = lambda: True,
) -> web.Application:
    served = {"requests": 0}

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    async def completion(request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": {"message": "bad json", "type": "invalid_request_error",
                                                "code": None}}, status=400)
        served["requests"] += 1
        chat = request.path.endswith("chat/completions")
        prompt = orjson.dumps(body.get("messages") if chat else body.get("prompt", ""))
        prompt_tokens = max(1, len(prompt.split()))
        words = _completion_text(name, int(body.get("max_tokens") or 8))
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{name}-{served['requests']}"
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            text = " ".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
            return web.json_response({
                "id": rid, "object": obj, "created": created, "model": body.get("model", model),
                "choices": [choice], "usage": usage(prompt_tokens, len(words)),
            })
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, word in enumerate(words):
            if token_delay_s:
                await asyncio.sleep(token_delay_s)
            piece = word if i == 0 else " " + word
            last = i == len(words) - 1
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": "length" if last else None}
                      if chat else {"index": 0, "text": piece, "finish_reason": "length" if last else None})
            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                     "model": body.get("model", model), "choices": [choice]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                     "model": body.get("model", model), "choices": [], "usage": usage(prompt_tokens, len(words))}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        served["requests"] += 1
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, float(len(str(x)))]}
                for i, x in enumerate(inputs)]
        return web.json_response({"object": "list", "data": data, "model": body.get("model", model),
                                  "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        served["requests"] += 1
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 8)
        return web.json_response({"text": " ".join(_completion_text(name, n)),
                                  "meta_info": {"prompt_tokens": len(str(body.get("text", "")).split()),
                                                "completion_tokens": n, "cached_tokens": 0}})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": name}]})

    async def health(_request: web.Request) -> web.Response:
        ok = is_healthy()
        return web.json_response({"status": "ok" if ok else "unhealthy"}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def _run(args: argparse.Namespace) -> int:
    import uvloop

    app = make_stub_app(args.name or f"stub-{args.port}", args.model, args.token_delay_ms / 1000)
    uvloop.run(web._run_app(app, host=args.host, port=args.port, print=None, access_log=None))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("stub-replica", help="a minimal OpenAI-compatible stand-in replica")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name")
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.set_defaults(func=_run)
