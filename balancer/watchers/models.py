"""Which models each replica serves, asked of its `/v1/models` and refreshed periodically."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import orjson

from balancer.config import ModelDiscoverySettings
from balancer.routing.fleet import Fleet, Replica

log = logging.getLogger("kvlb.discovery")
MAX_MODELS_PER_REPLICA = 1024


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
        if self.on_capacity is not None and replica.kv_capacity_tokens is None:
            info = await self._get_json(replica, "/get_server_info")
            if isinstance(info, dict):
                tokens = info.get("max_total_num_tokens", info.get("kv_capacity_tokens"))
                if isinstance(tokens, int) and tokens > 0:
                    self.on_capacity(replica, tokens)
        payload = await self._get_json(replica, "/v1/models")
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return
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
