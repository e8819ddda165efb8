"""The offline fleet simulator: a workload through kvlb's routing onto virtual replicas.

No HTTP and no sleeping: events run in virtual (model) time, so an hour of traffic takes
seconds to minutes. What decides a request's fate is the same code as in `kvlb serve`:
- the request body is built and parsed by `balancer.routing.request.parse_request`;
- everything else the balancer decides is `balancer.routing.core.RoutingCore`, driven step
  by step as the proxy drives it: the admission line (`limits`), candidates, prediction and
  ranking, each attempt (failing over on a replica's 503 as the proxy does), the first token,
  the usage learned at the end of the stream, the end of the attempt. The simulator only
  supplies virtual time and the events;
- each replica is `loadtest.replica.engine.Engine` with its prefix cache, fed the tokens
  the simulated replica's own parser makes of the same body.

Precise mode (`precise=True`, cache-aware policies only) routes as `kvlb serve` does with
`kv_events` enabled: `balancer.routing.precise.PreciseTracker` predicts from the prompt's token ids
(those of the words the engine is fed) and its exact index follows each engine's cache
through `balancer.routing.kv_events.KvEventIndex`. Each engine's prefix cache reports its changes to a
listener, and the changes of one engine call go to the balancer as one message once the
iteration that made them has ended, plus the one-way delay, as the live replica publishes
them (`loadtest/replica/kv_events.py`). A planned run of plain decodes would publish only
when applied; so before each routing decision the iterations of every planned run that have
ended (one-way delay included) are applied and published, and the balancer knows what it would
have known had each iteration been stepped.

Speed: between two events that change a replica's batch, its iterations are plain decodes
whose durations follow from the batch alone, so they are applied in one step
(`Engine.decode_run`), and cut short when a request arrives in the middle.

The one-way network delay to a replica is half its round trip: the request reaches the
engine that much after it left the balancer, and each token that much after the engine made it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from balancer.config import (
    DisaggregationSettings,
    KvEventsSettings,
    Limits,
    ModelSettings,
    PolicySettings,
    ReplicaSettings,
    RoutingSettings,
    Settings,
)
from balancer.errors import ClientError
from balancer.routing.admission import AdmissionQueue
from balancer.routing.build import flow_controller, per_model_routing
from balancer.routing.core import PREFILLING, CoreSettings, Journey, RoutingCore
from balancer.routing.disaggregation import has_roles, link_gbps, plan_split, transfer_ms
from balancer.routing.fleet import FULL, Fleet, Replica
from balancer.routing.flow import with_target
from balancer.routing.kv_events import Cleared, Event, KvEventIndex, Removed, Stored
from balancer.routing.precise import PreciseTracker
from balancer.routing.request import parse_request
from balancer.routing.tracker import CacheTracker, Routed
from loadtest.client.summary import RequestRecord
from loadtest.client.workloads import ROUTE_CHAT, WorkRequest
from loadtest.replica.engine import (
    ContextLengthError,
    Engine,
    EngineConfig,
    EngineSequence,
    QueueFullError,
    Status,
)
from loadtest.replica.kv_events import MEDIUM
from loadtest.replica.parsing import ApiError, GenerationRequest, parse_chat, parse_completion
from loadtest.replica.tokens import output_text, word_token_id
from loadtest.simulator.fleetspec import FleetPlan
from loadtest.simulator.flow import SimulatedFlow
from policies.base import Policy, RequestFeatures
from policies.registry import make_policy

MODEL = "sim-model"
# Event kinds, in the order they run when they fall on the same instant: KV events the
# balancer receives first (so nothing at that instant routes without them, and a batch applied
# at once by a step is never overtaken by an earlier one still queued); a replica's iteration
# end before the arrivals it may have made room for; the core's timers and admission deadlines
# last.
KV_EVENTS, STEP, FIRST_TOKEN, FINISH, ARRIVE, REACH, TIMER, QUEUE_TIMEOUT, ROOM_TIMEOUT = range(9)
# Distinct words whose token ids are remembered; past it, the memory starts over.
MAX_REMEMBERED_WORDS = 1_000_000


@functools.lru_cache(maxsize=256)
def answer_text(tokens: int, chars: int) -> str:
    """What the simulated replica writes for an answer of `tokens` tokens, its first `chars`."""
    return output_text(tokens)[:chars]


class TokenIds(dict[str, int]):
    """`tokens.token_ids`, remembering each word's id: prompts draw on a small vocabulary,
    and hashing every word of every prompt and stored block anew was most of precise
    mode's cost on long-prompt traces."""

    def __missing__(self, word: str) -> int:
        if len(self) >= MAX_REMEMBERED_WORDS:
            self.clear()
        token_id = self[word] = word_token_id(word)
        return token_id

    def of(self, words: Sequence[str]) -> list[int]:
        return list(map(self.__getitem__, words))


