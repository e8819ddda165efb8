"""The composition root: one balancer instance built from its settings, started and stopped.

Everything here is wiring. What a request goes through lives in `balancer.serving` (routes,
the journey, the proxy), what decides lives in `balancer.routing`, what watches the fleet in
`balancer.watchers`, and the admin API in `balancer.ops`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from balancer.config import ConfigError, Settings
from balancer.ops.admin import AdminApi
from balancer.routing.build import build_core
from balancer.routing.fleet import Replica
from balancer.routing.precise import PreciseTracker, PromptTokens, load_prompt_tokens
from balancer.routing.tokenizer import TokenizerError
from balancer.routing.tracker import CacheTracker
from balancer.serving.adapter_loader import AdapterLoader
from balancer.serving.admission import Admission
from balancer.serving.auth import authenticator, replica_key
from balancer.serving.fleet_endpoints import FleetEndpoints
from balancer.serving.gc_pauses import GcPauses
from balancer.serving.journey import Forwarder
from balancer.serving.metrics import Metrics
from balancer.serving.proxy import Proxy
from balancer.serving.request_ids import RequestIds, make_error_answer
from balancer.serving.routes import Routes, admin_only
from balancer.serving.tracing import Tracing
from balancer.watchers.dns import DnsDiscovery, Resolver, system_resolver
from balancer.watchers.flow_share import FlowShare
from balancer.watchers.health import HealthChecker
from balancer.watchers.kv_events import KvEventsCollector, KvEventSubscriber
from balancer.watchers.models import ModelWatcher
from balancer.watchers.sync import StateSync, SyncCollector
from balancer.wire.client import UpstreamPool
from balancer.wire.server import HttpServer, ServerLimits
from policies.base import Policy

log = logging.getLogger("kvlb.server")


class Balancer:
    """Everything one balancer instance owns: fleet, policy, metrics, connections to replicas."""

    def __init__(
        self, settings: Settings, policy: Policy | None = None, resolver: Resolver = system_resolver
    ) -> None:
        self.settings = settings
        self.core = build_core(settings, policy)
        self.fleet = self.core.fleet
        self.tracker: CacheTracker | None = self.core.tracker
        self.metrics = Metrics(self.fleet)
        self.gc_pauses = GcPauses()
        self.metrics.registry.register(self.gc_pauses)
        self.prompt_tokens: PromptTokens | None = None
        self.kv_events: KvEventSubscriber | None = None
        if isinstance(self.tracker, PreciseTracker):
            precise = self.tracker
            # Loaded before serving, so a bad tokenizer directory stops start-up with its reason.
            try:
                self.prompt_tokens = load_prompt_tokens(settings.kv_events)
            except TokenizerError as exc:
                raise ConfigError([f"kv_events: {exc}"]) from None
            self.kv_events = KvEventSubscriber(precise.events, settings.kv_events.topic)
            self.metrics.index = precise.exact
            self.metrics.registry.register(KvEventsCollector(precise.events.stats))
        elif self.tracker is not None:
            self.metrics.index = self.tracker.index
            self.metrics.token_ratio = self.tracker.ratio
            if self.tracker.answer_chars:
                self.metrics.answer_returns = self.tracker.answer_returns
        self.metrics.batch_persistence = self.core.batch_persistence
        self.auth = authenticator(settings.auth)
        self.admission = Admission(self.core.admission, settings.limits.queue_timeout_s)
        self.pool = UpstreamPool(connect_timeout_s=settings.timeouts.connect_s)
        self.sync: StateSync | None = None
        if settings.sync.redis_url is not None:
            self.sync = StateSync(settings.sync, self.fleet, self.tracker)
            self.metrics.registry.register(SyncCollector(self.sync.stats))
            if self.core.flow is not None:
                self.sync.flow_share = FlowShare(self.core.flow, self.sync)
        key = replica_key(settings.auth)
        self.proxy = Proxy(
            settings, self.metrics, self.pool, self.core,
            replica_authorization=f"Bearer {key}" if key else None,
        )
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._discovery: ModelWatcher | None = None
        # Listings asked for outside the refresh rounds, by replica name: at most one each.
        self._listing: dict[str, asyncio.Task[None]] = {}
        self._health: HealthChecker | None = None
        self.admin = AdminApi(self)
        self.dns = DnsDiscovery(
            settings.replica_sets, self.fleet, resolver, on_added=self.joined, on_removed=self.left
        )
        self.config_path: str | None = None  # the file `kvlb serve --config` read, for reloads
        ids = RequestIds()
        self.adapters = (AdapterLoader(settings.adapters, self.core, lambda: self.session,
                                       self.proxy.replica_authorization)
                         if settings.adapters.load_on_demand else None)
        self.tracing = Tracing(settings.tracing) if settings.tracing.otlp_endpoint else None
        self.forwarder = Forwarder(
            settings, self.core, self.admission, self.proxy, self.metrics, ids, self.prompt_tokens,
            lambda: self.session, self.auth.tenant_of, self.adapters, self.tracing,
        )
        if self.adapters is not None:
            self.metrics.registry.register(self.adapters)
        if self.forwarder.flow is not None:
            self.metrics.registry.register(self.forwarder.flow.metrics)
            if self.sync is not None and self.sync.flow_share is not None:
                self.sync.flow_share.on_room = self.forwarder.flow.room_freed
        self.fleet_endpoints = FleetEndpoints(
            self.core, lambda: self.session, min(settings.timeouts.first_byte_s, 30.0),
            self.proxy.replica_authorization, self.admin.authorize if self.admin.enabled else None,
            lambda: self.settings.policy.name,
        )
        self.routes = Routes(
            settings, self.fleet, self.auth, self.metrics, self.forwarder, ids,
            self.admin.handle if self.admin.enabled else None, self.fleet_endpoints,
        )
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
        """Requests admitted and not finished (queued ones not included), by flow control
        where it is on (it admits instead of the admission line)."""
        flow = self.core.flow
        return flow.in_flight if flow is not None else self.admission.in_flight

    @property
    def draining(self) -> bool:
        return self.routes.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.routes.draining = value

    # lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # Health checks and model discovery are rare and use aiohttp's client; forwarding, the
        # hot path, uses the lean pool.
        self.gc_pauses.start()
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        discovery = self._discovery = ModelWatcher(
            self.fleet, self.settings.models, self.session,
            on_capacity=self.core.capacity_reported if self.tracker is not None else None,
        )
        health = self._health = HealthChecker(
            self.fleet, self.settings.health, self.session, on_change=self._health_changed,
            on_answering=self._answering,
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
        self.gc_pauses.stop()
        if self.sync is not None:
            await self.sync.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        tasks = [*self._tasks, *self._listing.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pool.close()
        if self.session is not None:
            await self.session.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans still go out

    def apply_live(self, settings: Settings) -> None:
        """Take the sections that can change while serving (see balancer/ops/reload.py)."""
        self.settings = settings
        _set_client_limits(self.server_limits, settings)
        self.proxy.configure(settings)
        self.forwarder.configure(settings)
        self.routes.configure(settings)
        self.core.settings.max_attempts = settings.retries.max_attempts
        limits = settings.limits
        self.admission.queue.max_in_flight = limits.max_in_flight
        self.admission.queue.max_queued = limits.max_queued
        self.admission.queue_timeout_s = limits.queue_timeout_s
        flow = self.core.flow
        if flow is not None:
            flow.max_in_flight, flow.queue_timeout_s = limits.max_in_flight, limits.queue_timeout_s
            flow.max_queued = limits.max_queued
        if self._health is not None:
            self._health.settings = settings.health
        if self._discovery is not None:
            self._discovery.settings = settings.models
        logging.getLogger().setLevel(settings.logging.level.upper())

    def joined(self, replica: Replica) -> None:
        self.core.joined(replica)
        self._subscribe(replica)
        self._list_now(replica)

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

    def _list_now(self, replica: Replica) -> None:
        if self._discovery is None or replica.name in self._listing:
            return
        task = asyncio.get_running_loop().create_task(self.discover(replica))
        self._listing[replica.name] = task
        task.add_done_callback(lambda _: self._listing.pop(replica.name, None))

    def _answering(self, replica: Replica) -> None:
        if replica.discovered_models is None:
            # Still starting when kvlb did, or down since: never listed, so it is sent any
            # model until it is.
            self._list_now(replica)

    def _health_changed(self, replica: Replica, healthy: bool) -> None:
        if not healthy:
            self.core.went_out(replica, asyncio.get_running_loop().time())
            return
        # Back: what it serves may differ from what the refresh rounds last read (a restart
        # forgets adapters loaded at run time).
        self._list_now(replica)


def _set_client_limits(limits: ServerLimits, settings: Settings) -> None:
    """What the client-facing servers take from the live sections (timeouts, limits)."""
    timeouts = settings.timeouts
    limits.header_timeout_s = timeouts.client_head_s
    limits.body_timeout_s = timeouts.client_body_s
    limits.keepalive_timeout_s = timeouts.client_idle_s
    limits.write_timeout_s = timeouts.client_write_s
    limits.max_connections = settings.limits.max_connections
    limits.max_buffered_bytes = settings.limits.max_buffered_bytes


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
    routes = balancer.routes
    refusals = balancer.metrics.client_refusals
    server = HttpServer(routes.handle, error_answer, limits, admit=routes.admit_head,
                        tcp_nodelay=settings.listen.tcp_nodelay, refusals=refusals)
    admin = settings.admin
    admin_server = None
    if admin.listen_port is not None and balancer.admin.enabled:
        admin_server = HttpServer(admin_only(balancer.admin.handle), error_answer, limits, refusals=refusals)
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

