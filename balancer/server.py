"""The balancer's HTTP face: routes, limits, error answers, and the app's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from http import HTTPStatus

import aiohttp
import orjson
from aiohttp import web, web_protocol
from aiohttp.http_exceptions import LineTooLong

from balancer.config import Settings
from balancer.discovery import ModelDiscovery
from balancer.errors import ClientError, error_body, error_response
from balancer.fleet import Fleet
from balancer.health import HealthChecker
from balancer.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from balancer.metrics import NO_REPLICA, Metrics
from balancer.proxy import Outcome, Proxy, end_broken_response
from balancer.upstream import UpstreamPool
from balancer.request import parse_request
from policies.base import Policy
from policies.registry import make_policy

log = logging.getLogger("kvlb.server")

FORWARDED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate")
KNOWN_PATHS = frozenset(FORWARDED_ROUTES) | {"/v1/models", "/health", "/ready", "/metrics"}
BALANCER_KEY = web.AppKey("balancer", "Balancer")


class Balancer:
    """Everything one balancer instance owns: fleet, policy, metrics, upstream session."""

    def __init__(self, settings: Settings, policy: Policy | None = None) -> None:
        self.settings = settings
        self.fleet = Fleet(settings.replicas)
        self.policy = policy or make_policy(
            settings.policy.name, settings.policy.params, settings.policy.seed
        )
        self.metrics = Metrics(self.fleet)
        self.in_flight = 0
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self.pool: UpstreamPool | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # lifecycle -----------------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # Health checks and discovery are rare and use aiohttp's client; forwarding, the hot
        # path, uses the lean pool.
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        self.pool = UpstreamPool(connect_timeout_s=self.settings.timeouts.connect_s)
        self.proxy = Proxy(self.settings, self.metrics, self.pool)
        discovery = ModelDiscovery(self.fleet, self.settings.models, self.session)
        health = HealthChecker(self.fleet, self.settings.health, self.session)
        # One round before serving, so /v1/models and model routing know the fleet at once.
        await asyncio.gather(discovery.refresh_once(), health.check_once())
        self._tasks = [asyncio.create_task(discovery.run()), asyncio.create_task(health.run())]

    async def stop(self, _app: web.Application | None = None) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.pool is not None:
            self.pool.close()
        if self.session is not None:
            await self.session.close()

    # forwarded routes ----------------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        id_header = self.settings.headers.request_id
        request_id = request.headers.get(id_header) or os.urandom(12).hex()
        route = request.path
        outcome = Outcome()
        self.in_flight += 1
        try:
            async with asyncio.timeout(self.settings.timeouts.total_s):
                response = await self._forward(request, route, request_id, outcome)
        except ClientError as exc:
            response = exc.response({id_header: request_id})
            outcome.status = exc.status
        except TimeoutError:
            if outcome.response is not None:
                await end_broken_response(request, outcome, "the request exceeded timeouts.total_s")
                response = outcome.response
            else:
                outcome.replica = NO_REPLICA
                outcome.status = 504
                response = error_response(
                    504,
                    f"no answer within timeouts.total_s ({self.settings.timeouts.total_s} s)",
                    code="timeout",
                    type_="upstream_error",
                    headers={id_header: request_id},
                )
        except asyncio.CancelledError:
            # The client went away; the upstream request was closed on the way out.
            outcome.status = 499
            self.metrics.disconnects.labels(route).inc()
            raise
        except Exception:
            log.exception("request %s: unexpected error", request_id)
            outcome.status = 500
            response = error_response(
                500,
                f"internal error in the balancer; request id {request_id}",
                code="internal_error",
                type_="server_error",
                headers={id_header: request_id},
            )
        finally:
            self.in_flight -= 1
            self.metrics.observe_request(route, outcome.replica, outcome.status, loop.time() - started)
        return response

    async def _forward(
        self, request: web.Request, route: str, request_id: str, outcome: Outcome
    ) -> web.StreamResponse:
        limit = self.settings.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request.content_length, limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, limit) from None
        features = parse_request(route, body, request.headers, with_prompt=self.policy.needs_prompt)
        if self.in_flight > self.settings.limits.max_in_flight:
            raise ClientError(
                503,
                "the balancer is at limits.max_in_flight; retry shortly",
                "overloaded",
                type_="service_unavailable",
                retry_after=1,
            )
        candidates = self.fleet.candidates(features.model)
        ranking = self.policy.rank(features, candidates)
        if log.isEnabledFor(logging.DEBUG):
            head = ranking[0]
            log.debug(
                "request %s route %s model %s -> %s %s (of %d)",
                request_id, route, features.model, head.replica.name, dict(head.terms), len(ranking),
            )
        assert self.proxy is not None
        return await self.proxy.forward(request, body, ranking, request_id, outcome)

    # local routes --------------------------------------------------------------------------

    async def models(self, _request: web.Request) -> web.Response:
        body = orjson.dumps({"object": "list", "data": self.fleet.model_cards()})
        return web.Response(body=body, content_type="application/json")

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def ready(self, _request: web.Request) -> web.Response:
        counts = self.fleet.counts()
        if counts.healthy == 0:
            return error_response(
                503,
                f"no healthy replica (0 of {counts.total})",
                code="no_healthy_replica",
                type_="service_unavailable",
                headers={"Retry-After": "5"},
            )
        body = {"status": "ready", "healthy_replicas": counts.healthy, "replicas": counts.total}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def not_found(self, request: web.Request) -> web.Response:
        if request.path in KNOWN_PATHS:
            return error_response(
                405,
                f"method {request.method} is not allowed on {request.path}",
                code="method_not_allowed",
            )
        return error_response(
            404, f"Invalid URL ({request.method} {request.path})", code="unknown_url"
        )


def _too_large(length: int | None, limit: int) -> ClientError:
    size = f"{length} bytes" if length is not None else "the request body"
    return ClientError(
        413, f"{size} exceeds limits.max_body_bytes ({limit} bytes)", "request_too_large"
    )


def build_app(settings: Settings, policy: Policy | None = None) -> web.Application:
    balancer = Balancer(settings, policy)
    app = web.Application(client_max_size=settings.limits.max_body_bytes)
    app[BALANCER_KEY] = balancer
    for route in FORWARDED_ROUTES:
        app.router.add_post(route, balancer.forward)
    app.router.add_get("/v1/models", balancer.models)
    app.router.add_get("/health", balancer.health)
    app.router.add_get("/ready", balancer.ready)
    app.router.add_get("/metrics", balancer.metrics_page)
    app.router.add_route("*", "/{tail:.*}", balancer.not_found)
    app.on_startup.append(balancer.start)
    app.on_cleanup.append(balancer.stop)
    return app


class _OpenAIErrorHandler(web_protocol.RequestHandler):
    """Answers requests aiohttp rejects before any handler runs (bad HTTP, oversized headers)
    in the OpenAI error format too."""

    def handle_error(self, request, status=500, exc=None, message=None):  # type: ignore[no-untyped-def]
        if status == 500:
            return super().handle_error(request, status, exc, message)
        code = "bad_request"
        if isinstance(exc, LineTooLong):
            status, code = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers_too_large"
        text = f"{HTTPStatus(status).phrase}: {message or exc or 'malformed HTTP request'}"
        resp = web.Response(status=status, body=error_body(text, "invalid_request_error", code),
                            content_type="application/json")
        resp.force_close()
        return resp


class _OpenAIErrorServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)


class BalancerRunner(web.AppRunner):
    """AppRunner with the balancer's connection settings: client disconnects cancel the
    handler (and so the upstream request), and low-level errors speak the OpenAI format."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        limit = settings.limits.max_header_bytes
        super().__init__(
            app,
            handler_cancellation=True,
            access_log=logging.getLogger("kvlb.access") if settings.logging.access_log else None,
            max_line_size=limit,
            max_field_size=limit,
            shutdown_timeout=10.0,
        )

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer
        return server


async def start_balancer(settings: Settings, policy: Policy | None = None) -> tuple[BalancerRunner, int]:
    """Start serving on the configured address; returns the runner and the bound port."""
    app = build_app(settings, policy)
    runner = BalancerRunner(app, settings)
    await runner.setup()
    site = web.TCPSite(runner, settings.listen.host, settings.listen.port, backlog=1024)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port