class KvEventRecorder:
    """An engine's cache listener in precise mode: gathers the events of one engine call,
    in the shape the balancer decodes from the live replica's messages."""

    __slots__ = ("block_size", "events", "token_ids")

    def __init__(self, block_size: int, token_ids: TokenIds) -> None:
        self.block_size = block_size
        self.token_ids = token_ids
        self.events: list[Event] = []

    def blocks_stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[str],
                      adapter: str | None = None) -> None:
        # An adapter's blocks name it, as newer vLLM's do (its engine-local id is of no use here).
        self.events.append(Stored(list(hashes), parent, self.token_ids.of(tokens), self.block_size, None, MEDIUM,
                                  adapter))

    def block_removed(self, block_hash: int) -> None:
        # Evictions come in runs (one allocation evicts many blocks): one event for the run,
        # as engines may send, rather than an object per block.
        events = self.events
        if events and isinstance(last := events[-1], Removed):
            last.block_hashes.append(block_hash)
        else:
            events.append(Removed([block_hash], MEDIUM))

    def all_cleared(self) -> None:
        self.events.append(Cleared())

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


@dataclass(slots=True)
class Flight:
    """One request from arrival at the balancer to its last token at the client."""

    request: WorkRequest
    journey: Journey | None = None
    replica: Replica | None = None
    seq: EngineSequence | None = None
    node: VirtualReplica | None = None
    # Disaggregated: the decode half, waiting while `journey` is the prefill half; then the
    # prefill replica's cache hit, which is the request's, and that its KV is transferred.
    decode: Journey | None = None
    prefill_cached: int = 0
    transferred: bool = False
    parsed: GenerationRequest | None = None


@dataclass(slots=True)
class VirtualReplica:
    replica: Replica
    engine: Engine
    one_way_s: float
    version: int = 0  # bumps when its pending step is replaced
    step_pending: bool = False
    # A planned run of plain decode iterations not yet applied: (start, iterations, end).
    run: tuple[float, int, float] | None = None
    flights: dict[int, Flight] = field(default_factory=dict)  # engine seq_id -> flight
    recorder: KvEventRecorder | None = None  # precise mode only
    kv_sequence: int = 0  # the next KV event message's number


@dataclass(slots=True)
class SimulationResult:
    records: list[RequestRecord]
    duration_s: float
    replicas: list[str]
    iterations: int
    decode_runs: int
    events: int
    block_size: int = 16  # the engines' KV block size in tokens
    precise: bool = False  # routed on the engines' KV events
    adapter_loads: int = 0  # LoRA adapters the engines loaded into a slot


