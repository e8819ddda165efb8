"""Replica sets from DNS: resolve each set's host name periodically; every address is a
replica, added when it appears and removed (in-flight requests finish) when it goes.

A failed or empty resolution changes nothing: a DNS hiccup must not empty the fleet. The
resolver is injected, so tests can play any sequence of answers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from balancer.config import ReplicaSetSettings, ReplicaSettings
from balancer.routing.fleet import Fleet, Replica

log = logging.getLogger("kvlb.dns")
RESOLVE_TIMEOUT_S = 5.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def member_settings(replica_set: ReplicaSetSettings, address: str) -> ReplicaSettings:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return ReplicaSettings(
        url=f"{replica_set.scheme}://{host}:{replica_set.port}",
        name=f"{replica_set.host}/{host}:{replica_set.port}",
        model=replica_set.model,
        labels=replica_set.labels,
        weight=replica_set.weight,
        max_concurrency=replica_set.max_concurrency,
        kv_capacity_tokens=replica_set.kv_capacity_tokens,
        kv_events_endpoint=(
            None if replica_set.kv_events_port is None else f"tcp://{host}:{replica_set.kv_events_port}"
        ),
    )


class DnsDiscovery:
    def __init__(
        self,
        sets: tuple[ReplicaSetSettings, ...],
        fleet: Fleet,
        resolver: Resolver = system_resolver,
        on_added: Callable[[Replica], None] = lambda replica: None,
        on_removed: Callable[[Replica], None] = lambda replica: None,
    ) -> None:
        self.sets = sets
        self.fleet = fleet
        self.resolver = resolver
        self.on_added = on_added
        self.on_removed = on_removed
        self._members: dict[int, set[str]] = {i: set() for i in range(len(sets))}

    async def refresh_set(self, index: int) -> None:
        replica_set = self.sets[index]
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                addresses = await self.resolver(replica_set.host, replica_set.port)
        except (OSError, TimeoutError, ValueError) as exc:
            log.warning("resolving %s failed (%r); its replicas stay as they were", replica_set.host, exc)
            return
        if not addresses:
            log.warning("%s resolved to no address; its replicas stay as they were", replica_set.host)
            return
        wanted = {member_settings(replica_set, a).name: member_settings(replica_set, a) for a in addresses}
        members = self._members[index]
        for name in sorted(members - wanted.keys()):
            if name in self.fleet.by_name:
                self.on_removed(self.fleet.remove(name))
            log.info("replica %s left (no longer in %s)", name, replica_set.host)
        for name in sorted(wanted.keys() - members):
            if name not in self.fleet.by_name:
                self.on_added(self.fleet.add(wanted[name]))
                log.info("replica %s joined from %s", name, replica_set.host)
        self._members[index] = set(wanted)

    async def refresh_once(self) -> None:
        await asyncio.gather(*(self.refresh_set(i) for i in range(len(self.sets))))

    async def run(self) -> None:
        async def loop_set(index: int) -> None:
            while True:
                await asyncio.sleep(self.sets[index].refresh_s)
                await self.refresh_set(index)

        await asyncio.gather(*(loop_set(i) for i in range(len(self.sets))))
