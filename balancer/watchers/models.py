"""Which models each replica serves, asked of its `/v1/models` and refreshed periodically."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

import aiohttp
import orjson

from balancer.config import ModelDiscoverySettings
from balancer.routing.fleet import Fleet, Replica

log = logging.getLogger("kvlb.discovery")
MAX_MODELS_PER_REPLICA = 1024
# vLLM's gauge of its LoRA slots and the adapters its requests run and wait on.
LORA_INFO = "vllm:lora_requests_info"
# A replica's /metrics is read this far for it, no further: an engine's page is tens of KiB.
MAX_METRICS_BYTES = 4 << 20
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    """A label value as Prometheus's text format escapes it (backslash, quote, newline)."""
    if "\\" not in value:
        return value
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


class ModelWatcher:
    def __init__(
        self,
        fleet: Fleet,
        settings: ModelDiscoverySettings,
        session: aiohttp.ClientSession,
        on_capacity: Callable[[Replica, int], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.session = session
        # Wanted by cache-aware routing: the KV capacity SGLang (and the simulated replica)
        # report on /get_server_info, for replicas whose config does not give it.
        self.on_capacity = on_capacity

    async def _get_json(self, replica: Replica, path: str) -> object:
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                async with self.session.get(replica.url + path) as resp:
                    if resp.status != 200:
                        return None
                    return orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            log.debug("GET %s on %s failed: %r", path, replica.name, exc)
            return None

    async def refresh_replica(self, replica: Replica) -> None:
        await self._refresh_models(replica)
        serves_adapters = bool(replica.discovered_adapters or replica.settings.adapters)
        # SGLang says how many adapters it batches at once only on /get_server_info.
        wants_slots = serves_adapters and replica.settings.max_loras is None and not replica.engine_max_loras
        wants_capacity = self.on_capacity is not None and replica.kv_capacity_tokens is None
        wants_registry_cap = (serves_adapters and replica.settings.max_loaded_loras is None
                              and replica.engine_max_loaded_loras is None)
        if wants_slots or wants_capacity or wants_registry_cap:
            info = await self._get_json(replica, "/get_server_info")
            if isinstance(info, dict):
                # SGLang's --max-loaded-loras; an engine without it (vLLM) has no such limit.
                registered = info.get("max_loaded_loras")
                replica.engine_max_loaded_loras = registered if type(registered) is int and registered > 0 else 0
                tokens = info.get("max_total_num_tokens", info.get("kv_capacity_tokens"))
                if wants_capacity and isinstance(tokens, int) and tokens > 0:
                    assert self.on_capacity is not None
                    self.on_capacity(replica, tokens)
                slots = info.get("max_loras_per_batch")
                if wants_slots and type(slots) is int and slots > 0:
                    self._engine_slots(replica, slots)
        if serves_adapters:
            await self._lora_requests_info(replica)

    def _engine_slots(self, replica: Replica, slots: int) -> None:
        """What the engine reported holding at once; config's `max_loras`, where it names one, wins."""
        replica.engine_max_loras = slots
        if replica.settings.max_loras is None and slots != replica.adapter_slots.capacity:
            replica.adapter_slots.resize(slots)

    async def _lora_requests_info(self, replica: Replica) -> None:
        """vLLM's `vllm:lora_requests_info` gauge: its `max_lora` slots, and the adapters its
        running requests use now, which kvlb's account of the slots takes as resident."""
        labels = await self._newest_sample(replica, LORA_INFO)
        if labels is None:
            return
        slots = labels.get("max_lora", "")
        if slots.isdigit() and int(slots) > 0:
            self._engine_slots(replica, int(slots))
        running = [name for name in labels.get("running_lora_adapters", "").split(",") if name]
        if running:
            replica.adapter_slots.running_on_engine(running[:replica.adapter_slots.capacity])

    async def _newest_sample(self, replica: Replica, family: str) -> dict[str, str] | None:
        """The labels of the newest sample of the gauge `family` on the replica's /metrics
        (vLLM sets such info gauges to the time they were updated), read within
        MAX_METRICS_BYTES; None when there is none."""
        prefix = family.encode() + b"{"
        newest: tuple[float, bytes] | None = None
        read = 0
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                async with self.session.get(replica.url + "/metrics") as resp:
                    if resp.status != 200:
                        return None
                    async for line in resp.content:
                        read += len(line)
                        if read > MAX_METRICS_BYTES:
                            break
                        if line.startswith(prefix):
                            labels, _, value = line.rpartition(b"}")
                            try:
                                at = float(value.split()[0])
                            except (ValueError, IndexError):
                                continue
                            if newest is None or at > newest[0]:
                                newest = (at, labels[len(prefix):])
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log.debug("GET /metrics on %s failed: %r", replica.name, exc)
            return None
        if newest is None:
            return None
        text = newest[1].decode("utf-8", "replace")
        return {name: _unescape(value) for name, value in _LABEL.findall(text)}

    async def _refresh_models(self, replica: Replica) -> None:
        changed = replica.adapters_changed
        payload = await self._get_json(replica, "/v1/models")
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return
        if replica.adapters_changed != changed:
            return  # kvlb loaded or unloaded an adapter there meanwhile: this listing is older
        cards = tuple(
            card for card in data[:MAX_MODELS_PER_REPLICA]
            if isinstance(card, dict) and isinstance(card.get("id"), str)
        )
        replica.model_cards = cards
        replica.discovered_models = frozenset(card["id"] for card in cards)
        # vLLM lists each LoRA adapter with the base model it applies to as `parent`.
        adapters = frozenset(
            card["id"] for card in cards if isinstance(card.get("parent"), str) and card["parent"])
        if adapters != replica.discovered_adapters:
            replica.discovered_adapters = adapters
            self.fleet.refresh_adapters()

    async def refresh_once(self) -> None:
        await asyncio.gather(*(self.refresh_replica(r) for r in self.fleet.replicas))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self.refresh_once()
