"""Flow control across instances: each kvlb sharing Redis publishes, every
`sync.load_interval_s`, its tenants' attained service and waiting requests under
`<prefix>:flow:<id>` (expiring after `sync.load_ttl_s`), and reads its peers'. The
controller then orders its own waiters by the tenants' service on every instance together,
and bounds a tenant's waiting requests across all of them.

It is approximate by the exchange interval: what a peer admitted since its last snapshot is
not counted yet. When Redis is away, or a peer's snapshot lapses, its share leaves the sum and
each instance enforces on its own state (`kvlb_flow_shared_peers` drops to 0).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson

from balancer.routing.flow import FlowController

if TYPE_CHECKING:
    from balancer.watchers.sync import SyncStats


class MalformedShare(ValueError):
    pass


class FlowShare:
    def __init__(self, flow: FlowController, key_prefix: str, instance_id: str, ttl_s: float,
                 stats: SyncStats) -> None:
        """`stats`: the sync's counters, where a peer's unreadable share is counted
        (`kvlb_sync_malformed_entries_total`)."""
        self.flow = flow
        self.prefix = f"{key_prefix}:flow:"
        self.key = self.prefix + instance_id
        self.ttl_ms = int(ttl_s * 1000)
        self.stats = stats

    async def exchange(self, redis: Any) -> None:
        """Publish this instance's share, then take the peers' (one SET, a SCAN, one MGET)."""
        flow = self.flow
        now = asyncio.get_running_loop().time()
        wall = time.time()
        await redis.set(self.key, orjson.dumps({"t": wall, "s": flow.shared_state(now)}), px=self.ttl_ms)
        own = self.key.encode()
        keys = [key async for key in redis.scan_iter(match=self.prefix + "*", count=1000) if key != own]
        raws = await redis.mget(keys) if keys else []
        totals: dict[tuple[str, str], tuple[float, int]] = {}
        peers = 0
        for raw in raws:
            if raw is None:
                continue  # lapsed between the scan and the read
            try:
                taken, shares = _share_of(raw)
            except MalformedShare:
                self.stats.malformed += 1
                continue
            peers += 1
            # Faded to now on this side, as the controller fades its own.
            fade = math.exp(-max(wall - taken, 0.0) / flow.fairness_window_s)
            for class_name, tenant, attained, queued in shares:
                before = totals.get((class_name, tenant), (0.0, 0))
                totals[(class_name, tenant)] = (before[0] + attained * fade, before[1] + queued)
        flow.set_remote(totals, now, peers)

    def forget(self) -> None:
        """Redis is away: each instance on its own."""
        self.flow.set_remote({}, asyncio.get_running_loop().time(), 0)

    async def leave(self, redis: Any) -> None:
        await redis.delete(self.key)


def _share_of(raw: Any) -> tuple[float, Iterable[tuple[str, str, float, int]]]:
    try:
        data = orjson.loads(raw)
    except (ValueError, TypeError) as exc:
        raise MalformedShare(str(exc)) from None
    taken = data.get("t") if isinstance(data, dict) else None
    shares = data.get("s") if isinstance(data, dict) else None
    if type(taken) not in (int, float) or not isinstance(shares, list):
        raise MalformedShare("not {t: time, s: [[class, tenant, attained, queued]]}")
    for share in shares:
        if not (isinstance(share, list) and len(share) == 4 and type(share[0]) is str and type(share[1]) is str
                and type(share[2]) in (int, float) and math.isfinite(share[2]) and share[2] >= 0
                and type(share[3]) is int and share[3] >= 0):
            raise MalformedShare("a share is not [class, tenant, attained, queued]")
    return float(taken), shares
