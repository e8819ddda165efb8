"""Flow control across instances: each kvlb sharing Redis publishes, every
`sync.load_interval_s`, its tenants' attained service and waiting requests under
`<prefix>:flow:<id>` (expiring after `sync.load_ttl_s`), and reads its peers'. The
controller then orders its own waiters by the tenants' service on every instance together,
and bounds a tenant's waiting requests across all of them.

A place that frees goes first to the instance whose waiting tenant one fair share would
serve next: when a tenant waiting on a peer is in a higher class than this instance's next
request, or has had less service by more than that request's cost (or nothing waits here at
all), the place is handed to that peer on its Redis channel `<prefix>:flow-places:<id>`:
a replica with room, which this instance then counts as taken and the peer as free until
their next load snapshots say so (`StateSync.lend`, `StateSync.credit`). Without it, a
place went back to its own instance's line before a peer heard of it, and with requests
shorter than the exchange the instance serving only a flooding tenant kept its places.
Likewise the request a place was handed for counts as no longer waiting there until the
peer's second snapshot taken after the hand-off (the first may predate its taking the
place): a snapshot read a moment after, but taken before, would otherwise have it still
waiting, and the next place to free would be handed for it again.

It is approximate by the exchange interval: what a peer admitted since its last snapshot is
not counted yet. When Redis is away, or a peer's snapshot lapses, its share leaves the sum and
each instance enforces on its own state (`kvlb_flow_shared_peers` drops to 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from balancer.routing.flow import FlowController

if TYPE_CHECKING:
    from balancer.routing.fleet import Replica
    from balancer.watchers.sync import StateSync

# Hand-offs on their way to Redis at once: beyond, a place stays with its own instance.
MAX_SENDING = 64
# Hand-offs whose requests are counted as no longer waiting on their peers, at most.
MAX_HANDED_FOR = 256
# How long the channel's reader waits for a message before looking again.
LISTEN_S = 1.0


class MalformedShare(ValueError):
    pass


class FlowShare:
    def __init__(self, flow: FlowController, sync: StateSync) -> None:
        """`sync`: the state sync this rides on: its Redis, its peers' load (where a handed
        place is counted) and its counters (a peer's unreadable share or hand-off counts in
        `kvlb_sync_malformed_entries_total`)."""
        self.flow = flow
        self.sync = sync
        key_prefix, instance_id = sync.settings.key_prefix, sync.instance_id
        self.prefix = f"{key_prefix}:flow:"
        self.key = self.prefix + instance_id
        self.places_prefix = f"{key_prefix}:flow-places:"
        self.instance_id = instance_id
        self.ttl_ms = int(sync.settings.load_ttl_s * 1000)
        self.stats = sync.stats
        self.on_room: Callable[[], None] | None = None  # a handed place arrived: look at the line
        self._sending: set[asyncio.Task[None]] = set()
        # [peer, class, tenant, sent at (wall), the first of the peer's snapshots taken after]
        self._handed: list[list[Any]] = []
        flow.hand_off = self.hand_off

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
        where: dict[tuple[str, str], tuple[int, str]] = {}
        peers = 0
        self._handed = [h for h in self._handed if h[3] > wall - self.sync.settings.load_ttl_s]
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                continue  # lapsed between the scan and the read
            try:
                taken, shares = _share_of(raw)
                peer = key[len(self.prefix):].decode()
            except (MalformedShare, UnicodeDecodeError):
                self.stats.malformed += 1
                continue
            peers += 1
            # Faded to now on this side, as the controller fades its own.
            fade = math.exp(-max(wall - taken, 0.0) / flow.fairness_window_s)
            unseen = self._handed_unseen(peer, taken)
            for class_name, tenant, attained, queued in shares:
                queued = max(queued - unseen.get((class_name, tenant), 0), 0)
                before = totals.get((class_name, tenant), (0.0, 0))
                totals[(class_name, tenant)] = (before[0] + attained * fade, before[1] + queued)
                if queued > where.get((class_name, tenant), (0, ""))[0]:
                    where[(class_name, tenant)] = (queued, peer)
        flow.set_remote(totals, now, peers, {name: peer for name, (_, peer) in where.items()})

    # -- places handed between instances ---------------------------------------------------

    def hand_off(self, peer: str, model: str | None, class_name: str, tenant: str) -> bool:
        """Gives `peer` a place on a replica of `model` with room here, for `tenant`'s request
        waiting there (the controller's `hand_off`). False: none to give, or too many on
        their way; the place stays."""
        sync = self.sync
        if len(self._sending) >= MAX_SENDING or not sync.can_lend():
            return False
        loop = asyncio.get_running_loop()
        replica = _roomiest(sync.fleet.routable(model, None, loop.time()))
        if replica is None:
            return False
        sync.lend(peer, replica.name)
        sent_at = time.time()
        if len(self._handed) >= MAX_HANDED_FOR:
            del self._handed[0]
        self._handed.append([peer, class_name, tenant, sent_at, None])
        task = loop.create_task(self._send(peer, replica.name, sent_at))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return True

    def _handed_unseen(self, peer: str, taken: float) -> dict[tuple[str, str], int]:
        """Per (class, tenant), the places handed to `peer` that its snapshot taken at
        `taken` may not show yet; forgets those its second snapshot after shows."""
        unseen: dict[tuple[str, str], int] = {}
        kept = []
        for handed in self._handed:
            to, class_name, tenant, sent_at, first_after = handed
            if to == peer and taken > sent_at:
                if first_after is None:
                    handed[4] = first_after = taken
                elif taken > first_after:
                    continue  # the second snapshot since: whatever it shows is so
            if to == peer:
                unseen[(class_name, tenant)] = unseen.get((class_name, tenant), 0) + 1
            kept.append(handed)
        self._handed = kept
        return unseen

    async def _send(self, peer: str, replica: str, sent_at: float) -> None:
        message = orjson.dumps({"r": replica, "t": sent_at, "f": self.instance_id})
        try:
            heard = await self.sync.redis.publish(self.places_prefix + peer, message)
        except (RedisError, OSError, TimeoutError):
            heard = 0
        if not heard:
            self.sync.unlend(peer, replica)  # nobody took it: the place is this instance's again
            self._handed = [h for h in self._handed if not (h[0] == peer and h[3] == sent_at)]

    async def listen(self, redis: Any) -> None:
        """Takes the places peers hand here, for ever (the sync restarts it after an outage)."""
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.places_prefix + self.instance_id)
            while True:
                message = await pubsub.get_message(timeout=LISTEN_S)
                if message is not None:
                    self.take(message.get("data"))
        finally:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await pubsub.aclose()

    def take(self, raw: Any) -> None:
        """One handed place: counted free here until the giver's next snapshot, then the
        line is looked at."""
        try:
            data = orjson.loads(raw)
            replica, sent_at, giver = data["r"], data["t"], data["f"]
            if type(replica) is not str or type(sent_at) not in (int, float) or type(giver) is not str:
                raise ValueError("not {r: replica, t: time, f: instance}")
        except (ValueError, TypeError, KeyError):
            self.stats.malformed += 1
            return
        if replica not in self.sync.fleet.by_name:
            return  # a replica this instance does not route to
        self.sync.credit(giver, replica, float(sent_at))
        self.flow.places_received += 1
        if self.on_room is not None:
            self.on_room()

    def forget(self) -> None:
        """Redis is away: each instance on its own."""
        self.flow.set_remote({}, asyncio.get_running_loop().time(), 0)

    async def leave(self, redis: Any) -> None:
        await redis.delete(self.key)


def _roomiest(replicas: Iterable[Replica]) -> Replica | None:
    """The capped replica with the most room among `replicas` (routable ones: none draining);
    a replica without a cap has no places to hand (requests wait there for
    `limits.max_in_flight`, which is each instance's own)."""
    best, most = None, 0
    for replica in replicas:
        cap = replica.max_concurrency
        if cap is not None and cap - replica.in_flight > most:
            best, most = replica, cap - replica.in_flight
    return best


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