class Simulator:
    def __init__(
        self,
        fleet: FleetPlan,
        policy: PolicySettings,
        routing: RoutingSettings | None = None,
        max_attempts: int = 3,
        decode_runs: bool = True,
        precise: bool = False,
        limits: Limits | None = None,
        flow: Settings | None = None,
        disaggregation: DisaggregationSettings | None = None,
        per_model: Sequence[ModelSettings] = (),
    ) -> None:
        """`flow`: settings whose `flow_control` (with `auth.tenants` and `limits`) runs, as
        `kvlb serve` runs it; its limits then replace `limits`. `disaggregation`: how a fleet
        with prefill and decode roles splits requests, as `kvlb serve`'s section of that name.
        `per_model`: models with a policy or a bound of their own, as `kvlb serve`'s."""
        self.disaggregation = disaggregation or DisaggregationSettings()
        self.decode_runs_enabled = decode_runs
        self.now = 0.0
        self.routing = routing or RoutingSettings()
        self.policy: Policy = make_policy(policy.name, policy.params, policy.seed)
        model_policies, model_limits = per_model_routing(per_model)
        self.needs_prompt = self.policy.needs_prompt or any(p.needs_prompt for p in model_policies.values())
        settings = [
            ReplicaSettings(
                url=f"http://sim.invalid/{plan.name}", name=plan.name, model=plan.model or MODEL,
                labels=dict(plan.labels), weight=plan.weight, max_concurrency=plan.max_concurrency,
                # kvlb configured as its engine was started: the same slots and load time.
                max_loras=max(plan.max_loras, 1), lora_load_ms=plan.lora_load_ms, role=plan.role,
            )
            for plan in fleet.replicas
        ]
        self.fleet = fleet_ = Fleet(settings)
        engines = [
            Engine(EngineConfig(
                profile=plan.profile, kv_capacity_tokens=plan.kv_capacity_tokens,
                max_running=plan.max_running, max_batched_tokens=plan.max_batched_tokens,
                context_limit=plan.context_limit, max_loras=plan.max_loras, lora_load_s=plan.lora_load_ms / 1000.0,
            ))
            for plan in fleet.replicas
        ]
        self._lora_replicas = [r for r, plan in zip(fleet_.replicas, fleet.replicas, strict=True) if plan.max_loras]
        self.block_size = max((engine.block_size for engine in engines), default=16)
        self.tracker: CacheTracker | None = None
        # Precise mode's event intake; None when routing predicts (or needs no prompt).
        self.kv_events: KvEventIndex | None = None
        if self.needs_prompt and precise:
            if any(engine.block_size != self.block_size for engine in engines):
                # The exact index hashes one block size; other replicas' events would be ignored.
                raise ValueError("precise mode needs the same KV block size on every replica")
            kv_settings = KvEventsSettings(enabled=True, block_size=self.block_size)
            tracker = PreciseTracker(self.routing, kv_settings, lambda: self.now)
            self.tracker, self.kv_events = tracker, tracker.events
        elif self.needs_prompt:
            self.tracker = CacheTracker(self.routing, lambda: self.now)
        self.region = fleet.region or self.routing.region
        self.limits = flow.limits if flow is not None else limits or Limits()
        self.admission: AdmissionQueue[WorkRequest] = AdmissionQueue(
            self.limits.max_in_flight, self.limits.max_queued
        )
        self.core = RoutingCore(
            fleet_, self.policy, self.tracker, self.admission,
            CoreSettings(max_attempts, self.region, self.routing.forget_unhealthy_after_s),
            call_at=self._call_at, flow=flow_controller(flow, fleet_) if flow is not None else None,
            model_policies=model_policies, model_limits=model_limits,
        )
        self.flow = SimulatedFlow(self, QUEUE_TIMEOUT) if self.core.flow is not None else None
        # Without flow control, requests that found every replica at its max_concurrency wait
        # here, holding their admission slot, as the proxy's do (`Fleet.wait_for_room`).
        self._room_line: deque[WorkRequest] = deque()
        # Each request's body and its parse, made once (flow control prices a request before
        # it is routed), until its record is written.
        self._bodies: dict[int, tuple[dict[str, Any], bytes, RequestFeatures]] = {}
        # The `per_model` entry each request in flight counts against, until its record.
        self._counted: dict[int, str] = {}
        self.token_ids = TokenIds()
        self.nodes: dict[str, VirtualReplica] = {}
        for plan, replica, engine in zip(fleet.replicas, self.fleet.replicas, engines, strict=True):
            node = self.nodes[replica.name] = VirtualReplica(replica, engine, plan.round_trip_s / 2)
            if self.kv_events is not None:
                node.recorder = KvEventRecorder(engine.block_size, self.token_ids)
                engine.set_cache_listener(node.recorder)
            # As `kvlb serve` learns it from each replica's /get_server_info.
            self.core.capacity_reported(replica, engine.cache.capacity_tokens)
        self._events: list[tuple[float, int, int, Any, int]] = []
        self._order = itertools.count()
        self.records: dict[int, RequestRecord] = {}
        self.decode_runs = 0
        self.events = 0

    # -- the event queue ---------------------------------------------------------------------

    def _at(self, time: float, kind: int, subject: Any, version: int = 0) -> None:
        heapq.heappush(self._events, (time, kind, next(self._order), subject, version))

    def run(self, requests: Iterable[WorkRequest], progress: Callable[[int], None] | None = None) -> SimulationResult:
        pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        # Each adapter the workload names, with the base model its requests name (None: any).
        bases: dict[str, set[str | None]] = {}
        for r in pending:
            if r.adapter is not None:
                bases.setdefault(r.adapter, set()).add(r.model)
        if bases and self._lora_replicas:
            # Replicas with adapter slots serve every adapter of the model they serve (an
            # adapter whose requests name no model, every one), and say so as engines do: in
            # their model listing, with a parent.
            for replica in self._lora_replicas:
                served = sorted(adapter for adapter, models in bases.items()
                                if None in models or replica.declared_model in models)
                replica.discovered_adapters = frozenset(served)
                replica.model_cards = tuple({"id": adapter, "object": "model", "parent": replica.declared_model}
                                            for adapter in served)
            self.fleet.refresh_adapters()
        events = self._events
        handlers = {
            KV_EVENTS: self._deliver, STEP: self._step, FIRST_TOKEN: self._first_token, FINISH: self._finish,
            ARRIVE: self._arrive, REACH: self._reach, TIMER: self._timer, QUEUE_TIMEOUT: self._queue_timeout,
            ROOM_TIMEOUT: self._room_timeout,
        }
        pop = heapq.heappop
        done_before = 0
        # Arrivals are read from the sorted workload as their turn comes rather than queued
        # up front: a heap of an hour's requests makes every other event dearer.
        arrivals = iter(pending)
        upcoming = next(arrivals, None)
        while events or upcoming is not None:
            if upcoming is not None and (
                not events or (upcoming.arrival_s, ARRIVE) <= (events[0][0], events[0][1])
            ):
                self.now = upcoming.arrival_s
                self._arrive(upcoming, 0)
                upcoming = next(arrivals, None)
            else:
                time, kind, _, subject, version = pop(events)
                self.now = time
                handlers[kind](subject, version)
            self.events += 1
            if progress is not None and len(self.records) != done_before:
                done_before = len(self.records)
                progress(done_before)
        records = [self.records[r.index] for r in pending]
        end = max((r.send_s + (r.e2e_s or 0.0) for r in records), default=0.0)
        start = min((r.send_s for r in records), default=0.0)
        iterations = sum(node.engine.counters.iterations for node in self.nodes.values())
        return SimulationResult(
            records, end - start, list(self.nodes), iterations, self.decode_runs, self.events,
            self.block_size, self.kv_events is not None,
            sum(node.engine.counters.lora_loads for node in self.nodes.values()),
        )

    # -- the balancer side ---------------------------------------------------------------

    def _call_at(self, when: float, callback: Callable[[float], None]) -> None:
        self._at(max(when, self.now), TIMER, callback)

    def _timer(self, callback: Callable[[float], None], _version: int) -> None:
        callback(self.now)

    def _arrive(self, request: WorkRequest, _version: int) -> None:
        """The balancer's admission line (or flow control) first, as in `kvlb serve`, after
        its model's own bound where `per_model` gives one."""
        if self.core.model_limits:
            try:
                counted = self.core.enter_model(self.prepared(request)[2].model)
            except ClientError as exc:
                self._record_error(request, exc.status, exc.message)
                return
            if counted is not None:
                self._counted[request.index] = counted
        if self.flow is not None:
            self.flow.arrive(request)
            return
        try:
            admitted = self.admission.try_enter()
        except ClientError as exc:
            self._record_error(request, exc.status, exc.message)
            return
        if admitted:
            self._route(request)
        else:
            self.admission.join(request)
            self._at(self.now + self.limits.queue_timeout_s, QUEUE_TIMEOUT, request)

    def _queue_timeout(self, request: WorkRequest, _version: int) -> None:
        if self.flow is not None:
            self.flow.expire(request)
        elif self.admission.withdraw(request):
            exc = self.admission.timed_out(self.limits.queue_timeout_s)
            self._record_error(request, exc.status, exc.message)

    def _room_timeout(self, request: WorkRequest, _version: int) -> None:
        try:
            self._room_line.remove(request)
        except ValueError:
            return  # it found room meanwhile
        self._record_error(request, 429, "every replica is at its max_concurrency; retry shortly")
        self._leave(request)

    def _leave(self, request: WorkRequest) -> None:
        """An admitted request is done: its slot goes to the next in line."""
        if self.flow is not None:
            self.flow.leave(request)
            return
        if self._room_line:
            # Room on a replica, most likely: the longest waiter for it looks first.
            self._route(self._room_line.popleft(), waited=True)
        waiter = self.admission.hand_over()
        if waiter is not None:
            self._route(waiter)

    def prepared(self, request: WorkRequest) -> tuple[dict[str, Any], bytes, RequestFeatures]:
        """The body `kvlb serve` would receive for `request`, and kvlb's parse of it (with its
        flow-control target, once it has a ticket, as the proxy's). Raises the parser's
        ClientError."""
        prepared = self._bodies.get(request.index)
        if prepared is None:
            payload = request.payload(MODEL, stream=True)
            body = orjson.dumps(payload)
            features = parse_request(request.route, body, request.session, with_prompt=self.needs_prompt)
            prepared = self._bodies[request.index] = (payload, body, features)
        if self.flow is not None:
            ticket = self.flow.tickets.get(request.index)
            if ticket is not None and (targeted := with_target(prepared[2], ticket)) is not prepared[2]:
                prepared = self._bodies[request.index] = (prepared[0], prepared[1], targeted)
        return prepared

    def predicted_ttft_s(self, request: WorkRequest) -> float | None:
        """The policy's prediction of the request's time to first token, as flow control
        asks `kvlb serve` for it when a request with a target must wait."""
        payload, _, features = self.prepared(request)
        prompt = features.prompt
        if self.kv_events is not None and prompt is not None:
            try:
                parsed = (parse_chat if request.route == ROUTE_CHAT else parse_completion)(payload)
            except ApiError:
                return None  # refused once it is routed: no time to predict
            prompt = self.token_ids.of(parsed.tokens)
        return self.core.predicted_ttft_s(request.route, features, prompt, None, self.now, self.region)

    def _route(self, request: WorkRequest, waited: bool = False) -> None:
        """`waited`: it comes from the line for room, and goes back to its head if still full."""
        core = self.core
        try:
            payload, _, features = self.prepared(request)
            candidates = core.candidates(features.model, None, self.now)
        except ClientError as exc:
            if exc.code == FULL and self.flow is not None:
                self.flow.saturated(request)
                return
            if exc.code == FULL and waited:
                self._room_line.appendleft(request)
                return
            if exc.code == FULL:
                self._room_line.append(request)
                self._at(self.now + self.limits.queue_timeout_s, ROOM_TIMEOUT, request)
                return
            self._record_error(request, exc.status, exc.message)
            self._leave(request)
            return
        prompt = features.prompt
        parsed = None
        if self.kv_events is not None and prompt is not None:
            self._catch_up()
            # Precise mode routes on the token ids the engine will see, as `kvlb serve` does
            # with the engine's tokenizer, so a prediction and the engine's hit are comparable
            # token for token.
            parsed = self._parse(request, payload)
            if parsed is None:
                self._leave(request)
                return
            prompt = self.token_ids.of(parsed.tokens)
        decode = None
        if self.fleet.has_roles and has_roles(candidates):
            try:
                split = plan_split(core, request.route, features, prompt, candidates, self.disaggregation, self.region)
            except ClientError as exc:
                self._record_error(request, exc.status, exc.message)
                self._leave(request)
                return
            journey, decode = split.journey, split.decode
        else:
            journey = core.plan(request.route, features, prompt, candidates, self.region)
        if parsed is None:
            parsed = self._parse(request, payload)
            if parsed is None:
                self._leave(request)
                return
        if self.flow is not None:
            self.flow.placed(request)
        self._attempt(Flight(request, journey, decode=decode), parsed, None)

    def _parse(self, request: WorkRequest, payload: dict[str, Any]) -> GenerationRequest | None:
        """The replica's own parser, on the body it would receive; None (and an error
        record) when it refuses the body."""
        try:
            return (parse_chat if request.route == ROUTE_CHAT else parse_completion)(payload)
        except ApiError as exc:
            self._record_error(request, 400, str(exc))
            return None

    def _attempt(self, flight: Flight, parsed: GenerationRequest, failure: str | None) -> None:
        """Send to the next choice; it reaches the engine after the one-way delay."""
        journey = flight.journey
        assert journey is not None
        replica = self.core.next_attempt(journey, self.now)
        if replica is None:
            self._record_error(flight.request, 503 if failure else 502, failure or "no replica to try")
            self._leave(flight.request)
            return
        flight.replica = replica
        node = self.nodes[replica.name]
        self._at(self.now + node.one_way_s, REACH, (flight, parsed))

    def _reach(self, subject: tuple[Flight, GenerationRequest], _version: int) -> None:
        flight, parsed = subject
        journey = flight.journey
        assert journey is not None and flight.replica is not None
        node = self.nodes[flight.replica.name]
        self._bring_up_to(node, self.now)
        engine = node.engine
        # The prefill half of a split request generates its one token; the decode half starts
        # from the transferred KV.
        max_tokens = 1 if flight.decode is not None else parsed.max_tokens or flight.request.output_tokens
        try:
            seq = engine.submit(
                parsed.tokens, max_tokens, self.now,
                request_id=str(flight.request.index), adapter=flight.request.adapter,
                kv_transferred=flight.transferred,
            )
        except ContextLengthError as exc:
            # The replica's own 400, relayed to the client as the proxy relays it.
            self.core.answered(journey, self.now, True, None)
            self.core.end_attempt(journey, answered=True, now=self.now)
            self._record_error(flight.request, 400, str(exc))
            self._leave(flight.request)
            return
        except QueueFullError as exc:
            # A 503 without Retry-After: the replica's fault, and the next choice is tried.
            self.core.failed(journey, self.now)
            self.core.end_attempt(journey, answered=False, now=self.now)
            self._attempt(flight, parsed, str(exc))
            return
        flight.seq = seq
        flight.node = node
        flight.parsed = parsed
        node.flights[seq.seq_id] = flight
        if not node.step_pending:
            self._schedule_step(node, engine.busy_until)

    def _first_token(self, flight: Flight, _version: int) -> None:
        assert flight.journey is not None
        self.core.first_byte(flight.journey, self.now)
        if self.flow is not None:
            self.flow.first_byte(flight.request, self.now)

    def _finish(self, flight: Flight, _version: int) -> None:
        seq = flight.seq
        journey = flight.journey
        replica = flight.replica
        node = flight.node
        assert seq is not None and seq.first_token_time is not None and seq.finish_time is not None
        assert journey is not None and replica is not None and node is not None
        core = self.core
        if journey.phase == PREFILLING:  # a one-token answer: its first token is its last
            core.first_byte(journey, self.now)
        core.learn(journey, seq.prompt_tokens, seq.cached_tokens)
        if journey.reads_answer:  # as the proxy does
            core.learned_output(journey, seq.num_generated, self.now)
        if flight.decode is None and (chars := core.answer_chars(journey)):
            # The replica's answer, as the workload's next turn sends it back.
            core.answered_text(journey, answer_text(seq.num_generated, chars))
        core.answered(journey, self.now, True, None)
        core.end_attempt(journey, answered=True, now=self.now)
        request = flight.request
        if flight.decode is not None:
            self._to_decode(flight, seq, node)
            return
        self._leave(request)
        one_way = node.one_way_s
        predicted = None
        if journey.routed is not None:
            predicted = self._predicted(journey.routed, replica.name, seq.prompt_tokens)
        ttft = seq.first_token_time + one_way - request.arrival_s
        e2e = seq.finish_time + one_way - request.arrival_s
        out = seq.num_generated
        self.records[request.index] = RequestRecord(
            index=request.index, send_s=request.arrival_s, status=200, error=None,
            replica=replica.name, session=request.session,
            prompt_tokens=seq.prompt_tokens,
            cached_tokens=flight.prefill_cached if flight.transferred else seq.cached_tokens, output_tokens=out,
            ttft_s=ttft, e2e_s=e2e, tpot_s=(e2e - ttft) / (out - 1) if out > 1 else None, itl_s=[],
            predicted_cached_tokens=predicted,
        )
        self._stamp(self.records[request.index], request)

    def _to_decode(self, flight: Flight, seq: EngineSequence, prefill: VirtualReplica) -> None:
        """The prefill half is done: the decode half starts once the KV has crossed the
        link. With SGLang's protocol the decode request was sent with the prefill one and
        waits at its replica; with vLLM's it leaves once the prefill answer is back."""
        decode, prefill_journey = flight.decode, flight.journey
        assert decode is not None and prefill_journey is not None
        assert flight.parsed is not None and seq.finish_time is not None
        flight.journey, flight.decode = decode, None
        flight.prefill_cached, flight.transferred = seq.cached_tokens, True
        replica = self.core.next_attempt(decode, self.now)
        if replica is None:
            self._record_error(flight.request, 502, "no decode replica to try")
            self._leave(flight.request)
            return
        flight.replica = replica
        self.core.transferred(prefill_journey, decode)
        node = self.nodes[replica.name]
        settings = self.disaggregation
        moved_s = transfer_ms(seq.prompt_tokens, link_gbps(prefill.replica, replica, settings), settings) / 1000.0
        if settings.protocol == "sglang":
            start = max(seq.finish_time + moved_s, flight.request.arrival_s + node.one_way_s)
        else:
            start = self.now + node.one_way_s + moved_s
        self._at(max(start, self.now), REACH, (flight, flight.parsed))

    @staticmethod
    def _predicted(routed: Routed, replica: str, prompt_tokens: int) -> int:
        """The chosen replica's predicted hit in the replica's tokens. Precise mode counts
        those already; approximate mode estimates tokens from characters, so its prediction
        is taken as the same fraction of the replica's prompt (as `CacheTracker.learn`
        compares them)."""
        cached = routed.cached.get(replica, 0)
        if routed.prompt_tokens <= 0 or routed.prompt_tokens == prompt_tokens:
            return min(cached, prompt_tokens)
        return min(cached * prompt_tokens // routed.prompt_tokens, prompt_tokens)

    def _record_error(self, request: WorkRequest, status: int, message: str, reason: str | None = None) -> None:
        record = self.records[request.index] = RequestRecord(
            index=request.index, send_s=request.arrival_s, status=status, error=message,
            replica=None, session=request.session, prompt_tokens=0, cached_tokens=0,
            output_tokens=0, ttft_s=None, e2e_s=None, tpot_s=None, itl_s=[], reject_reason=reason,
        )
        self._stamp(record, request)

    def _stamp(self, record: RequestRecord, request: WorkRequest) -> None:
        """Who the request was for, and what flow control made of it. Its record is its
        end: its place under its model's bound is free."""
        counted = self._counted.pop(request.index, None)
        if counted is not None:
            self.core.leave_model(counted)
        self._bodies.pop(request.index, None)
        record.tenant, record.priority = request.tenant, request.priority
        record.model = request.model
        if self.flow is not None:
            self.flow.stamp(record, request)

    # -- the replica side ----------------------------------------------------------------

    def _schedule_step(self, node: VirtualReplica, time: float) -> None:
        node.version += 1
        node.step_pending = True
        self._at(time, STEP, node, node.version)

    def _bring_up_to(self, node: VirtualReplica, time: float) -> None:
        """A request reaches `node` at `time`: apply the part of a planned decode run that has
        begun by then, so the newcomer joins at the next iteration, as on the engine."""
        run = node.run
        if run is None:
            return
        start, iterations, end = run
        node.run = None
        engine = node.engine
        done, end = engine.decode_run_times(start, iterations, until=time)
        engine.advance_decode(start, done, end)
        self._publish(node, end)
        self._schedule_step(node, end)

    def _step(self, node: VirtualReplica, version: int) -> None:
        if version != node.version:
            return  # replaced by a later plan
        node.step_pending = False
        engine = node.engine
        run = node.run
        if run is not None:
            start, iterations, end = run
            node.run = None
            engine.advance_decode(start, iterations, end)
            self._publish(node, end)
        now = self.now
        length = engine.decode_run() if self.decode_runs_enabled else 0
        if length > 1:
            iterations, end = engine.decode_run_times(now, length)
            node.run = (now, iterations, end)
            self.decode_runs += 1
            self._schedule_step(node, end)
            return
        iteration = engine.step(now)
        if iteration is None:
            self._publish(node, now)  # a step that ran nothing may still have evicted
            return  # idle until the next request reaches it
        self._publish(node, iteration.end)
        arrive = iteration.end + node.one_way_s
        for seq in iteration.emitted:
            if seq.num_generated == 1 and seq.status is not Status.FINISHED:
                self._at(arrive, FIRST_TOKEN, node.flights[seq.seq_id])
        for seq in iteration.finished:
            self._at(arrive, FINISH, node.flights.pop(seq.seq_id))
        if engine.has_work:
            self._schedule_step(node, iteration.end)

    # -- precise mode: the engines' KV events -------------------------------------------

    def _publish(self, node: VirtualReplica, ended: float) -> None:
        """Send the events of the engine call just made, whose iteration ends at `ended`:
        they reach the balancer the one-way delay later, as its tokens do."""
        recorder = node.recorder
        if recorder is None or not recorder.events:
            return
        batch = (node, recorder.take())
        arrive = ended + node.one_way_s
        if arrive > self.now:
            self._at(arrive, KV_EVENTS, batch)
        else:
            # Batches run first at their instant, so none of this replica's is still queued.
            self._deliver(batch, 0)

    def _catch_up(self) -> None:
        """Apply the iterations of planned decode runs whose events have reached the balancer
        by now; the rest of each run stays planned to the same end."""
        now = self.now
        for node in self.nodes.values():
            run = node.run
            if run is None:
                continue
            start, iterations, end = run
            heard = now - node.one_way_s  # iterations that ended by then have been heard of
            if start >= heard:
                continue
            engine = node.engine
            # Counts the iterations begun by `heard`; the last of them may still be running.
            done, done_end = engine.decode_run_times(start, iterations, until=heard)
            if done_end > heard:
                done, done_end = engine.decode_run_times(start, done - 1)
            if not done:
                continue
            engine.advance_decode(start, done, done_end)
            node.run = (done_end, iterations - done, end)
            self._publish(node, done_end)

    def _deliver(self, batch: tuple[VirtualReplica, list[Event]], _version: int) -> None:
        """What `balancer.watchers.kv_events.KvEventSubscriber` does with one message."""
        node, events = batch
        intake = self.kv_events
        assert intake is not None
        name = node.replica.name
        intake.sequence(name, node.kv_sequence)
        node.kv_sequence += 1
        intake.apply(name, events)
        intake.stats.batches += 1

    def flush_cache(self, replica: str) -> None:
        """The replica's `/flush_cache` at the current time: drop its unreferenced cached
        blocks. The live replica publishes right after a flush, not at an iteration's end.
        Once a run is over, `run([])` delivers what is still on its way."""
        node = self.nodes[replica]
        node.engine.clear_cache()
        self._publish(node, self.now)


def simulate(
    fleet: FleetPlan,
    requests: Sequence[WorkRequest],
    policy: PolicySettings,
    routing: RoutingSettings | None = None,
    progress: Callable[[int], None] | None = None,
    precise: bool = False,
    limits: Limits | None = None,
    flow: Settings | None = None,
    disaggregation: DisaggregationSettings | None = None,
    per_model: Sequence[ModelSettings] = (),
) -> SimulationResult:
    return Simulator(fleet, policy, routing, precise=precise, limits=limits, flow=flow,
                     disaggregation=disaggregation, per_model=per_model).run(requests, progress)
