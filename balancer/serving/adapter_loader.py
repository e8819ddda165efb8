"""LoRA adapters loaded on demand: when a request names an adapter that no replica serves and
config lists it under `adapters.load_on_demand`, the replica the policy would choose among
those serving its base model is asked to load it (vLLM's `/v1/load_lora_adapter`, SGLang's
`/load_lora_adapter`: `{"lora_name", "lora_path"}`), and the request then routes as usual.
A hot adapter spreads the same way: when the policy, ranking every replica of the base
model, would rather pay a load on one that does not serve the adapter than wait on those
that do, that one is asked to load it too.

One load at a time per adapter: requests arriving while it loads wait for the same load.
A failed load answers 503 `adapter_load_failed` naming the replica and its answer, and
nothing is marked; the next request tries again. What is loaded shows in the replica's
`/v1/models` from then on, which discovery reads back.

An engine may keep only so many adapters registered (SGLang's `--max-loaded-loras`) and
refuses a load past it until one is unloaded. A replica known to be there (config's or the
engine's `max_loaded_loras`), or one that refuses a load saying so, first unloads the
adapter `unload_choice` names (balancer/routing/adapters.py): one kvlb can load again, idle
as far as kvlb knows, and the least missed. It stops being routed there before the unload is
sent, so no request of kvlb's races it. Loads and unloads on one replica run one at a time,
as the engines run them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from balancer.config import AdapterSettings, LoadableAdapter
from balancer.errors import ClientError
from balancer.routing.adapters import unload_choice, unloadable
from balancer.routing.core import RoutingCore
from balancer.routing.fleet import Replica
from policies.base import LOAD_TERM, RequestFeatures

log = logging.getLogger("kvlb.adapters")

# An engine asked to load an adapter it already has says so with a 400 (vLLM: "has already
# been loaded"): the adapter is there, which is what was wanted.
ALREADY_LOADED = "already"
# SGLang's refusal of a load past --max-loaded-loras.
REGISTRY_FULL = "Maximum number of loaded LoRA adapters"
ERROR_EXCERPT = 200
# An engine's answer is read this far for the words above, no further.
MAX_ANSWER_CHARS = 4096
# Replicas tried, best first, for an adapter no replica serves, while each has no room.
MAX_ROOM_TRIES = 3


class _NoRoom(ClientError):
    """The chosen replica had no room left when its turn came: the next may."""


class _NoRoomLeft(str):
    """Why `_make_room` could not: no adapter there that kvlb may unload."""


class AdapterLoader(Collector):
    def __init__(self, settings: AdapterSettings, core: RoutingCore,
                 session: Callable[[], aiohttp.ClientSession | None], authorization: str | None) -> None:
        self.settings = settings
        self.core = core
        self._session = session
        self._authorization = authorization
        self._loadable = {adapter.name: adapter for adapter in settings.load_on_demand}
        self._loading: dict[str, asyncio.Future[None]] = {}
        # Adapters with requests between `ensure` and their first attempt: not to be unloaded
        # to make room meanwhile, or those requests would find no replica serving them.
        self._wanted: Counter[str] = Counter()
        self._unload_path = settings.unload_path or settings.load_path.replace(
            "load_lora_adapter", "unload_lora_adapter")
        # One load or unload at a time per replica: two loads racing for its last free
        # registration would both be refused, or both unload the same adapter.
        self._replica_locks: dict[str, asyncio.Lock] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (adapter, loaded | failed)
        self.unloads: Counter[tuple[str, str]] = Counter()  # (adapter, unloaded | failed)

    def spec(self, model: str | None) -> LoadableAdapter | None:
        """The loadable adapter `model` names, as vLLM spells it or as SGLang's BASE:ADAPTER."""
        if model is None:
            return None
        spec = self._loadable.get(model)
        if spec is None and ":" in model:
            base, _, name = model.partition(":")
            spec = self._loadable.get(name)
            if spec is not None and spec.base != base:
                return None
        return spec

    def __contains__(self, model: str | None) -> bool:
        return self.spec(model) is not None

    async def ensure(self, route: str, features: RequestFeatures, prompt: object,
                     allowed: frozenset[str] | None) -> None:
        """Before routing a request for a loadable adapter. When no routable replica serves
        it, have one load it; raises the ClientError to answer with when that fails. When
        some do, but the policy would rather run the request on a replica of its base model
        that does not (those serving it are busy enough to be worth a load), have that one
        load it too; a failure there leaves the request to those already serving it.

        From the call on, the adapter is not unloaded to make room for another until
        `release` (called once the request's first attempt has started, or it failed)."""
        spec = self.spec(features.model)
        assert spec is not None
        self._wanted[spec.name] += 1
        now = asyncio.get_running_loop().time()
        serving = self.core.fleet.routable(spec.name, allowed, now)
        pending = self._loading.get(spec.name)
        if serving:
            # One load of an adapter at a time: while it spreads, the others take its requests.
            if pending is None:
                await self._spread(spec, route, features, prompt, allowed, serving, now)
            return
        if pending is None:
            pending = self._begin(spec, self._choose(spec, route, features, prompt, allowed, now))
        # A client leaving does not cancel a load others may be waiting for.
        await asyncio.shield(pending)

    async def _spread(self, spec: LoadableAdapter, route: str, features: RequestFeatures, prompt: object,
                      allowed: frozenset[str] | None, serving: list[Replica], now: float) -> None:
        others = [r for r in self.core.fleet.routable(spec.base, allowed, now)
                  if r.has_room() and not r.serves(spec.name) and self._can_take(r, spec)]
        if not others:
            return
        ranking = self.core.plan(route, features, prompt if isinstance(prompt, str | list) else None,
                                 [*serving, *others]).ranking
        first = ranking[0]
        best = first.replica
        if not any(best is r for r in others):
            return
        assert isinstance(best, Replica)
        if self._full(best):
            # Room there means unloading an adapter whose next request loads it again: a
            # second load, which the replicas already serving this one must be worse than.
            # Without it, on replicas that keep few adapters registered, hot adapters pushed
            # the others around and each came back by pushing another.
            holder = next((c for c in ranking if not any(c.replica is r for r in others)), None)
            if holder is not None and first.terms["cost"] + first.terms.get(LOAD_TERM, 0.0) >= holder.terms["cost"]:
                return
        pending = self._begin(spec, self._load_on(spec, best))
        try:
            await asyncio.shield(pending)
        except ClientError:
            pass  # counted and logged; the replicas serving it take this request

    def release(self, model: str | None) -> None:
        """The request `ensure` was called for has started on a replica, or will not."""
        spec = self.spec(model)
        if spec is None:
            return
        left = self._wanted[spec.name] - 1
        if left > 0:
            self._wanted[spec.name] = left
        else:
            del self._wanted[spec.name]

    def _begin(self, spec: LoadableAdapter, load: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        pending = self._loading[spec.name] = asyncio.ensure_future(load)
        pending.add_done_callback(lambda done: self._settled(spec.name, done))
        return pending

    def _settled(self, name: str, done: asyncio.Future[None]) -> None:
        self._loading.pop(name, None)
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have left before it failed

    async def _choose(self, spec: LoadableAdapter, route: str, features: RequestFeatures, prompt: object,
                      allowed: frozenset[str] | None, now: float) -> None:
        candidates = [r for r in self.core.fleet.routable(spec.base, allowed, now) if r.has_room()]
        # Where none can make room, the first choice's refusal says why.
        candidates = [r for r in candidates if self._can_take(r, spec)] or candidates
        if not candidates:
            raise ClientError(503, f"no replica serving base model {spec.base!r} can load adapter {spec.name!r} now",
                              "adapter_load_failed", type_="service_unavailable", retry_after=5)
        ranking = self.core.plan(route, features, prompt if isinstance(prompt, str | list) else None, candidates).ranking
        # A replica that could make room when chosen may find every adapter in use once its
        # turn comes: the next one is asked then.
        no_room: _NoRoom | None = None
        for choice in ranking[:MAX_ROOM_TRIES]:
            replica = choice.replica
            assert isinstance(replica, Replica)
            try:
                await self._load_on(spec, replica)
                return
            except _NoRoom as full:
                no_room = full
        assert no_room is not None
        raise no_room

    async def _load_on(self, spec: LoadableAdapter, replica: Replica) -> None:
        async with self._lock_of(replica):
            problem = await self._make_room(replica, spec) if self._full(replica) else None
            if problem is None:
                problem, full = await self._ask(replica, spec)
                if full and self._may_unload(replica, spec):
                    # A limit kvlb had not been told of: make room, and ask once more.
                    problem = await self._make_room(replica, spec)
                    if problem is None:
                        problem, _ = await self._ask(replica, spec)
        if problem is not None:
            self.outcomes[(spec.name, "failed")] += 1
            log.warning("adapter %s: replica %s did not load it: %s", spec.name, replica.name, problem)
            error = _NoRoom if isinstance(problem, _NoRoomLeft) else ClientError
            raise error(503, f"replica {replica.name} could not load adapter {spec.name!r}: {problem}",
                        "adapter_load_failed", type_="service_unavailable", retry_after=5)
        self.outcomes[(spec.name, "loaded")] += 1
        log.info("adapter %s loaded on replica %s", spec.name, replica.name)
        replica.adapter_loaded(spec.name)
        self.core.fleet.refresh_adapters()

    async def _ask(self, replica: Replica, spec: LoadableAdapter) -> tuple[str | None, bool]:
        """None when the replica holds the adapter now, else what went wrong; and whether
        it refused because it holds as many adapters as it may."""
        answer = await self._post(replica, self.settings.load_path, {"lora_name": spec.name, "lora_path": spec.path})
        if isinstance(answer, str):
            return answer, False
        status, text = answer
        if status == 200 or (status == 400 and ALREADY_LOADED in text):
            return None, False
        return f"HTTP {status}: {text[:ERROR_EXCERPT]}", status == 400 and REGISTRY_FULL in text

    async def _post(self, replica: Replica, path: str, body: dict[str, str]) -> tuple[int, str] | str:
        """The replica's status and the start of its answer, or what kept it from answering."""
        session = self._session()
        if session is None:
            return "kvlb is starting"
        headers = {"Authorization": self._authorization} if self._authorization else {}
        try:
            async with asyncio.timeout(self.settings.load_timeout_s):
                async with session.post(replica.url + path, headers=headers, json=body) as resp:
                    text = (await resp.content.read(MAX_ANSWER_CHARS)).decode("utf-8", "replace")
                    return resp.status, text
        except TimeoutError:
            return f"no answer within adapters.load_timeout_s ({self.settings.load_timeout_s} s)"
        except (aiohttp.ClientError, OSError) as exc:
            return f"{exc.__class__.__name__}: {exc}"

    def _full(self, replica: Replica) -> bool:
        """It holds as many adapters as config or the engine says it may."""
        most = replica.max_loaded_loras
        if most is None:
            return False
        listed, configured = replica.discovered_adapters, replica.settings.adapters
        held = len(listed) if not configured else len(listed.union(configured))
        return held >= most

    def _can_take(self, replica: Replica, spec: LoadableAdapter) -> bool:
        """It could load `spec` now, after an unload if it must. Asked of every replica of the
        base model for each request of a loadable adapter, so it only looks for an adapter
        that may go, without pricing them."""
        return not self._full(replica) or self._may_unload(replica, spec)

    def _may_unload(self, replica: Replica, spec: LoadableAdapter) -> bool:
        return next(self._unloadable(replica, spec), None) is not None

    def _unloadable(self, replica: Replica, spec: LoadableAdapter) -> Iterator[str]:
        if not self.settings.unload_to_make_room:
            return iter(())
        # Those config says it serves stay: kvlb would go on routing them there.
        listed = (a for a in replica.discovered_adapters if a not in replica.settings.adapters)
        return unloadable(listed, self._loadable, (spec.name, *self._loading, *self._wanted), replica.adapter_slots)

    def _victim(self, replica: Replica, spec: LoadableAdapter) -> str | None:
        candidates = list(self._unloadable(replica, spec))
        if not candidates:
            return None
        holders: Counter[str] = Counter()
        for other in self.core.fleet.replicas:
            holders.update(other.discovered_adapters.union(other.settings.adapters))
        return unload_choice(candidates, replica.adapter_slots, holders.__getitem__)

    async def _make_room(self, replica: Replica, spec: LoadableAdapter) -> str | None:
        """Unload one adapter from a replica that holds its most; None once it has, else why not."""
        victim = self._victim(replica, spec)
        if victim is None:
            return (_NoRoomLeft(f"no room: it holds {replica.max_loaded_loras} adapters, its most, and none that "
                                "kvlb may unload (each is in use, loading, wanted by a request about to be "
                                "routed, or not among adapters.load_on_demand)")
                    if self.settings.unload_to_make_room else
                    f"it holds {replica.max_loaded_loras} adapters, its most (adapters.unload_to_make_room is off)")
        # Not routed there from now on, so no request of kvlb's meets the unload.
        replica.adapter_unloaded(victim)
        self.core.fleet.refresh_adapters()
        answer = await self._post(replica, self._unload_path, {"lora_name": victim})
        # A 404 says it was gone already, which is what was wanted.
        if not isinstance(answer, str) and answer[0] in (200, 404):
            self.unloads[(victim, "unloaded")] += 1
            replica.adapter_slots.unloaded(victim)
            log.info("adapter %s unloaded from replica %s to make room for %s", victim, replica.name, spec.name)
            return None
        self.unloads[(victim, "failed")] += 1
        # Still there, as far as kvlb can tell; its next listing says for sure.
        replica.adapter_loaded(victim)
        self.core.fleet.refresh_adapters()
        problem = answer if isinstance(answer, str) else f"HTTP {answer[0]}: {answer[1][:ERROR_EXCERPT]}"
        log.warning("adapter %s: replica %s did not unload it: %s", victim, replica.name, problem)
        return f"unloading {victim!r} to make room failed: {problem}"

    def _lock_of(self, replica: Replica) -> asyncio.Lock:
        locks = self._replica_locks
        lock = locks.get(replica.name)
        if lock is None:
            if len(locks) > 2 * len(self.core.fleet.replicas):
                # Replicas gone in a reload: their idle locks go too.
                current = {r.name for r in self.core.fleet.replicas}
                for name in [n for n, held in locks.items() if n not in current and not held.locked()]:
                    del locks[name]
            lock = locks[replica.name] = asyncio.Lock()
        return lock

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily("kvlb_adapter_loads", "LoRA adapters kvlb asked a replica to load on demand",
                                    labels=["adapter", "outcome"])
        for (adapter, outcome), count in list(self.outcomes.items()):
            loads.add_metric([adapter, outcome], count)
        yield loads
        unloads = CounterMetricFamily(
            "kvlb_adapter_unloads", "LoRA adapters kvlb asked a replica to unload, to make room for another",
            labels=["adapter", "outcome"])
        for (adapter, outcome), count in list(self.unloads.items()):
            unloads.add_metric([adapter, outcome], count)
        yield unloads
