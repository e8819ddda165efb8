"""Active health checks: GET the health path of every replica on an interval.

A replica leaves the rankings after `unhealthy_threshold` failed checks in a row and comes
back after `healthy_threshold` good ones, so one slow answer does not flap it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from balancer.config import HealthSettings
from balancer.routing.fleet import Fleet, Replica

log = logging.getLogger("kvlb.health")


class HealthChecker:
    def __init__(
        self,
        fleet: Fleet,
        settings: HealthSettings,
        session: aiohttp.ClientSession,
        on_change: Callable[[Replica, bool], None] | None = None,
        on_answering: Callable[[Replica], None] | None = None,
    ) -> None:
        """`on_change`: a replica turned healthy (True) or unhealthy (False). `on_answering`:
        a check passed after none had or after a failed one, healthy or not yet."""
        self.fleet = fleet
        self.settings = settings
        self.session = session
        self.on_change = on_change
        self.on_answering = on_answering
        self._streak: dict[str, int] = {}  # >0: good checks in a row, <0: failed ones

    async def probe(self, replica: Replica) -> bool:
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                async with self.session.get(replica.url + self.settings.path) as resp:
                    await resp.read()
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def forget(self, name: str) -> None:
        """A replica left the fleet: its streak goes with it."""
        self._streak.pop(name, None)

    def record(self, replica: Replica, ok: bool) -> None:
        before = self._streak.get(replica.name, 0)
        streak = max(before, 0) + 1 if ok else min(before, 0) - 1
        self._streak[replica.name] = streak
        if ok and before <= 0 and self.on_answering is not None:
            self.on_answering(replica)
        if replica.healthy and -streak >= self.settings.unhealthy_threshold:
            replica.healthy = False
            log.warning("replica %s is unhealthy after %d failed checks", replica.name, -streak)
            if self.on_change is not None:
                self.on_change(replica, False)
        elif not replica.healthy and streak >= self.settings.healthy_threshold:
            replica.healthy = True
            log.info("replica %s is healthy again", replica.name)
            if self.on_change is not None:
                self.on_change(replica, True)

    async def check_once(self) -> None:
        replicas = self.fleet.replicas
        results = await asyncio.gather(*(self.probe(r) for r in replicas))
        for replica, ok in zip(replicas, results, strict=True):
            self.record(replica, ok)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.check_once()
            except Exception:  # a checker that dies silently would freeze health forever
                log.exception("health check round failed")
