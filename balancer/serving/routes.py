"""Dispatch: which route a request takes, the key check on its head, and the routes kvlb
answers itself (`/v1/models`, `/health`, `/ready`, `/metrics`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson

from balancer.config import Settings
from balancer.errors import JSON_HEADERS, ClientError
from balancer.protocol import ADMIN_PREFIX, FORWARDED_ROUTES
from balancer.routing.fleet import Fleet
from balancer.serving.auth import Authenticator
from balancer.serving.fleet_endpoints import INFO_ROUTES, RESET_ROUTES, TOKEN_ROUTES, FleetEndpoints
from balancer.serving.journey import Forwarder
from balancer.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from balancer.serving.metrics import NO_REPLICA, Metrics
from balancer.serving.request_ids import RequestIds
from balancer.wire.server import Answer, Request

OTHER_ROUTE = "other"
AdminHandler = Callable[[Request], None]


class Routes:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        auth: Authenticator,
        metrics: Metrics,
        forwarder: Forwarder,
        ids: RequestIds,
        admin: AdminHandler | None,
        fleet_endpoints: FleetEndpoints | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.auth = auth
        self.metrics = metrics
        self.forwarder = forwarder
        self.ids = ids
        # The admin API, when it is on and shares the client address.
        self.admin = admin if settings.admin.listen_port is None else None
        self.draining = False  # /ready answers 503 from the start of a shutdown
        self._get_routes = {
            "/v1/models": self.models,
            "/health": self.health,
            "/ready": self.ready,
            "/metrics": self.metrics_page,
        }
        self._post_routes = frozenset(FORWARDED_ROUTES)
        # The engines' utility routes, answered for the whole fleet (serving/fleet_endpoints.py).
        self.fleet_endpoints = fleet_endpoints
        self._fleet_routes = frozenset((*RESET_ROUTES, *TOKEN_ROUTES, *INFO_ROUTES)) if fleet_endpoints else frozenset()
        # The routes that need a client key: checked on the request's head (admit_head). A
        # cache reset guarded by the admin token is checked against that token instead.
        keyed_fleet = [r for r in self._fleet_routes
                       if not (r in RESET_ROUTES and fleet_endpoints is not None and fleet_endpoints.admin_protected)]
        self._keyed_routes = frozenset((*FORWARDED_ROUTES, "/v1/models", *keyed_fleet))

    def configure(self, settings: Settings) -> None:
        self.settings = settings

    def admit_head(self, request: Request) -> Answer | None:
        """Key and rate limit, judged on the head alone: a client without a valid key costs
        no body buffering, no `100 Continue` and no admission slot."""
        if not self.auth.enabled or request.path not in self._keyed_routes:
            return None
        try:
            client = self.auth.check(request.header("authorization"), asyncio.get_running_loop().time())
        except ClientError as exc:
            headers = exc.headers()
            id_header = self.settings.headers.request_id
            headers.append((id_header, self.ids.of(request, id_header)))
            route = request.path if request.path in self._post_routes else OTHER_ROUTE
            self.metrics.observe_request(route, NO_REPLICA, exc.status, 0.0)
            return exc.status, headers, exc.body()
        if client is not None:
            request.client = client
        return None

    async def handle(self, request: Request) -> None:
        path = request.path
        if request.method == "POST" and path in self._post_routes:
            await self.forwarder.forward(request, path)
            return
        if self.admin is not None and path.startswith(ADMIN_PREFIX):
            self.admin(request)
            return
        if path in self._fleet_routes:
            assert self.fleet_endpoints is not None
            await self.fleet_endpoints.handle(request)
            return
        local = self._get_routes.get(path)
        if local is not None and request.method in ("GET", "HEAD"):
            local(request)
            return
        known = path in self._post_routes or local is not None
        exc = (
            ClientError(405, f"method {request.method} is not allowed on {path}", "method_not_allowed")
            if known
            else ClientError(404, f"Invalid URL ({request.method} {path})", "unknown_url")
        )
        request.respond(exc.status, exc.headers(), exc.body())
        self.metrics.observe_request(OTHER_ROUTE, NO_REPLICA, exc.status, 0.0)

    # local routes --------------------------------------------------------------------------

    def models(self, request: Request) -> None:
        # The key was checked on the head (admit_head).
        body = orjson.dumps({"object": "list", "data": self.fleet.model_cards()})
        request.respond(200, JSON_HEADERS, body)

    def health(self, request: Request) -> None:
        request.respond(200, JSON_HEADERS, b'{"status":"ok"}')

    def ready(self, request: Request) -> None:
        if self.draining:
            exc = ClientError(503, "shutting down", "draining", retry_after=1)
            request.respond(503, exc.headers(), exc.body())
            return
        counts = self.fleet.counts()
        if counts.healthy == 0:
            exc = ClientError(503, f"no healthy replica (0 of {counts.total})", "no_healthy_replica",
                              retry_after=5)
            request.respond(503, exc.headers(), exc.body())
            return
        body = {"status": "ready", "healthy_replicas": counts.healthy, "replicas": counts.total}
        request.respond(200, JSON_HEADERS, orjson.dumps(body))

    def metrics_page(self, request: Request) -> None:
        request.respond(200, [("Content-Type", METRICS_CONTENT_TYPE)], self.metrics.render())


def admin_only(admin: AdminHandler) -> Callable[[Request], object]:
    """The handler of a separate admin address: the admin API and nothing else."""

    async def handle(request: Request) -> None:
        if request.path.startswith(ADMIN_PREFIX):
            admin(request)
        else:
            exc = ClientError(404, f"Invalid URL ({request.method} {request.path})", "unknown_url")
            request.respond(exc.status, exc.headers(), exc.body())

    return handle
