"""The offline fleet simulator: a workload through kvlb's routing onto virtual replicas.

No HTTP and no sleeping: events run in virtual (model) time, so an hour of traffic takes
seconds to minutes. What decides a request's fate is the same code as in `kvlb serve`:
- the request body is built and parsed by `balancer.request.parse_request`, the prompt
  predicted by `balancer.routing.CacheTracker` over `balancer.index.PrefixIndex`, the
  replicas filtered by `balancer.fleet.Fleet.candidates` and ranked by the policy object
  from `policies/`;
- the bookkeeping follows the proxy's order: in flight and `tracker.start` when sent,
  `first_byte` when the first token comes back, `learn` from the usage at the end of the
  stream, then `finish`;
- each replica is `loadtest.replica.engine.Engine` with its prefix cache, fed the tokens
  the simulated replica's own parser makes of the same body.

Speed: between two events that change a replica's batch, its iterations are plain decodes
whose durations follow from the batch alone, so they are applied in one step
(`Engine.decode_run`), and cut short when a request arrives in the middle.

The one-way network delay to a replica is half its round trip: the request reaches the
engine that much after it left the balancer, and each token that much after the engine made it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from balancer.config import PolicySettings, ReplicaSettings, RoutingSettings
from balancer.errors import ClientError
from balancer.fleet import Fleet, Replica
from balancer.request import parse_request
from balancer.routing import CacheTracker, Routed
from loadtest.fleetspec import FleetPlan
from loadtest.replica.engine import ContextLengthError, Engine, EngineConfig, QueueFullError, Status
from loadtest.replica.engine import Sequence as EngineSeq
from loadtest.replica.parsing import ApiError, parse_chat, parse_completion
from loadtest.summary import RequestRecord
from loadtest.workloads import ROUTE_CHAT, WorkRequest
from policies.base import Policy, RequestFeatures
from policies.registry import make_policy

MODEL = "sim-model"
# Event kinds, in the order they run when they fall on the same instant: a replica's
# iteration end before the arrivals it may have made room for.
STEP, FIRST_TOKEN, FINISH, ARRIVE, REACH = range(5)


@dataclass(slots=True)
class Flight:
    """One request from arrival at the balancer to its last token at the client."""

    request: WorkRequest
    routed: Routed | None
    replica: Replica | None = None
    seq: EngineSeq | None = None
    node: VirtualReplica | None = None


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


@dataclass(slots=True)
class SimulationResult:
    records: list[RequestRecord]
    duration_s: float
    replicas: list[str]
    iterations: int
    decode_runs: int
    events: int


class Simulator:
    def __init__(
        self,
        fleet: FleetPlan,
        policy: PolicySettings,
        routing: RoutingSettings | None = None,
        max_attempts: int = 3,
        decode_runs: bool = True,
    ) -> None:
        self.decode_runs_enabled = decode_runs
        self.now = 0.0
        self.routing = routing or RoutingSettings()
        self.policy: Policy = make_policy(policy.name, policy.params, policy.seed)
        settings = [
            ReplicaSettings(
                url=f"http://sim.invalid/{plan.name}", name=plan.name, model=MODEL,
                labels=dict(plan.labels), weight=plan.weight,
            )
            for plan in fleet.replicas
        ]
        self.fleet = Fleet(settings)
        self.tracker = CacheTracker(self.routing, lambda: self.now) if self.policy.needs_prompt else None
        self.nodes: dict[str, VirtualReplica] = {}
        for plan, replica in zip(fleet.replicas, self.fleet.replicas, strict=True):
            engine = Engine(EngineConfig(
                profile=plan.profile, kv_capacity_tokens=plan.kv_capacity_tokens,
                max_running=plan.max_running, max_batched_tokens=plan.max_batched_tokens,
                context_limit=plan.context_limit,
            ))
            self.nodes[replica.name] = VirtualReplica(replica, engine, plan.round_trip_s / 2)
            if self.tracker is not None:
                # As `kvlb serve` learns it from each replica's /get_server_info.
                self.tracker.index.set_capacity(replica.name, engine.cache.capacity_tokens)
        self.region = fleet.region or self.routing.region
        self.max_attempts = max_attempts
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
        events = self._events
        handlers = {
            STEP: self._step, FIRST_TOKEN: self._first_token, FINISH: self._finish,
            ARRIVE: self._arrive, REACH: self._reach,
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
            records, end - start, list(self.nodes), iterations, self.decode_runs, self.events
        )

    # -- the balancer side ---------------------------------------------------------------

    def _arrive(self, request: WorkRequest, _version: int) -> None:
        payload = request.payload(MODEL, stream=True)
        body = orjson.dumps(payload)
        try:
            features = parse_request(request.route, body, request.session, with_prompt=self.policy.needs_prompt)
            candidates = self.fleet.candidates(features.model, None, self.now)
        except ClientError as exc:
            self._record_error(request, exc.status, exc.message)
            return
        routed = None
        if self.tracker is not None and features.prompt is not None:
            routed = self.tracker.predict(features.prompt)
            features = RequestFeatures(
                route=request.route, model=features.model, stream=True,
                session_key=features.session_key, prompt=features.prompt,
                prompt_tokens=routed.prompt_tokens, cached_tokens=routed.cached,
                origin_region=self.region,
            )
        ranking = self.policy.rank(features, candidates)
        try:
            # The replica's own parser, on the body it would receive.
            parsed = (parse_chat if request.route == ROUTE_CHAT else parse_completion)(payload)
        except ApiError as exc:
            self._record_error(request, 400, str(exc))
            return
        flight = Flight(request, routed)
        self._attempt(flight, [choice.replica for choice in ranking[: self.max_attempts]], parsed)

    def _attempt(self, flight: Flight, choices: list[Any], parsed: Any) -> None:
        """Send to the first choice; it reaches the engine after the one-way delay."""
        replica: Replica = choices[0]
        flight.replica = replica
        replica.in_flight += 1
        if flight.routed is not None:
            self.tracker.start(flight.routed, replica)  # type: ignore[union-attr]
        node = self.nodes[replica.name]
        self._at(self.now + node.one_way_s, REACH, (flight, choices, parsed))

    def _reach(self, subject: tuple[Flight, list[Any], Any], _version: int) -> None:
        flight, choices, parsed = subject
        node = self.nodes[flight.replica.name]  # type: ignore[union-attr]
        self._bring_up_to(node, self.now)
        engine = node.engine
        try:
            seq = engine.submit(
                parsed.tokens, parsed.max_tokens or flight.request.output_tokens, self.now,
                request_id=str(flight.request.index),
            )
        except (ContextLengthError, QueueFullError) as exc:
            status = 400 if isinstance(exc, ContextLengthError) else 503
            self._release(flight, answered=status == 400)
            rest = choices[1:]
            if status == 503 and rest:
                self._attempt(flight, rest, parsed)
            else:
                self._record_error(flight.request, status, str(exc))
            return
        flight.seq = seq
        flight.node = node
        node.flights[seq.seq_id] = flight
        if not node.step_pending:
            self._schedule_step(node, engine.busy_until)

    def _first_token(self, flight: Flight, _version: int) -> None:
        if flight.routed is not None:
            self.tracker.first_byte(flight.routed)  # type: ignore[union-attr]

    def _finish(self, flight: Flight, _version: int) -> None:
        seq = flight.seq
        assert seq is not None and seq.first_token_time is not None and seq.finish_time is not None
        if flight.routed is not None:
            self.tracker.first_byte(flight.routed)  # type: ignore[union-attr]
            self.tracker.learn(flight.routed, flight.replica, seq.prompt_tokens, seq.cached_tokens)  # type: ignore[union-attr,arg-type]
        self._release(flight, answered=True)
        request = flight.request
        one_way = flight.node.one_way_s  # type: ignore[union-attr]
        ttft = seq.first_token_time + one_way - request.arrival_s
        e2e = seq.finish_time + one_way - request.arrival_s
        out = seq.num_generated
        self.records[request.index] = RequestRecord(
            index=request.index, send_s=request.arrival_s, status=200, error=None,
            replica=flight.replica.name, session=request.session,  # type: ignore[union-attr]
            prompt_tokens=seq.prompt_tokens, cached_tokens=seq.cached_tokens, output_tokens=out,
            ttft_s=ttft, e2e_s=e2e, tpot_s=(e2e - ttft) / (out - 1) if out > 1 else None, itl_s=[],
        )

    def _release(self, flight: Flight, answered: bool) -> None:
        replica = flight.replica
        assert replica is not None
        replica.in_flight -= 1
        if flight.routed is not None:
            self.tracker.finish(flight.routed, answered=answered)  # type: ignore[union-attr]

    def _record_error(self, request: WorkRequest, status: int, message: str) -> None:
        self.records[request.index] = RequestRecord(
            index=request.index, send_s=request.arrival_s, status=status, error=message,
            replica=None, session=request.session, prompt_tokens=0, cached_tokens=0,
            output_tokens=0, ttft_s=None, e2e_s=None, tpot_s=None, itl_s=[],
        )

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
            return  # idle until the next request reaches it
        arrive = iteration.end + node.one_way_s
        for seq in iteration.emitted:
            if seq.num_generated == 1 and seq.status is not Status.FINISHED:
                self._at(arrive, FIRST_TOKEN, node.flights[seq.seq_id])
        for seq in iteration.finished:
            self._at(arrive, FINISH, node.flights.pop(seq.seq_id))
        if engine.has_work:
            self._schedule_step(node, iteration.end)


def simulate(
    fleet: FleetPlan,
    requests: Sequence[WorkRequest],
    policy: PolicySettings,
    routing: RoutingSettings | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimulationResult:
    return Simulator(fleet, policy, routing).run(requests, progress)
