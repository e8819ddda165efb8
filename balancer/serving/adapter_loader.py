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
from balancer.routing.core import RoutingCore
from balancer.routing.fleet import Replica
from policies.base import RequestFeatures

log = logging.getLogger("kvlb.adapters")

# An engine asked to load an adapter it already has says so with a 400 (vLLM: "has already
# been loaded"): the adapter is there, which is what was wanted.
ALREADY_LOADED = "already"
ERROR_EXCERPT = 200


class AdapterLoader(Collector):
    def __init__(self, settings: AdapterSettings, core: RoutingCore,
                 session: Callable[[], aiohttp.ClientSession | None], authorization: str | None) -> None:
        self.settings = settings
        self.core = core
        self._session = session
        self._authorization = authorization
        self._loadable = {adapter.name: adapter for adapter in settings.load_on_demand}
        self._loading: dict[str, asyncio.Future[None]] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (adapter, loaded | failed)

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
        load it too; a failure there leaves the request to those already serving it."""
        spec = self.spec(features.model)
        assert spec is not None
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
                  if r.has_room() and not r.serves(spec.name)]
        if not others:
            return
        ranking = self.core.plan(route, features, prompt if isinstance(prompt, str | list) else None,
                                 [*serving, *others]).ranking
        best = ranking[0].replica
        if not any(best is r for r in others):
            return
        assert isinstance(best, Replica)
        pending = self._begin(spec, self._load_on(spec, best))
        try:
            await asyncio.shield(pending)
        except ClientError:
            pass  # counted and logged; the replicas serving it take this request

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
        if not candidates:
            raise ClientError(503, f"no replica serving base model {spec.base!r} can load adapter {spec.name!r} now",
                              "adapter_load_failed", type_="service_unavailable", retry_after=5)
        ranking = self.core.plan(route, features, prompt if isinstance(prompt, str | list) else None, candidates).ranking
        replica = ranking[0].replica
        assert isinstance(replica, Replica)
        await self._load_on(spec, replica)

    async def _load_on(self, spec: LoadableAdapter, replica: Replica) -> None:
        problem = await self._ask(replica, spec)
        if problem is not None:
            self.outcomes[(spec.name, "failed")] += 1
            log.warning("adapter %s: replica %s did not load it: %s", spec.name, replica.name, problem)
            raise ClientError(503, f"replica {replica.name} could not load adapter {spec.name!r}: {problem}",
                              "adapter_load_failed", type_="service_unavailable", retry_after=5)
        self.outcomes[(spec.name, "loaded")] += 1
        log.info("adapter %s loaded on replica %s", spec.name, replica.name)
        # Routable at once; discovery reads the same from the replica's listing later.
        replica.discovered_adapters = replica.discovered_adapters | {spec.name}
        self.core.fleet.refresh_adapters()

    async def _ask(self, replica: Replica, spec: LoadableAdapter) -> str | None:
        """None when the replica holds the adapter now; else what went wrong."""
        session = self._session()
        if session is None:
            return "kvlb is starting"
        headers = {"Authorization": self._authorization} if self._authorization else {}
        try:
            async with asyncio.timeout(self.settings.load_timeout_s):
                async with session.post(replica.url + self.settings.load_path, headers=headers,
                                        json={"lora_name": spec.name, "lora_path": spec.path}) as resp:
                    text = (await resp.text(errors="replace"))[:ERROR_EXCERPT]
                    if resp.status == 200 or (resp.status == 400 and ALREADY_LOADED in text):
                        return None
                    return f"HTTP {resp.status}: {text}"
        except TimeoutError:
            return f"no answer within adapters.load_timeout_s ({self.settings.load_timeout_s} s)"
        except (aiohttp.ClientError, OSError) as exc:
            return f"{exc.__class__.__name__}: {exc}"

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily("kvlb_adapter_loads", "LoRA adapters kvlb asked a replica to load on demand",
                                    labels=["adapter", "outcome"])
        for (adapter, outcome), count in list(self.outcomes.items()):
            loads.add_metric([adapter, outcome], count)
        yield loads
