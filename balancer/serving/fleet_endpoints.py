"""The engines' own utility routes, answered for the fleet behind one address.

Benchmark clients reset the engines' prefix caches between runs (aiperf `--reset-kv-cache`
calls vLLM's `POST /reset_prefix_cache`; SGLang's name is `POST /flush_cache`), count
tokens (`/tokenize`, `/detokenize`) and ask what serves them (`/version`,
`/get_server_info`). Through a balancer, each must mean what the client means:

- a cache reset goes to every replica (those serving the body's `model` when it names
  one), at once, and kvlb forgets what it believed those replicas cached; the answer lists
  each replica's result: 200 when all succeeded, 502 `fleet_partial_failure` otherwise;
- `/tokenize` and `/detokenize` go, body unchanged, to the least loaded replica serving the
  body's model, and its answer comes back unchanged;
- `/version` and `/get_server_info` answer for kvlb: its version, its policy, and what it
  knows of each replica.

A cache reset empties caches everyone shares: with an admin token configured it needs that
token (as the admin API does); otherwise it is open like the rest of the client API, which
is what an engine without a balancer offers (docs/operations.md says so).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from balancer.errors import JSON_HEADERS, ClientError
from balancer.protocol import kvlb_version
from balancer.routing.core import RoutingCore
from balancer.routing.fleet import Replica
from balancer.wire.server import Request
from policies.base import MODEL_ITL_PARTS, MODEL_TTFT_PARTS

RESET_ROUTES = ("/reset_prefix_cache", "/flush_cache")
TOKEN_ROUTES = ("/tokenize", "/detokenize")
INFO_ROUTES = ("/version", "/get_server_info")
# A replica's answer to a reset, kept in kvlb's combined answer, is cut to this.
ANSWER_EXCERPT = 200
# Bodies of token routes are small; a larger one is refused before it is read twice.
MAX_TOKEN_BODY = 8 << 20


class FleetEndpoints:
    def __init__(self, core: RoutingCore, session: Callable[[], aiohttp.ClientSession | None],
                 timeout_s: float, replica_authorization: str | None,
                 admin_authorize: Callable[[str | None], None] | None, policy_name: Callable[[], str]) -> None:
        self.core = core
        self._session = session
        self.timeout_s = timeout_s
        self._authorization = replica_authorization
        self._admin_authorize = admin_authorize  # raises 401 unless the admin token is presented
        self._policy_name = policy_name

    @property
    def admin_protected(self) -> bool:
        return self._admin_authorize is not None

    async def handle(self, request: Request) -> None:
        try:
            status, headers, body = await self._answer(request)
        except ClientError as exc:
            status, headers, body = exc.status, exc.headers(), exc.body()
        request.respond(status, headers, body)

    async def _answer(self, request: Request) -> tuple[int, list[tuple[str, str]], bytes]:
        path, method = request.path, request.method
        if path in INFO_ROUTES:
            if method not in ("GET", "HEAD"):
                raise ClientError(405, f"method {method} is not allowed on {path}", "method_not_allowed")
            info = {"version": kvlb_version()} if path == "/version" else self._server_info()
            return 200, list(JSON_HEADERS), orjson.dumps(info)
        if method != "POST":
            raise ClientError(405, f"method {method} is not allowed on {path}", "method_not_allowed")
        if path in RESET_ROUTES:
            if self._admin_authorize is not None:
                self._admin_authorize(request.header("authorization"))
            return await self._reset(path, request.body)
        return await self._relay_token_route(path, request)

    # -- cache resets --------------------------------------------------------------------------

    async def _reset(self, path: str, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        model = _model_of(body)
        replicas = [r for r in self.core.fleet.replicas if model is None or r.serves(model)]
        if not replicas:
            raise ClientError(404, f"The model '{model}' does not exist or is not served by any replica",
                              "model_not_found", param="model")
        results = await asyncio.gather(*(self._reset_one(r, path, body) for r in replicas))
        for replica, result in zip(replicas, results, strict=True):
            if result["ok"]:
                self.core.cache_flushed(replica)
        failed = sum(not r["ok"] for r in results)
        answer = {"object": "fleet.cache_reset", "route": path, "succeeded": len(results) - failed,
                  "failed": failed, "replicas": results}
        if failed:
            answer["error"] = {"message": f"{failed} of {len(results)} replicas did not reset their cache",
                               "type": "upstream_error", "param": None, "code": "fleet_partial_failure"}
            return 502, list(JSON_HEADERS), orjson.dumps(answer)
        return 200, list(JSON_HEADERS), orjson.dumps(answer)

    async def _reset_one(self, replica: Replica, path: str, body: bytes) -> dict[str, Any]:
        outcome: dict[str, Any] = {"replica": replica.name}
        session = self._session()
        if session is None:
            return {**outcome, "ok": False, "error": "kvlb is starting"}
        try:
            async with asyncio.timeout(self.timeout_s):
                async with session.post(replica.url + path, data=body, headers=self._headers()) as resp:
                    text = (await resp.text(errors="replace"))[:ANSWER_EXCERPT]
                    return {**outcome, "ok": resp.status == 200, "status": resp.status, "answer": text}
        except TimeoutError:
            return {**outcome, "ok": False, "error": f"no answer within {self.timeout_s:g} s"}
        except (aiohttp.ClientError, OSError) as exc:
            return {**outcome, "ok": False, "error": f"{exc.__class__.__name__}: {exc}"}

    # -- token routes --------------------------------------------------------------------------

    async def _relay_token_route(self, path: str, request: Request) -> tuple[int, list[tuple[str, str]], bytes]:
        body = request.body
        if len(body) > MAX_TOKEN_BODY:
            raise ClientError(413, f"{path} bodies are limited to {MAX_TOKEN_BODY} bytes", "body_too_large")
        model = _model_of(body)
        loop = asyncio.get_running_loop()
        candidates = self.core.candidates(model, None, loop.time())  # raises 404/503 as routing does
        replica = min(candidates, key=lambda r: r.in_flight)
        session = self._session()
        if session is None:
            raise ClientError(503, "kvlb is starting", "starting", retry_after=1)
        try:
            async with asyncio.timeout(self.timeout_s):
                async with session.post(replica.url + path, data=body, headers=self._headers(request)) as resp:
                    answer = await resp.read()
                    kind = resp.headers.get("Content-Type", "application/json")
                    return resp.status, [("Content-Type", kind)], answer
        except TimeoutError:
            raise ClientError(504, f"replica {replica.name} did not answer {path} within {self.timeout_s:g} s",
                              "timeout", type_="upstream_error") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ClientError(502, f"replica {replica.name} failed {path}: {exc.__class__.__name__}",
                              "upstream_failed", type_="upstream_error") from None

    def _headers(self, request: Request | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        authorization = self._authorization or (request.header("authorization") if request is not None else None)
        if authorization:
            headers["Authorization"] = authorization
        return headers

    # -- about kvlb ----------------------------------------------------------------------------

    def _server_info(self) -> dict[str, Any]:
        replicas = []
        for r in self.core.fleet.replicas:
            replicas.append({
                "name": r.name, "url": r.url, "healthy": r.healthy, "draining": r.draining,
                "models": sorted(r.discovered_models or ()) or ([r.declared_model] if r.declared_model else []),
                "adapters": sorted(set(r.settings.adapters) | r.discovered_adapters),
                "labels": dict(r.labels), "weight": r.weight, "max_concurrency": r.max_concurrency,
                "kv_capacity_tokens": r.kv_capacity_tokens, "in_flight": r.in_flight,
                "prefill_tokens_queued": r.prefill_tokens_queued, "decoding": r.decoding,
                "ttft_scale": r.ttft_scale, "itl_scale": r.itl_scale,
                "ttft_terms": dict(zip(MODEL_TTFT_PARTS, r.ttft_terms_fit.shape, strict=True)),
                "ttft_terms_in_use": r.ttft_terms_fit.earned,
                "itl_terms": dict(zip(MODEL_ITL_PARTS, r.itl_terms_fit.shape, strict=True)),
                "itl_terms_in_use": r.itl_terms_fit.earned,
            })
        return {"server": "kvlb", "version": kvlb_version(), "policy": self._policy_name(), "replicas": replicas}


def _model_of(body: bytes) -> str | None:
    """The body's `model`, when it is a JSON object naming one; a reset may carry no body."""
    if not body.strip():
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ClientError(400, "the body must be JSON", "invalid_json") from None
    if not isinstance(data, dict):
        return None
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError(400, "'model' must be a string", "invalid_model", param="model")
    return model
