"""The balancer: routes, limits, error answers, and the lifecycle of one instance."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence

import aiohttp
import orjson

from balancer.config import ConfigError, Settings
from balancer.errors import JSON_HEADERS, ClientError
from balancer.logs import LOG_FIELDS
from balancer.ops.admin import PREFIX as ADMIN_PREFIX
from balancer.ops.admin import AdminApi
from balancer.protocol import ROUTE_HEADER, SESSION_HEADER
from balancer.routing.admission import AdmissionQueue
from balancer.routing.breaker import BreakerSettings
from balancer.routing.core import CoreSettings, RoutingCore
from balancer.routing.fleet import FULL, Fleet, Replica
from balancer.routing.precise import PreciseTracker, PromptTokens, RemotePrompt, load_prompt_tokens
from balancer.routing.request import parse_request
from balancer.routing.tokenizer import TokenizerError
from balancer.routing.tracker import CacheTracker
from balancer.serving.admission import Admission
from balancer.serving.auth import Authenticator, load_keys, replica_key
from balancer.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from balancer.serving.metrics import NO_REPLICA, Metrics
from balancer.serving.proxy import Outcome, Proxy, end_broken_response
from balancer.watchers.dns import DnsDiscovery, Resolver, system_resolver
from balancer.watchers.health import HealthChecker
from balancer.watchers.kv_events import KvEventsCollector, KvEventSubscriber
from balancer.watchers.models import ModelDiscovery
from balancer.watchers.sync import StateSync, SyncCollector
from balancer.wire.client import UpstreamPool
from balancer.wire.server import Answer, Headers, HttpServer, Request, ServerLimits
from policies.base import Choice, Policy
from policies.registry import make_policy

log = logging.getLogger("kvlb.server")
access_log = logging.getLogger("kvlb.access")

FORWARDED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate")
OTHER_ROUTE = "other"
# A client's request id travels to replicas, answers and log lines as given, so it must be
# text that cannot forge a log field or a header: anything else is replaced by kvlb's own.
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def safe_request_id(value: str | None) -> str | None:
    return value if value is not None and SAFE_REQUEST_ID.fullmatch(value) else None


def make_error_answer(id_header: str):  # noqa: ANN201
    def error_answer(status: int, message: str, code: str, request: Request | None) -> tuple[Headers, bytes]:
        """Answers for requests refused while being read (bad framing, limits), OpenAI-shaped."""
        headers = list(JSON_HEADERS)
        request_id = safe_request_id(request.header(id_header)) if request is not None else None
        headers.append((id_header, request_id or os.urandom(12).hex()))
        return headers, ClientError(status, message, code).body()

    return error_answer


class Balancer:
    """Everything one balancer instance owns: fleet, policy, metrics, connections to replicas."""

    def __init__(
        self, settings: Settings, policy: Policy | None = None, resolver: Resolver = system_resolver
    ) -> None:
        self.settings = settings
        health = settings.health
        self.fleet = Fleet(
            settings.replicas,
            BreakerSettings(
                health.eject_after_failures, health.ejection_base_s, health.ejection_max_s,
                health.success_rate_window_s, health.success_rate_min_requests,
                health.success_rate_min_clients, health.success_rate_threshold,
            ),
        )
        policy = policy or make_policy(settings.policy.name, settings.policy.params, settings.policy.seed)
        self.metrics = Metrics(self.fleet)
        self.auth = Authenticator(
            load_keys(settings.auth), settings.auth.rate_limit_per_s, settings.auth.rate_limit_burst
        )
        limits = settings.limits
        queue: AdmissionQueue[asyncio.Future[None]] = AdmissionQueue(limits.max_in_flight, limits.max_queued)
        self.admission = Admission(queue, limits.queue_timeout_s)
        self.pool = UpstreamPool(connect_timeout_s=settings.timeouts.connect_s)
        # Prefix hashing and the index cost CPU on every request: only for policies that use them.
        self.tracker: CacheTracker | None = None
        self.kv_events: KvEventSubscriber | None = None
        self.prompt_tokens: PromptTokens | None = None
        if policy.needs_prompt and settings.kv_events.enabled:
            # Loaded before serving, so a bad tokenizer directory stops start-up with its reason.
            try:
                self.prompt_tokens = load_prompt_tokens(settings.kv_events)
            except TokenizerError as exc:
                raise ConfigError([f"kv_events: {exc}"]) from None
            precise = self.tracker = PreciseTracker(settings.routing, settings.kv_events, time.monotonic)
            self.kv_events = KvEventSubscriber(precise.events, settings.kv_events.topic)
            self.metrics.index = precise.exact
            self.metrics.registry.register(KvEventsCollector(precise.events.stats))
        elif policy.needs_prompt:
            self.tracker = CacheTracker(settings.routing, time.monotonic)
            self.metrics.index = self.tracker.index
        routing = settings.routing
        self.core = RoutingCore(
            self.fleet, policy, self.tracker, queue,
            CoreSettings(settings.retries.max_attempts, routing.region, routing.forget_unhealthy_after_s),
            call_at=_call_at,
        )
        self.sync: StateSync | None = None
        if settings.sync.redis_url is not None:
            self.sync = StateSync(settings.sync, self.fleet, self.tracker)
            self.metrics.registry.register(SyncCollector(self.sync.stats))
        key = replica_key(settings.auth)
        self.proxy = Proxy(
            settings, self.metrics, self.pool, self.core,
            replica_authorization=f"Bearer {key}" if key else None,
        )
        self._region_header = routing.region_header
        self._allowed_header = routing.allowed_regions_header
        self._route_header = routing.route_header
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._discovery: ModelDiscovery | None = None
        self._health: HealthChecker | None = None
        self.admin = AdminApi(self)
        self.dns = DnsDiscovery(
            settings.replica_sets, self.fleet, resolver, on_added=self.joined, on_removed=self.left
        )
        self.config_path: str | None = None  # the file `kvlb serve --config` read, for reloads
        self._get_routes = {
            "/v1/models": self.models,
            "/health": self.health,
            "/ready": self.ready,
            "/metrics": self.metrics_page,
        }
        self._post_routes = frozenset(FORWARDED_ROUTES)
        # The routes that need a client key: checked on the request's head (admit_head).
        self._keyed_routes = frozenset((*FORWARDED_ROUTES, "/v1/models"))
        self._id_prefix = os.urandom(6).hex()
        self.draining = False
        self.access_log = settings.logging.access_log
        self._request_seq = 0
        # Shared with the HTTP servers and every connection, so a reload reaches them all.
        self.server_limits = ServerLimits(
            max_header_bytes=settings.limits.max_header_bytes,
            max_body_bytes=settings.limits.max_body_bytes,
        )
        _set_client_limits(self.server_limits, settings)

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.core.policy = policy

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (queued ones not included)."""
        return self.admission.in_flight

    def _new_request_id(self) -> str:
        # A random per-process prefix and a counter: unique without a syscall per request.
        self._request_seq += 1
        return f"{self._id_prefix}{self._request_seq:012x}"

    # lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # Health checks and model discovery are rare and use aiohttp's client; forwarding, the
        # hot path, uses the lean pool.
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        discovery = self._discovery = ModelDiscovery(
            self.fleet, self.settings.models, self.session,
            on_capacity=self.core.capacity_reported if self.tracker is not None else None,
        )
        health = self._health = HealthChecker(
            self.fleet, self.settings.health, self.session, on_change=self._health_changed
        )
        # One round before serving, so /v1/models and model routing know the fleet at once.
        await self.dns.refresh_once()
        await asyncio.gather(discovery.refresh_once(), health.check_once())
        self._tasks = [asyncio.create_task(discovery.run()), asyncio.create_task(health.run())]
        if self.settings.replica_sets:
            self._tasks.append(asyncio.create_task(self.dns.run()))
        if self.sync is not None:
            await self.sync.start()
        for replica in self.fleet.replicas:
            self._subscribe(replica)

    def _subscribe(self, replica: Replica) -> None:
        endpoint = replica.settings.kv_events_endpoint
        if self.kv_events is not None and endpoint is not None:
            self.kv_events.subscribe(replica.name, endpoint)

    async def stop(self) -> None:
        if self.sync is not None:
            await self.sync.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pool.close()
        if self.session is not None:
            await self.session.close()

    def apply_live(self, settings: Settings) -> None:
        """Take the sections that can change while serving (see balancer/ops/reload.py)."""
        self.settings = settings
        _set_client_limits(self.server_limits, settings)
        self.proxy.configure(settings)
        self.core.settings.max_attempts = settings.retries.max_attempts
        limits = settings.limits
        self.admission.queue.max_in_flight = limits.max_in_flight
        self.admission.queue.max_queued = limits.max_queued
        self.admission.queue_timeout_s = limits.queue_timeout_s
        if self._health is not None:
            self._health.settings = settings.health
        if self._discovery is not None:
            self._discovery.settings = settings.models
        self.access_log = settings.logging.access_log
        logging.getLogger().setLevel(settings.logging.level.upper())

    def joined(self, replica: Replica) -> None:
        self.core.joined(replica)
        self._subscribe(replica)
        if self._discovery is not None:
            asyncio.get_running_loop().create_task(self.discover(replica))

    def left(self, replica: Replica) -> None:
        """A replica left the fleet: nothing kept per replica may outlive it."""
        self.core.left(replica)
        if self.kv_events is not None:
            self.kv_events.unsubscribe(replica.name)
        if all(r.url != replica.url for r in self.fleet.replicas):
            self.pool.forget(replica.url)
        if self._health is not None:
            self._health.forget(replica.name)
        if replica.name not in self.fleet.by_name:
            self.metrics.forget_replica(replica.name)

    async def discover(self, replica: Replica) -> None:
        """Learn a replica's models (and KV capacity) now rather than at the next refresh."""
        if self._discovery is not None:
            await self._discovery.refresh_replica(replica)

    def _health_changed(self, replica: Replica, healthy: bool) -> None:
        if not healthy:
            self.core.went_out(replica, asyncio.get_running_loop().time())

    # dispatch ------------------------------------------------------------------------------

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
            headers.append((id_header, safe_request_id(request.header(id_header)) or self._new_request_id()))
            route = request.path if request.path in self._post_routes else OTHER_ROUTE
            self.metrics.observe_request(route, NO_REPLICA, exc.status, 0.0)
            return exc.status, headers, exc.body()
        if client is not None:
            request.client = client
        return None

    async def handle(self, request: Request) -> None:
        path = request.path
        if request.method == "POST" and path in self._post_routes:
            await self.forward(request, path)
            return
        if path.startswith(ADMIN_PREFIX) and self.admin.enabled and self.settings.admin.listen_port is None:
            self.admin.handle(request)
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

    async def handle_admin_listener(self, request: Request) -> None:
        """The separate admin address answers the admin API and nothing else."""
        if request.path.startswith(ADMIN_PREFIX):
            self.admin.handle(request)
        else:
            exc = ClientError(404, f"Invalid URL ({request.method} {request.path})", "unknown_url")
            request.respond(exc.status, exc.headers(), exc.body())

    # forwarded routes ----------------------------------------------------------------------

    async def forward(self, request: Request, route: str) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        id_header = self.settings.headers.request_id
        request_id = safe_request_id(request.header(id_header)) or self._new_request_id()
        outcome = Outcome()
        admitted = False
        try:
            async with asyncio.timeout(self.settings.timeouts.total_s):
                await self.admission.acquire()
                admitted = True
                await self._forward(request, route, request_id, outcome)
        except ClientError as exc:
            self._refuse(request, exc, request_id, outcome)
        except TimeoutError:
            if outcome.stream is not None:
                await end_broken_response(request, outcome, "the request exceeded timeouts.total_s")
            else:
                message = f"no answer within timeouts.total_s ({self.settings.timeouts.total_s} s)"
                self._refuse(request, ClientError(504, message, "timeout"), request_id, outcome)
        except asyncio.CancelledError:
            # The client went away; the upstream request was closed on the way out.
            outcome.status = 499
            self.metrics.count_disconnect(route)
            raise
        except Exception:
            log.exception("request %s: unexpected error", request_id)
            message = f"internal error in the balancer; request id {request_id}"
            if request.answered:
                request.abort()
                outcome.status = 500
            else:
                self._refuse(request, ClientError(500, message, "internal_error"), request_id, outcome)
        finally:
            if admitted:
                self.admission.release()
            elapsed = loop.time() - started
            ttft = None if outcome.first_byte_at is None else outcome.first_byte_at - started
            # A model no replica lists is the client's free text: kept out of the labels.
            model = self.fleet.model_label(outcome.model, loop.time())
            failover = outcome.answered and len(outcome.attempts) > 1
            self.metrics.observe_request(route, outcome.replica, outcome.status, elapsed, model, ttft, failover)
            if self.access_log and access_log.isEnabledFor(logging.INFO):
                log_access(request, route, request_id, outcome, elapsed, ttft)

    async def _candidates(self, model: str | None, allowed: frozenset[str] | None) -> list[Replica]:
        """The replicas that may take the request now; when every one is at its
        max_concurrency, wait (up to limits.queue_timeout_s) for one to free a slot."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.limits.queue_timeout_s
        while True:
            try:
                return self.core.candidates(model, allowed, loop.time())
            except ClientError as exc:
                if exc.code != FULL or loop.time() >= deadline:
                    raise
            try:
                await self.fleet.wait_for_room(deadline - loop.time())
            except TimeoutError:
                pass  # one last look, then the refusal from candidates()

    def _refuse(self, request: Request, exc: ClientError, request_id: str, outcome: Outcome) -> None:
        outcome.status = exc.status
        outcome.error = exc.code
        if exc.status != 502:
            outcome.replica = NO_REPLICA
        headers = exc.headers()
        headers.append((self.settings.headers.request_id, request_id))
        request.respond(exc.status, headers, exc.body())

    async def _forward(self, request: Request, route: str, request_id: str, outcome: Outcome) -> None:
        clock = time.perf_counter
        parse_began = clock()
        prompt_tokens = self.prompt_tokens
        features = parse_request(
            route, request.body, request.header(SESSION_HEADER), with_prompt=self.policy.needs_prompt,
            prompt_of=prompt_tokens.prompt_of if prompt_tokens is not None else None,
        )
        parse_s = clock() - parse_began
        outcome.model = features.model or ""
        allowed = request.header(self._allowed_header)
        candidates = await self._candidates(
            features.model, allowed_regions(allowed) if allowed is not None else None
        )
        prompt = features.prompt
        if isinstance(prompt, RemotePrompt):
            authorization = self.proxy.replica_authorization or request.header("authorization")
            prompt = await self._tokenize_remotely(prompt, candidates, authorization)
        rank_began = clock()
        journey = self.core.plan(route, features, prompt, candidates, request.header(self._region_header))
        self.metrics.observe_decision(route, parse_s + clock() - rank_began)
        ranking = journey.ranking
        explained = explain(ranking) if self._route_header or log.isEnabledFor(logging.DEBUG) else None
        if explained is not None:
            log.debug("request %s %s model %s: %s", request_id, route, features.model, explained)
        extra = [(ROUTE_HEADER, explained)] if self._route_header and explained else None
        await self.proxy.forward(request, journey, request_id, outcome, extra)

    async def _tokenize_remotely(
        self, body: bytes, candidates: Sequence[Replica], authorization: str | None
    ) -> list[int] | None:
        """Precise mode without a local tokenizer: the first candidate engine's /tokenize.
        Routing goes on without a prediction if it cannot answer in time."""
        if not candidates or self.session is None:
            return None
        replica = candidates[0]
        headers = {"content-type": "application/json"}
        if authorization is not None:
            headers["authorization"] = authorization
        try:
            async with self.session.post(
                replica.url + "/tokenize", data=bytes(body), headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.settings.kv_events.tokenize_timeout_s),
            ) as answer:
                if answer.status != 200:
                    return None
                tokens = orjson.loads(await answer.read()).get("tokens")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
            log.debug("tokenize on %s failed: %r", replica.name, exc)
            return None
        if isinstance(tokens, list) and all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
            return tokens
        return None

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


def _call_at(when: float, callback: Callable[[float], None]) -> None:
    loop = asyncio.get_running_loop()
    loop.call_at(when, lambda: callback(loop.time()))


def _set_client_limits(limits: ServerLimits, settings: Settings) -> None:
    """What the client-facing servers take from the live sections (timeouts, limits)."""
    timeouts = settings.timeouts
    limits.header_timeout_s = timeouts.client_head_s
    limits.body_timeout_s = timeouts.client_body_s
    limits.keepalive_timeout_s = timeouts.client_idle_s
    limits.write_timeout_s = timeouts.client_write_s
    limits.max_connections = settings.limits.max_connections
    limits.max_buffered_bytes = settings.limits.max_buffered_bytes


def log_access(
    request: Request, route: str, request_id: str, outcome: Outcome, elapsed: float, ttft: float | None
) -> None:
    """One line per forwarded request: text for people, and the same facts as separate keys
    (`extra`) for the JSON formatter. Token counts appear when the replica reported them."""
    tokens = outcome.tokens
    fields = {
        "request_id": request_id,
        "remote": request.remote,
        "method": request.method,
        "route": route,
        "model": outcome.model,
        "replica": outcome.replica,
        "status": outcome.status,
        "attempts": len(outcome.attempts),
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "duration_ms": round(elapsed * 1000, 1),
        "prompt_tokens": tokens.prompt if tokens is not None else None,
        "cached_tokens": tokens.cached if tokens is not None else None,
        "output_tokens": tokens.output if tokens is not None else None,
        "error": outcome.error or None,
    }
    model = outcome.model
    if not model.isprintable() or " " in model:
        model = ascii(model)  # the client's text: one line, one field
    access_log.info(
        "%s %s %s %d replica=%s model=%s attempts=%d ttft=%s duration=%.1fms "
        "prompt_tokens=%s cached_tokens=%s output_tokens=%s error=%s id=%s",
        request.remote, request.method, route, outcome.status, outcome.replica, model or "-",
        len(outcome.attempts), "-" if ttft is None else f"{ttft * 1000:.1f}ms", elapsed * 1000,
        _or_dash(fields["prompt_tokens"]), _or_dash(fields["cached_tokens"]),
        _or_dash(fields["output_tokens"]), outcome.error or "-", request_id,
        extra={LOG_FIELDS: fields},
    )


def _or_dash(value: int | None) -> int | str:
    return "-" if value is None else value


def allowed_regions(header: str) -> frozenset[str]:
    return frozenset(part.strip() for part in header.split(",") if part.strip())


def explain(ranking: Sequence[Choice]) -> str:
    """The decision in one line: the chosen replica's terms, then the runner-up's."""
    parts = []
    for label, choice in zip(("chosen", "next"), ranking[:2], strict=False):
        terms = " ".join(f"{k}={v:g}" for k, v in choice.terms.items())
        parts.append(f"{label}={choice.replica.name} {terms}".strip())
    return "; ".join(parts)


class RunningBalancer:
    """A started balancer: its port, its state, and how to stop it."""

    def __init__(self, balancer: Balancer, server: HttpServer, port: int,
                 admin_server: HttpServer | None = None, admin_port: int | None = None) -> None:
        self.balancer = balancer
        self.server = server
        self.port = port
        self.admin_server = admin_server
        self.admin_port = admin_port

    async def close(self, grace_s: float | None = None) -> None:
        """Stop accepting, let requests in flight finish (within `timeouts.drain_s` unless
        `grace_s` says otherwise), then stop. /ready answers 503 from the start, so a load
        balancer in front stops sending here."""
        self.balancer.draining = True
        await self.server.close(self.balancer.settings.timeouts.drain_s if grace_s is None else grace_s)
        if self.admin_server is not None:
            await self.admin_server.close(1.0)
        await self.balancer.stop()


async def start_balancer(
    settings: Settings,
    policy: Policy | None = None,
    *,
    port: int | None = None,
    resolver: Resolver = system_resolver,
    reuse_port: bool = False,
) -> RunningBalancer:
    """Start serving on the configured address (or `port`); returns once it accepts."""
    balancer = Balancer(settings, policy, resolver)
    limits = balancer.server_limits
    error_answer = make_error_answer(settings.headers.request_id)
    server = HttpServer(balancer.handle, error_answer, limits, admit=balancer.admit_head,
                        tcp_nodelay=settings.listen.tcp_nodelay)
    admin = settings.admin
    admin_server = None
    if admin.listen_port is not None and balancer.admin.enabled:
        admin_server = HttpServer(balancer.handle_admin_listener, error_answer, limits)
    await balancer.start()
    try:
        bound = await server.listen(
            settings.listen.host, settings.listen.port if port is None else port, reuse_port=reuse_port
        )
        admin_port = None
        if admin_server is not None:
            admin_port = await admin_server.listen(
                admin.listen_host or settings.listen.host, admin.listen_port, reuse_port=reuse_port
            )
    except BaseException:
        await server.close(0)
        await balancer.stop()
        raise
    return RunningBalancer(balancer, server, bound, admin_server, admin_port)

