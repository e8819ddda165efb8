"""Replica state: the one place that knows each replica's load, health and models."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from balancer.config import ReplicaSettings
from balancer.errors import ClientError
from balancer.routing.adapters import AdapterDemand, AdapterSlots
from balancer.routing.breaker import Breaker, BreakerSettings
from balancer.routing.latency import LatencyFit
from balancer.routing.term_fit import ITL_RIDGE, TTFT_RIDGE, TermFit


class Replica:
    """One upstream engine. Implements `policies.base.ReplicaView`."""

    __slots__ = (
        "name", "url", "weight", "labels", "max_concurrency", "kv_capacity_tokens",
        "declared_model", "in_flight", "healthy", "discovered_models", "model_cards",
        "prefill_tokens_queued", "decoding", "breaker", "draining", "settings",
        "remote_in_flight", "remote_prefill_tokens_queued", "remote_decoding", "remote_context_tokens",
        "context_tokens", "batch_area", "latency", "decode_latency", "ttft_terms_fit", "itl_terms_fit", "prefill_ms_started",
        "adapter_slots", "discovered_adapters", "engine_max_loras", "engine_max_loaded_loras",
        "adapters_changed",
    )

    def __init__(self, settings: ReplicaSettings, breaker: BreakerSettings | None = None,
                 demand: AdapterDemand | None = None) -> None:
        self.settings = settings
        self.name: str = settings.name or settings.url
        self.url: str = settings.url
        self.weight: float = settings.weight
        self.labels: Mapping[str, str] = MappingProxyType(dict(settings.labels))
        self.max_concurrency: int | None = settings.max_concurrency
        self.kv_capacity_tokens: int | None = settings.kv_capacity_tokens
        self.declared_model: str | None = settings.model
        # Load counts are this instance's own plus, when instances share state (balancer/watchers/sync.py),
        # the others' last snapshots, which are also kept apart in the remote_* fields so that
        # a new snapshot replaces the old one's share. Policies and max_concurrency thus see
        # the whole replica's load, whichever instance routed it.
        self.in_flight = 0
        self.prefill_tokens_queued = 0
        self.decoding = 0
        self.remote_in_flight = 0
        self.remote_prefill_tokens_queued = 0
        self.remote_decoding = 0
        self.remote_context_tokens = 0
        # The prompt tokens of the requests it is serving: the context its decode batch reads.
        self.context_tokens = 0
        # (when, ∫decoding dt, ∫context_tokens dt) up to then: the decode batch an answer
        # streamed beside, on average (`batch_at`).
        self.batch_area: tuple[float, float, float] | None = None
        self.latency = LatencyFit()  # time to first token: prefill and queue
        self.decode_latency = LatencyFit()  # time between output tokens: the decode batch
        # Each term of those two predictions fitted apart (balancer/routing/term_fit.py).
        self.ttft_terms_fit = TermFit(TTFT_RIDGE)
        self.itl_terms_fit = TermFit(ITL_RIDGE)
        # The prefill (profile ms) of every attempt this instance has started there, summed:
        # what stalled the decode of an answer streaming meanwhile is the growth of this.
        self.prefill_ms_started = 0.0
        self.breaker = Breaker(breaker or BreakerSettings())
        # Draining: no new requests; those in flight finish (admin API).
        self.draining = False
        # Optimistic until the first health check says otherwise, so a fresh balancer serves at once.
        self.healthy = True
        # None until the replica has answered /v1/models once.
        self.discovered_models: frozenset[str] | None = None
        self.model_cards: tuple[Mapping[str, Any], ...] = ()
        # The LoRA adapters among them (cards with a `parent`), and kvlb's model of which
        # are in its GPU slots (balancer/routing/adapters.py).
        self.discovered_adapters: frozenset[str] = frozenset()
        self.adapter_slots = AdapterSlots(settings.max_loras or 1, settings.lora_load_ms, demand)
        # The slots the engine itself reported holding (SGLang's /get_server_info, vLLM's
        # lora_requests_info), None until it has; used where config names no `max_loras`.
        self.engine_max_loras: int | None = None
        # How many adapters the engine keeps registered at once (SGLang's max_loaded_loras
        # on /get_server_info): 0 once it has answered without one, None until it answers.
        self.engine_max_loaded_loras: int | None = None
        # Counts kvlb's own loads and unloads here: a listing asked for before one of them
        # is older than what kvlb knows, and discovery leaves it.
        self.adapters_changed = 0

    @property
    def ttft_scale(self) -> float:
        return self.latency.scale

    @property
    def itl_scale(self) -> float:
        return self.decode_latency.scale

    @property
    def ttft_terms(self) -> tuple[float, ...] | None:
        return self.ttft_terms_fit.trusted

    @property
    def itl_terms(self) -> tuple[float, ...] | None:
        return self.itl_terms_fit.trusted_shape

    @property
    def ttft_samples(self) -> int:
        return self.latency.evidence

    @property
    def itl_samples(self) -> int:
        return self.decode_latency.evidence

    def serves(self, model: str | None) -> bool:
        if model is None:
            return True
        if self.declared_model is None and self.discovered_models is None:
            # Nothing known yet: do not refuse traffic the replica may well serve.
            return True
        if model == self.declared_model or self.serves_adapter(model) or (
            self.discovered_models is not None and model in self.discovered_models
        ):
            return True
        # SGLang's OpenAI routes name an adapter as BASE:ADAPTER.
        base, colon, adapter = model.partition(":")
        return bool(colon) and self.serves_adapter(adapter) and self.serves(base)

    def serves_adapter(self, adapter: str) -> bool:
        return adapter in self.settings.adapters or adapter in self.discovered_adapters

    def adapter_loaded(self, adapter: str) -> None:
        """It holds `adapter` now (kvlb had it loaded): routable here at once, as its next
        listing will say."""
        self.discovered_adapters = self.discovered_adapters | {adapter}
        if self.discovered_models is not None:
            self.discovered_models = self.discovered_models | {adapter}
        self.adapters_changed += 1

    def adapter_unloaded(self, adapter: str) -> None:
        """It no longer holds `adapter` (kvlb is having it unloaded, or it answered 404 for
        it): not routed here from now on, though its last listing named it. A listing asked
        for later that names it again is believed; a wrong 404 heals at the next one."""
        self.discovered_adapters = self.discovered_adapters - {adapter}
        if self.discovered_models is not None:
            self.discovered_models = self.discovered_models - {adapter}
        self.adapters_changed += 1

    @property
    def max_loaded_loras(self) -> int | None:
        """How many adapters it may keep registered: config's, else the engine's; None: no limit."""
        return self.settings.max_loaded_loras or self.engine_max_loaded_loras or None

    def set_remote_load(self, in_flight: int, prefill_tokens_queued: int, decoding: int,
                        context_tokens: int = 0, loading_ms: int = 0) -> None:
        """Other instances' requests on this replica, replacing their previous snapshot;
        `loading_ms`, the adapter loads theirs are waiting out there."""
        self.adapter_slots.set_remote_loading(loading_ms)
        self.in_flight += in_flight - self.remote_in_flight
        self.prefill_tokens_queued += prefill_tokens_queued - self.remote_prefill_tokens_queued
        self.decoding += decoding - self.remote_decoding
        self.context_tokens += context_tokens - self.remote_context_tokens
        self.remote_in_flight = in_flight
        self.remote_prefill_tokens_queued = prefill_tokens_queued
        self.remote_decoding = decoding
        self.remote_context_tokens = context_tokens

    def batch_at(self, now: float | None) -> tuple[float, float, float] | None:
        """The batch's area brought up to `now`; with `now` None, the area as last brought up
        (None until the replica is first timed). The routing core calls it before each change
        of `decoding` or `context_tokens` it makes. Other instances' shares change without a
        clock, so the time since the core last called it counts at their new level: an error
        of one snapshot's change over an interval of this instance's own traffic."""
        area = self.batch_area
        if now is None:
            return area
        if area is None:
            area = (now, 0.0, 0.0)
        elif now > area[0]:
            elapsed = now - area[0]
            area = (now, area[1] + self.decoding * elapsed, area[2] + self.context_tokens * elapsed)
        self.batch_area = area
        return area

    def local_load(self) -> tuple[int, int, int, int, int]:
        """This instance's own (in flight, queued prefill tokens, decoding, their context
        tokens, the adapter loads they wait out in whole ms)."""
        return (
            self.in_flight - self.remote_in_flight,
            self.prefill_tokens_queued - self.remote_prefill_tokens_queued,
            self.decoding - self.remote_decoding,
            self.context_tokens - self.remote_context_tokens,
            self.adapter_slots.own_loading_ms(),
        )

    def has_room(self) -> bool:
        return not self.draining and (self.max_concurrency is None or self.in_flight < self.max_concurrency)

    def __repr__(self) -> str:
        return f"Replica({self.name!r}, in_flight={self.in_flight}, healthy={self.healthy})"


FULL = "overloaded"  # the code of the refusal when every replica is at its max_concurrency
# The metric label of a model no replica lists or declares: the client's free text must not
# become a label, or one client could mint a series per request.
OTHER_MODEL = "other"
KNOWN_MODELS_REFRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class FleetCounts:
    total: int
    healthy: int


class Fleet:
    def __init__(self, replicas: Iterable[ReplicaSettings], breaker: BreakerSettings | None = None) -> None:
        self.breaker_settings = breaker
        # One account of adapter demand for the whole fleet: what an eviction anywhere costs.
        self.adapter_demand = AdapterDemand()
        self.replicas: tuple[Replica, ...] = tuple(Replica(s, breaker, self.adapter_demand) for s in replicas)
        # Requests waiting for a replica under its max_concurrency (see wait_for_room).
        self._room_waiters: list[asyncio.Future[None]] = []
        self.by_name: dict[str, Replica] = {r.name: r for r in self.replicas}
        self._known_models: frozenset[str] = frozenset()
        self._known_adapters: frozenset[str] = frozenset()
        self._adapter_bases: dict[str, str] = {}  # adapter -> its base model
        self.refresh_adapters()
        self._known_models_at = float("-inf")
        self._count_roles()

    def _count_roles(self) -> None:
        # Whether any replica has a prefill or decode role: read per request, so a fleet
        # without disaggregation pays one attribute read, not a walk over its replicas.
        self.has_roles = any(r.settings.role != "both" for r in self.replicas)

    def candidates(
        self, model: str | None, allowed_regions: frozenset[str] | None = None, now: float = 0.0
    ) -> list[Replica]:
        """Replicas a request for `model` may go to, or the ClientError explaining why none.

        `allowed_regions` is data residency, a hard filter: a replica outside it (or with no
        region label) never serves the request, even when that leaves none.
        """
        ready = [
            r for r in self.replicas
            if r.healthy and r.serves(model) and r.has_room() and r.breaker.allows(now)
            and (allowed_regions is None or r.labels.get("region") in allowed_regions)
        ]
        if ready:
            return ready
        # None left: find out why, for an answer that says so.
        serving = [r for r in self.replicas if r.serves(model)]
        if allowed_regions is not None and serving:
            serving = [r for r in serving if r.labels.get("region") in allowed_regions]
            if not serving:
                raise ClientError(
                    503,
                    "no replica serving this model is in the allowed regions "
                    + ", ".join(sorted(allowed_regions)),
                    "no_replica_in_allowed_regions",
                    retry_after=5,
                )
        if not serving:
            raise ClientError(
                404,
                f"The model '{model}' does not exist or is not served by any replica",
                "model_not_found",
                param="model",
            )
        healthy = [r for r in serving if r.healthy and not r.draining and r.breaker.allows(now)]
        if not healthy:
            raise ClientError(
                503,
                f"no healthy replica serves model '{model}'" if model else "no healthy replica",
                "no_healthy_replica",
                type_="service_unavailable",
                retry_after=5,
            )
        ready = [r for r in healthy if r.has_room()]
        if not ready:
            raise ClientError(
                429,
                "every replica is at its max_concurrency; retry shortly",
                FULL,
                type_="rate_limit_error",
                retry_after=1,
            )
        return ready

    def routable(self, model: str | None, allowed_regions: frozenset[str] | None, now: float) -> list[Replica]:
        """The replicas `model` could go to once one has room: `candidates` but for room."""
        return [
            r for r in self.replicas
            if r.healthy and not r.draining and r.serves(model) and r.breaker.allows(now)
            and (allowed_regions is None or r.labels.get("region") in allowed_regions)
        ]

    def free_slots(self, model: str | None, now: float, unbounded: int) -> int:
        """Requests for `model` the fleet could start now: each routable replica's room
        under its max_concurrency, `unbounded` as soon as one has no cap."""
        free = 0
        for r in self.routable(model, None, now):
            if r.max_concurrency is None:
                return unbounded
            free += max(r.max_concurrency - r.in_flight, 0)
        return free

    def add(self, settings: ReplicaSettings) -> Replica:
        """A new replica, routable at once (requests in flight keep the old tuple)."""
        if settings.name in self.by_name:
            raise ValueError(f"a replica named {settings.name!r} exists already")
        replica = Replica(settings, self.breaker_settings, self.adapter_demand)
        self.replicas = (*self.replicas, replica)
        self.by_name[replica.name] = replica
        self.refresh_adapters()
        self._count_roles()
        return replica

    def remove(self, name: str) -> Replica:
        """Out of the fleet at once; requests in flight on it finish on their own."""
        replica = self.by_name.pop(name)
        self.replicas = tuple(r for r in self.replicas if r is not replica)
        replica.draining = True
        self.refresh_adapters()
        self._count_roles()
        return replica

    def released(self, replica: Replica) -> None:
        """A request on `replica` ended: wake whoever waits for room (they re-check)."""
        if self._room_waiters and replica.max_concurrency is not None:
            waiters, self._room_waiters = self._room_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until some capped replica frees a slot (TimeoutError after `timeout_s`)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        finally:
            if not waiter.done():
                waiter.cancel()
            # Gone now, not when some request finishes: waiters that time out while nothing
            # finishes must not pile up. (One that was woken has left the list already.)
            try:
                self._room_waiters.remove(waiter)
            except ValueError:
                pass

    def model_label(self, model: str, now: float) -> str:
        """`model` as a metric label: itself when a replica lists or declares it, else
        OTHER_MODEL. What replicas list is re-read at most once a second, on a miss."""
        if not model or model in self._known_models:
            return model
        if now - self._known_models_at >= KNOWN_MODELS_REFRESH_S:
            self._known_models_at = now
            known = {r.declared_model for r in self.replicas if r.declared_model}
            for replica in self.replicas:
                known.update(replica.discovered_models or ())
            self._known_models = frozenset(known)
            if model in self._known_models:
                return model
        return OTHER_MODEL

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, when some replica serves it (listed with a
        `parent`, or configured): `model` itself, as vLLM names adapters, or the part after
        the colon of SGLang's BASE:ADAPTER. None: a base model."""
        if model is None:
            return None
        known = self._known_adapters
        if model in known:
            return model
        if ":" in model:
            adapter = model.partition(":")[2]
            if adapter in known:
                return adapter
        return None

    def base_of(self, model: str | None) -> str | None:
        """The base model of the adapter `model` names (BASE:ADAPTER's BASE, else the
        `parent` replicas list it with, else the model of a replica configured to serve it);
        None for a base model, or an adapter whose base nobody has said."""
        if model is None:
            return None
        base, colon, adapter = model.partition(":")
        if colon and adapter in self._known_adapters:
            return base
        return self._adapter_bases.get(model)

    def refresh_adapters(self) -> None:
        """After the replicas or what they list changed."""
        known: set[str] = set()
        bases: dict[str, str] = {}
        for replica in self.replicas:
            known.update(replica.settings.adapters)
            known.update(replica.discovered_adapters)
            for card in replica.model_cards:
                parent = card.get("parent")
                if isinstance(parent, str) and parent:
                    bases.setdefault(card["id"], parent)
            if replica.declared_model:
                for adapter in replica.settings.adapters:
                    bases.setdefault(adapter, replica.declared_model)
        self._known_adapters = frozenset(known)
        self._adapter_bases = bases

    def counts(self) -> FleetCounts:
        return FleetCounts(len(self.replicas), sum(1 for r in self.replicas if r.healthy))

    def model_cards(self) -> list[Mapping[str, Any]]:
        """Every model served, each once: what replicas reported, then what config declares."""
        seen: dict[str, Mapping[str, Any]] = {}
        for replica in self.replicas:
            for card in replica.model_cards:
                seen.setdefault(card["id"], card)
        for replica in self.replicas:
            model = replica.declared_model
            if model and model not in seen:
                seen[model] = {"id": model, "object": "model", "created": 0, "owned_by": "kvlb"}
        return list(seen.values())
