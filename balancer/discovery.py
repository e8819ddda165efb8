"""Which models each replica serves, asked of its `/v1/models` and refreshed periodically."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from balancer.config import ModelDiscovery as ModelDiscoverySettings
from balancer.fleet import Fleet, Replica

log = logging.getLogger("kvlb.discovery")
MAX_MODELS_PER_REPLICA = 1024


class ModelDiscovery:
    def __init__(
        self, fleet: Fleet, settings: ModelDiscoverySettings, session: aiohttp.ClientSession
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.session = session

    async def refresh_replica(self, replica: Replica) -> None:
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                async with self.session.get(replica.url + "/v1/models") as resp:
                    if resp.status != 200:
                        return
                    payload = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            log.debug("model discovery on %s failed: %r", replica.name, exc)
            return
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return
        cards = tuple(
            card for card in data[:MAX_MODELS_PER_REPLICA]
            if isinstance(card, dict) and isinstance(card.get("id"), str)
        )
        replica.model_cards = cards
        replica.discovered_models = frozenset(card["id"] for card in cards)

    async def refresh_once(self) -> None:
        await asyncio.gather(*(self.refresh_replica(r) for r in self.fleet.replicas))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self.refresh_once()
