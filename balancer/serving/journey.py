"""One forwarded request's journey through kvlb: admission, parsing, the routing core's
decision, the proxy's attempts, then its metrics and access-log line."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

import aiohttp

from balancer.config import LABEL_NAME, Settings
from balancer.errors import ClientError
from balancer.protocol import (
    PRIORITY_HEADER,
    ROUTE_HEADER,
    SESSION_HEADER,
    TENANT_HEADER,
    TTFT_SLO_HEADER,
)
from balancer.routing.core import Journey, RoutingCore
from balancer.routing.disaggregation import has_roles, plan_split
from balancer.routing.fleet import FULL, Replica
from balancer.routing.flow import Ticket, with_target
from balancer.routing.precise import PromptTokens, RemotePrompt
from balancer.routing.request import parse_request
from balancer.serving.access_log import access_log, log_access
from balancer.serving.adapter_loader import AdapterLoader
from balancer.serving.admission import Admission
from balancer.serving.disaggregated import PairForwarder
from balancer.serving.flow import FlowGate
from balancer.serving.metrics import NO_REPLICA, Metrics
from balancer.serving.proxy import ADAPTER_NOT_LOADED, Outcome, Proxy, end_broken_response
from balancer.serving.request_ids import RequestIds
from balancer.serving.tokenize import tokenize_remotely
from balancer.serving.tracing import Tracing
from balancer.wire.server import Request
from policies.base import Choice, RequestFeatures

log = logging.getLogger("kvlb.server")


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        core: RoutingCore,
        admission: Admission,
        proxy: Proxy,
        metrics: Metrics,
        ids: RequestIds,
        prompt_tokens: PromptTokens | None,
        session: Callable[[], aiohttp.ClientSession | None],
        tenant_of: Callable[[str | None], str | None] = lambda identity: None,
        adapters: AdapterLoader | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.core = core
        self.flow = FlowGate(core.flow) if core.flow is not None else None
        self.tenant_of = tenant_of  # an API key's identity → its tenant
        self.adapters = adapters  # LoRA adapters loaded on demand
        self.tracing = tracing  # None: tracing off, and nothing of it on the path
        self.fleet = core.fleet
        self.admission = admission
        self.proxy = proxy
        self.pairs = PairForwarder(proxy)
        self.metrics = metrics
        self.ids = ids
        self.prompt_tokens = prompt_tokens
        self._session = session  # aiohttp's client, opened at start: for remote /tokenize
        routing = settings.routing
        self._region_header = routing.region_header
        self._allowed_header = routing.allowed_regions_header
        self._route_header = routing.route_header
        self.configure(settings)

    def configure(self, settings: Settings) -> None:
        self.settings = settings
        self.id_header = settings.headers.request_id
        self.access_log = settings.logging.access_log

    async def forward(self, request: Request, route: str) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request_id = self.ids.of(request, self.id_header)
        outcome = Outcome()
        if self.tracing is not None:
            outcome.trace = self.tracing.start(request, route, request_id)
        admitted = False
        counted_model: str | None = None  # its model has a bound of its own, and it counts
        ticket: Ticket | None = None
        try:
            async with asyncio.timeout(self.settings.timeouts.total_s):
                parse_began = time.perf_counter()
                prompt_tokens = self.prompt_tokens
                features = parse_request(
                    route, request.body, request.header(SESSION_HEADER), with_prompt=self.core.needs_prompt,
                    prompt_of=prompt_tokens.prompt_of if prompt_tokens is not None else None,
                )
                parse_s = time.perf_counter() - parse_began
                outcome.model = features.model or ""
                if self.core.model_limits:
                    counted_model = self.core.enter_model(features.model)
                if self.flow is not None:
                    ticket = self._ticket(request, features, started)
                    features = with_target(features, ticket)
                    if ticket.ttft_slo_s is not None and self.flow.flow.would_wait():
                        self._predict_ttft(request, route, features, ticket, started)
                    if not self.flow.try_enter(ticket, started):
                        await self.flow.wait(ticket)
                else:
                    await self.admission.acquire()
                    admitted = True
                await self._forward(request, route, request_id, outcome, features, parse_s, ticket)
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
            if counted_model is not None:
                self.core.leave_model(counted_model)
            ended = loop.time()
            elapsed = ended - started
            ttft = None if outcome.first_byte_at is None else outcome.first_byte_at - started
            if ticket is not None:
                gate = self.flow
                assert gate is not None
                woken = gate.flow.done(ticket, ended)
                if woken:
                    gate.wake(woken)
                if ticket.queued_s > 0 and ttft is not None and outcome.answered:
                    gate.flow.first_byte(ticket, ttft - ticket.queued_s)
                gate.metrics.observe(ticket, outcome.status, outcome.error, ttft)
            # A model no replica lists is the client's free text: kept out of the labels.
            model = self.fleet.model_label(outcome.model, loop.time())
            failover = outcome.answered and len(outcome.attempts) > 1
            self.metrics.observe_request(route, outcome.replica, outcome.status, elapsed, model, ttft, failover)
            if self.access_log and access_log.isEnabledFor(logging.INFO):
                log_access(request, route, request_id, outcome, elapsed, ttft, ticket)
            if outcome.trace is not None:
                outcome.trace.end(outcome.status, {"kvlb.replica": outcome.replica, "kvlb.model": outcome.model,
                                                   "kvlb.attempts": len(outcome.attempts)})

    def _ticket(self, request: Request, features: RequestFeatures, now: float) -> Ticket:
        """Who the request is for and how urgent it is: its key's tenant, or, behind a
        trusted gateway, the flow-control headers."""
        flow = self.core.flow
        assert flow is not None
        tenant = self.tenant_of(request.client)
        klass = slo_s = None
        if self.settings.flow_control.trust_headers:
            named = request.header(TENANT_HEADER)
            if named is not None:
                if not flow.known_tenant(named) and not LABEL_NAME.fullmatch(named):
                    raise ClientError(400, f"{TENANT_HEADER} must be 1 to 100 visible ASCII characters",
                                      "invalid_tenant", param=TENANT_HEADER)
                tenant = named
            klass = request.header(PRIORITY_HEADER)
            if klass is not None and klass not in flow.by_name:
                raise ClientError(400, f"{PRIORITY_HEADER}: unknown class {klass[:100]!r}; one of "
                                  + ", ".join(flow.by_name), "invalid_priority", param=PRIORITY_HEADER)
            target = request.header(TTFT_SLO_HEADER)
            if target is not None:
                slo_s = slo_seconds(target)
        return flow.ticket(tenant, klass, features.model, self.core.flow_cost(features, len(request.body)), slo_s, now)

    def _predict_ttft(self, request: Request, route: str, features: RequestFeatures, ticket: Ticket,
                      now: float) -> None:
        """A request with a target that must wait: its own time to first token once
        dispatched, as the policy predicts it, for flow control to judge the target by."""
        if ticket.ttft_after_s is not None or isinstance(features.prompt, RemotePrompt):
            return  # predicted already; or its tokens are a replica's to count, not worth a call
        allowed = request.header(self._allowed_header)
        ticket.ttft_after_s = self.core.predicted_ttft_s(
            route, features, features.prompt, allowed_regions(allowed) if allowed is not None else None, now,
            request.header(self._region_header))

    async def _candidates(self, request: Request, route: str, features: RequestFeatures,
                          allowed: frozenset[str] | None, ticket: Ticket | None) -> list[Replica]:
        """The replicas that may take the request now; when every one is at its
        max_concurrency, wait for one to free a slot: in flow control's queue, keeping its
        turn, or else up to limits.queue_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.limits.queue_timeout_s
        while True:
            try:
                return self.core.candidates(features.model, allowed, loop.time())
            except ClientError as exc:
                if exc.code != FULL:
                    raise
                if ticket is not None:
                    assert self.flow is not None
                    if ticket.ttft_slo_s is not None:
                        self._predict_ttft(request, route, features, ticket, loop.time())
                    await self.flow.saturated(ticket)
                    continue
                if loop.time() >= deadline:
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
        headers.append((self.id_header, request_id))
        request.respond(exc.status, headers, exc.body())

    async def _forward(self, request: Request, route: str, request_id: str, outcome: Outcome,
                       features: RequestFeatures, parse_s: float, ticket: Ticket | None) -> None:
        allowed = request.header(self._allowed_header)
        regions = allowed_regions(allowed) if allowed is not None else None
        adapters = self.adapters if self.adapters is not None and features.model in self.adapters else None
        earlier: list[str] = []
        while True:
            try:
                if adapters is not None:
                    await adapters.ensure(route, features, features.prompt, regions)
                journey, decode, extra = await self._place(request, route, request_id, outcome, features, parse_s,
                                                           ticket, regions)
            finally:
                if adapters is not None:
                    adapters.release(features.model)
            journey.attempts[:0] = earlier
            try:
                if decode is None:
                    await self.proxy.forward(request, journey, request_id, outcome, extra)
                else:
                    await self.pairs.forward(request, journey, decode, request_id, outcome, extra)
                return
            except ClientError as exc:
                # Every replica it went to had lost the adapter (a peer instance unloaded it
                # to make room, or an operator did), and nothing reached the client: one that
                # kvlb may load goes through the loader once more, to a replica holding it
                # still or one that loads it, rather than back to the client as a 503.
                if adapters is None or earlier or exc.code != ADAPTER_NOT_LOADED or request.answered:
                    raise
                earlier = list(journey.attempts)

    async def _place(self, request: Request, route: str, request_id: str, outcome: Outcome, features: RequestFeatures,
                     parse_s: float, ticket: Ticket | None, regions: frozenset[str] | None,
                     ) -> tuple[Journey, Journey | None, list[tuple[str, str]] | None]:
        candidates = await self._candidates(request, route, features, regions, ticket)
        prompt = features.prompt
        if isinstance(prompt, RemotePrompt):
            session = self._session()
            prompt = None
            if candidates and session is not None:
                authorization = self.proxy.replica_authorization or request.header("authorization")
                prompt = await tokenize_remotely(
                    session, candidates[0], features.prompt, authorization, self.settings.kv_events.tokenize_timeout_s
                )
        journey, decode, extra = self._decide(request, route, request_id, outcome, features, prompt, candidates,
                                              parse_s)
        if ticket is not None and ticket.reserved:
            assert self.core.flow is not None
            self.core.flow.placed(ticket)  # its first attempt takes the slot it was given
        return journey, decode, extra

    def _decide(self, request: Request, route: str, request_id: str, outcome: Outcome, features: RequestFeatures,
                prompt: str | Sequence[int] | None, candidates: Sequence[Replica],
                parse_s: float) -> tuple[Journey, Journey | None, list[tuple[str, str]] | None]:
        """The core's decision, timed, traced and explained: the journey, the decode half's
        when the request is split between a prefill and a decode replica (candidates with
        roles: balancer/routing/disaggregation.py), and the route header."""
        rank_began = time.perf_counter()
        origin = request.header(self._region_header)
        decode = None
        if self.fleet.has_roles and has_roles(candidates):
            plan = plan_split(self.core, route, features, prompt, candidates, self.settings.disaggregation, origin)
            self.metrics.disaggregation[plan.outcome] += 1
            journey, decode = plan.journey, plan.decode
        else:
            journey = self.core.plan(route, features, prompt, candidates, origin)
        self.metrics.observe_decision(route, parse_s + time.perf_counter() - rank_began)
        if outcome.trace is not None:
            outcome.trace.decision(features.model, len(candidates), journey.ranking)
        explained = explain(journey.ranking) if self._route_header or log.isEnabledFor(logging.DEBUG) else None
        if explained is not None and decode is not None:
            explained = f"prefill: {explained}; decode: {explain(decode.ranking)}"
        if explained is not None:
            log.debug("request %s %s model %s: %s", request_id, route, features.model, explained)
        return journey, decode, [(ROUTE_HEADER, explained)] if self._route_header and explained else None


def slo_seconds(header: str) -> float:
    try:
        ms = float(header)
    except ValueError:
        ms = math.nan
    if not (0 < ms <= 3_600_000):
        raise ClientError(400, f"{TTFT_SLO_HEADER} must be a number of milliseconds in (0, 3600000]",
                          "invalid_ttft_slo", param=TTFT_SLO_HEADER)
    return ms / 1000.0


def allowed_regions(header: str) -> frozenset[str]:
    return frozenset(part.strip() for part in header.split(",") if part.strip())


def explain(ranking: Sequence[Choice]) -> str:
    """The decision in one line: the chosen replica's terms, then the runner-up's."""
    parts = []
    for label, choice in zip(("chosen", "next"), ranking[:2], strict=False):
        terms = " ".join(f"{k}={v:g}" for k, v in choice.terms.items())
        parts.append(f"{label}={choice.replica.name} {terms}".strip())
    return "; ".join(parts)
