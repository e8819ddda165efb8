"""Routing state shared between kvlb instances through Redis, so several route as one.

Three things travel, all in background tasks; a request never waits for Redis:

- Routing events. Each request sent to a replica becomes (replica, time, the prompt's block
  hashes, its LoRA adapter or None). Events wait in a bounded queue and leave every
  `publish_interval_s` as one entry per batch on the instance's own Redis stream
  (`<prefix>:routes:<id>`, trimmed to about `stream_max_len` entries); the adapters, where
  any event has one, in a field of their own that older instances do not read. Each
  instance reads its peers' streams and records their events in its own prefix index, and
  their adapters in its account of each replica's adapter slots, so a conversation's next
  turn finds its replica, and an adapter the replica that loaded it, whichever instance it
  reaches.
- Load. Every `load_interval_s` each instance writes its own per-replica in-flight requests,
  queued prefill tokens, decoding requests, their context tokens and the LoRA adapter loads
  they wait out (ms) under `<prefix>:instance:<id>`, expiring after
  `load_ttl_s`, and reads the others' keys; the same snapshot also rides on every stream
  entry, and an entry goes out when only the load changed, so peers see a request end within
  a batch interval. A replica's load is this instance's own plus the peers' newest
  snapshots (`Replica.set_remote_load`).
- Flow control's shares, with the load: each tenant's attained service and waiting requests
  (`watchers/flow_share.py`), and places handed to a peer whose tenant should go next, on
  that peer's channel: a handed place counts as taken here and free there until the
  next snapshots show it (`lend`, `credit`).
- Membership. That key is also the heartbeat: an instance that dies stops refreshing it, and
  its load vanishes from everyone's view within `load_ttl_s`.

When Redis is unreachable or slow each command gives up after `timeout_s`; the instance
routes on its own state, logs one warning, counts the errors, drops the peers' load once it
is older than `load_ttl_s`, and picks up the stream where it left off when Redis returns.

What peers wrote is checked whole before any of it is used: a stream entry, load snapshot or
key of a shape this version does not write (another version's, or anything else's under the
same prefix) is counted (`kvlb_sync_malformed_entries_total`) and skipped, and reading goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import reprlib
import secrets
import socket
import time
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from redis.exceptions import RedisError

from balancer.config import SyncSettings
from balancer.logs import ThrottledWarnings
from balancer.protocol import METRIC_SYNC_LAG
from balancer.routing.fleet import Fleet
from balancer.routing.tracker import CacheTracker
from balancer.watchers.flow_share import FlowShare

log = logging.getLogger("kvlb.sync")

READ_BATCH = 1000  # stream entries per read
MAX_BATCH = 1000  # routing events per stream entry
STREAM_EXPIRY_S = 3600
MAX_DEPARTED = 1000
# One warning per peer this often about what it wrote that cannot be read; the rest at debug.
WARN_EVERY_S = 60.0
# The lag histogram's upper bounds, seconds: decisions should reach peers within milliseconds.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))
RETRY_S = (0.2, 0.5, 1.0, 2.0)
# Places handed to peers, and from them, not yet shown by a snapshot: beyond, none is handed.
MAX_HANDED = 256


class MalformedEntry(ValueError):
    """Something a peer wrote that is not what this version of kvlb writes."""


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SyncStats:
    """Counts for /metrics; plain numbers, so the request path pays an increment at most."""

    def __init__(self) -> None:
        self.connected = False
        self.peers = 0
        self.published = 0
        self.applied = 0
        self.dropped = 0
        self.errors = 0
        self.malformed = 0  # peers' stream entries, snapshots, flow shares and keys skipped unread
        self.lag_counts = [0] * len(LAG_BUCKETS)
        self.lag_sum = 0.0

    def observe_lag(self, seconds: float) -> None:
        self.lag_sum += seconds
        for i, bound in enumerate(LAG_BUCKETS):
            if seconds <= bound:
                self.lag_counts[i] += 1
                return


class SyncCollector:
    """The `kvlb_sync_*` metrics, registered only when sync is on."""

    def __init__(self, stats: SyncStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats
        yield GaugeMetricFamily("kvlb_sync_connected", "1 while Redis answers, 0 while routing on local state only", value=float(s.connected))
        yield GaugeMetricFamily("kvlb_sync_peers", "Other kvlb instances with a live load snapshot", value=s.peers)
        yield CounterMetricFamily("kvlb_sync_events_published", "Routing events sent to Redis", value=s.published)
        yield CounterMetricFamily("kvlb_sync_events_applied", "Other instances' routing events recorded in this index", value=s.applied)
        yield CounterMetricFamily("kvlb_sync_events_dropped", "Routing events dropped because Redis stayed away longer than the queue holds", value=s.dropped)
        yield CounterMetricFamily("kvlb_sync_errors", "Redis commands that failed or timed out", value=s.errors)
        yield CounterMetricFamily("kvlb_sync_malformed_entries", "Other instances' stream entries, load snapshots, flow-control shares and keys skipped because this version cannot read them", value=s.malformed)
        buckets, running = [], 0
        for bound, count in zip(LAG_BUCKETS, s.lag_counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
        lag = HistogramMetricFamily(METRIC_SYNC_LAG, "From another instance's routing decision to its recording here")
        lag.add_metric([], buckets, s.lag_sum)
        yield lag


class StateSync:
    def __init__(self, settings: SyncSettings, fleet: Fleet, tracker: CacheTracker | None) -> None:
        assert settings.redis_url is not None
        self.settings = settings
        self.fleet = fleet
        self.tracker = tracker
        self.instance_id = settings.instance_id or default_instance_id()
        self.stats = SyncStats()
        self.stream_prefix = f"{settings.key_prefix}:routes:"
        self.stream_key = self.stream_prefix + self.instance_id
        self.instance_prefix = f"{settings.key_prefix}:instance:"
        self.redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.timeout_s,
        )
        # A separate connection for the blocking stream read, so it never holds up the others.
        self.reader = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.timeout_s + 1.0,
            socket_connect_timeout=settings.timeout_s,
        )
        self._pending: deque[tuple[str, float, bytes, str | None]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        # Per peer stream, the id of the last entry read; a peer seen for the first time is
        # read from the start of its (bounded) stream, which is how a new instance warms up.
        self._last_ids: dict[str, bytes | str] = {}
        self._departed: dict[str, bytes | str] = {}  # positions in streams of peers not seen lately
        # Per live peer: (its wall time when it took the snapshot, {replica: [in flight,
        # queued prefill tokens, decoding, context tokens]}), the newest from its key or its stream.
        self._peer_loads: dict[str, tuple[float, dict[str, list[int]]]] = {}
        self._published_load: dict[str, tuple[int, int, int, int]] | None = None
        self._peers_seen_at = 0.0
        self._down_since: float | None = None
        # Peer names come from what others wrote: bounded like the departed ones.
        self._warnings = ThrottledWarnings(log, WARN_EVERY_S, MAX_DEPARTED)
        if tracker is not None:
            tracker.on_record = self.routed
        # Flow control's shares ride on the load exchange (watchers/flow_share.py).
        self.flow_share: FlowShare | None = None
        # Places on replicas handed to a peer: [peer, replica, its snapshots read since,
        # expiry]; counted as the peer's until its second snapshot after, which shows it.
        self._lent: list[list[Any]] = []
        # Places peers handed here: [peer, replica, its wall time then, expiry]; counted
        # free until a snapshot the giver took after that, which shows it.
        self._credited: list[list[Any]] = []

    # -- the request path: an append, nothing more ---------------------------------------

    def routed(self, replica: str, hashes: Sequence[int], adapter: str | None = None) -> None:
        if len(self._pending) >= self.settings.max_pending_events:
            self._pending.popleft()
            self.stats.dropped += 1
        self._pending.append((replica, time.time(), array("Q", hashes).tobytes(), adapter))

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._keep(self._publish_once, self.settings.publish_interval_s)),
            loop.create_task(self._keep(self._exchange_load, self.settings.load_interval_s)),
        ]
        if self.flow_share is not None:
            share = self.flow_share
            self._tasks.append(loop.create_task(self._keep(lambda: share.listen(self.redis), 0.0)))
        # Peers' streams carry their load too, so they are read whatever the policy.
        self._tasks.append(loop.create_task(self._keep(self._consume_once, 0.0)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        # Leave at once rather than after the TTL; best effort, Redis may be the reason we stop.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self._publish_once()
            await self.redis.delete(self.instance_prefix + self.instance_id, self.stream_key)
            if self.flow_share is not None:
                await self.flow_share.leave(self.redis)
        for replica in self.fleet.replicas:
            replica.set_remote_load(0, 0, 0, 0, 0)
        for client in (self.redis, self.reader):
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await client.aclose()

    async def _keep(self, step: Any, interval_s: float) -> None:
        """Run `step` every `interval_s` for ever, surviving Redis outages."""
        failures = 0
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # A cancel that arrived inside a Redis command can come out of it as a
                # timeout (the client's own deadline around the read), which the handler
                # below would take for an outage and go on: `stop` would then wait for ever.
                raise asyncio.CancelledError
            try:
                reached = await step()
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed(exc)
                failures += 1
                await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S)) - 1])
                continue
            if reached is False:
                continue  # asked Redis nothing: says nothing of whether it is back
            if failures or not self.stats.connected:
                self._recovered()
            failures = 0
            if interval_s:
                await asyncio.sleep(interval_s)

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        if self.stats.connected or self._down_since is None:
            log.warning("redis at %s unreachable (%s); routing on this instance's own state until it returns",
                        self.settings.redis_url, exc.__class__.__name__)
            self._down_since = time.monotonic()
        self.stats.connected = False
        if time.monotonic() - self._peers_seen_at > self.settings.load_ttl_s:
            self._forget_peers()

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.warning("redis at %s reachable again after %.1f s; sharing state", self.settings.redis_url,
                        time.monotonic() - self._down_since)
            self._down_since = None
        self.stats.connected = True

    # -- routing events --------------------------------------------------------------------

    async def _publish_once(self) -> None:
        """One stream entry per batch, not per event: Redis work and the peers' reading then
        grow with the publish rate, not with the request rate."""
        load = self._local_load()
        if not self._pending and load == self._published_load:
            return
        batch = list(self._pending)[:MAX_BATCH]
        index = orjson.dumps([(replica, at, len(hashes) // 8) for replica, at, hashes, _ in batch])
        fields = {b"e": index, b"h": b"".join(hashes for _, _, hashes, _ in batch), b"l": self._snapshot(load)}
        adapters = [adapter for _, _, _, adapter in batch]
        if any(adapters):
            # A field of its own, one entry per event: instances that predate it read the rest.
            fields[b"a"] = orjson.dumps(adapters)
        pipe = self.redis.pipeline(transaction=False)
        # The load rides along, so peers learn within a batch interval that a request ended,
        # rather than at the next snapshot.
        pipe.xadd(self.stream_key, fields, maxlen=self.settings.stream_max_len, approximate=True)
        # The stream of an instance that died without cleaning up goes away on its own.
        pipe.expire(self.stream_key, STREAM_EXPIRY_S)
        await pipe.execute()
        # Only what was sent leaves the queue; newer events stay for the next batch.
        for _ in batch:
            self._pending.popleft()
        self.stats.published += len(batch)
        self._published_load = load

    async def _consume_once(self) -> bool | None:
        """Each instance writes its own stream, so none reads back what it wrote itself.
        False when there was nothing to ask Redis."""
        block_ms = int(max(self.settings.timeout_s, 0.1) * 1000)
        if not self._last_ids:
            await asyncio.sleep(self.settings.load_interval_s)  # no peer known yet
            return False
        answer = await self.reader.xread(self._last_ids, count=READ_BATCH, block=block_ms)
        for stream, entries in answer or ():
            key = stream.decode()
            peer = key[len(self.stream_prefix):]
            for entry_id, fields in entries:
                # Moved on first, so an entry that cannot be read is never read again.
                self._last_ids[key] = entry_id
                try:
                    self._read_entry(peer, fields)
                except MalformedEntry as exc:
                    self._malformed(peer, "stream entry %s skipped: %s", entry_id, exc)
                except Exception as exc:  # a bug here must not stop this instance reading its peers
                    self._malformed(peer, "stream entry %s failed (%r); skipped", entry_id, exc, exc_info=True)
        if answer:
            self._apply_peer_loads()

    def _read_entry(self, peer: str, fields: Any) -> None:
        if not isinstance(fields, dict):
            raise MalformedEntry("no fields")
        # Both halves are checked before either is used: nothing of a bad entry applies.
        events = _events_of(fields) if self.tracker is not None else None
        snapshot = _snapshot_of(fields[b"l"]) if b"l" in fields else None
        if events is not None:
            self._apply(*events)
        if snapshot is not None:
            self._keep_snapshot(peer, *snapshot)

    def _apply(self, index: list[list[Any]], hashes: array, adapters: list[str | None] | None) -> None:
        record = self.tracker.index.record  # type: ignore[union-attr]
        known = self.fleet.by_name
        now = time.time()
        offset = 0
        for i, (replica, at, count) in enumerate(index):
            path = hashes[offset : offset + count].tolist()
            offset += count
            if replica not in known:
                continue  # a replica this instance does not route to
            record(replica, path)
            if adapters is not None and (adapter := adapters[i]) is not None:
                # The engine's slots follow every instance's requests, not this one's only.
                known[replica].adapter_slots.touched(adapter)
            self.stats.applied += 1
            self.stats.observe_lag(max(0.0, now - at))

    def _malformed(self, peer: str, message: str, *args: Any, exc_info: bool = False) -> None:
        self.stats.malformed += 1
        self._warnings.warn(peer, "peer %s: " + message, peer, *args, exc_info=exc_info)

    # -- load and membership ---------------------------------------------------------------

    def _local_load(self) -> dict[str, tuple[int, int, int, int, int]]:
        return {replica.name: replica.local_load() for replica in self.fleet.replicas}

    @staticmethod
    def _snapshot(load: dict[str, tuple[int, int, int, int, int]]) -> bytes:
        return orjson.dumps({"t": time.time(), "l": load})

    def _keep_snapshot(self, peer: str, taken: float, load: dict[str, list[int]]) -> None:
        known = self._peer_loads.get(peer)
        if known is None or taken >= known[0]:
            self._peer_loads[peer] = (taken, load)
            if self._lent or self._credited:
                self._settle(peer, taken)

    # -- places handed between instances (flow control) -----------------------------------

    def can_lend(self) -> bool:
        return len(self._lent) < MAX_HANDED

    def lend(self, peer: str, replica: str) -> None:
        """A place on `replica` handed to `peer`: taken, as far as this instance can tell."""
        self._lent.append([peer, replica, 0, time.monotonic() + self.settings.load_ttl_s])
        self._apply_peer_loads()

    def unlend(self, peer: str, replica: str) -> None:
        for i, (to, name, _, _) in enumerate(self._lent):
            if to == peer and name == replica:
                del self._lent[i]
                self._apply_peer_loads()
                return

    def credit(self, peer: str, replica: str, sent_at: float) -> None:
        """A place on `replica` that `peer` handed here at its `sent_at`: free, until its
        load says so itself."""
        if len(self._credited) >= MAX_HANDED:
            del self._credited[0]
        self._credited.append([peer, replica, sent_at, time.monotonic() + self.settings.load_ttl_s])
        self._apply_peer_loads()

    def _settle(self, peer: str, taken: float) -> None:
        """A snapshot `peer` took at `taken` has been kept: it shows the places it handed here
        before that; the places handed to it show from its second snapshot read after (the
        first may have left before it took them)."""
        self._credited = [c for c in self._credited if c[0] != peer or c[2] > taken]
        for lent in self._lent:
            if lent[0] == peer:
                lent[2] += 1
        self._lent = [lent for lent in self._lent if lent[2] < 2]

    def _apply_peer_loads(self) -> None:
        totals: dict[str, list[int]] = {}
        for _, load in self._peer_loads.values():
            for name, counts in load.items():  # checked by _snapshot_of
                total = totals.setdefault(name, [0, 0, 0, 0, 0])
                for i in range(3):
                    total[i] += counts[i]
                # An older peer sends no context tokens, or no adapter loads.
                for i in range(3, min(len(counts), 5)):
                    total[i] += counts[i]
        if self._lent or self._credited:
            self._handed_into(totals)
        for replica in self.fleet.replicas:
            replica.set_remote_load(*totals.get(replica.name, (0, 0, 0, 0, 0)))
        self.stats.peers = len(self._peer_loads)

    def _handed_into(self, totals: dict[str, list[int]]) -> None:
        """Adds the places handed away and takes off those handed here; a hand-off no
        snapshot has shown within `load_ttl_s` is dropped."""
        now = time.monotonic()
        self._lent = [lent for lent in self._lent if lent[3] > now]
        self._credited = [c for c in self._credited if c[3] > now]
        for _, name, _, _ in self._lent:
            totals.setdefault(name, [0, 0, 0, 0, 0])[0] += 1
        for _, name, _, _ in self._credited:
            total = totals.setdefault(name, [0, 0, 0, 0, 0])
            total[0] = max(total[0] - 1, 0)

    async def _exchange_load(self) -> None:
        ttl_ms = int(self.settings.load_ttl_s * 1000)
        await self.redis.set(self.instance_prefix + self.instance_id, self._snapshot(self._local_load()), px=ttl_ms)
        own = (self.instance_prefix + self.instance_id).encode()
        keys, peers = [], []
        async for key in self.redis.scan_iter(match=self.instance_prefix + "*", count=1000):
            if key == own:
                continue
            try:
                peers.append(key.decode()[len(self.instance_prefix):])
            except UnicodeDecodeError:
                # No kvlb names itself so; its stream could not be named to Redis either.
                self._malformed(repr(key), "key is not UTF-8; skipped")
                continue
            keys.append(key)
        peer_streams = {self.stream_prefix + peer for peer in peers}
        for stream in self._last_ids.keys() - peer_streams:
            # That instance has gone, or only missed its refresh: if it returns, reading
            # resumes where it stopped instead of replaying its stream.
            self._departed[stream] = self._last_ids.pop(stream)
        for stream in peer_streams - self._last_ids.keys():
            self._last_ids[stream] = self._departed.pop(stream, "0-0")
        while len(self._departed) > MAX_DEPARTED:
            del self._departed[next(iter(self._departed))]
        snapshots = await self.redis.mget(keys) if keys else []
        alive = set()
        for peer, raw in zip(peers, snapshots, strict=True):
            if raw is None:
                continue  # lapsed between the scan and the read
            alive.add(peer)
            try:
                self._keep_snapshot(peer, *_snapshot_of(raw))
            except MalformedEntry as exc:
                self._malformed(peer, "load snapshot skipped: %s", exc)
        for peer in self._peer_loads.keys() - alive:
            del self._peer_loads[peer]  # its key lapsed: it died or left
        self._apply_peer_loads()
        if self.flow_share is not None:
            await self.flow_share.exchange(self.redis)
        self._peers_seen_at = time.monotonic()

    def _forget_peers(self) -> None:
        self._peer_loads.clear()
        self._lent.clear()
        self._credited.clear()
        self._apply_peer_loads()
        if self.flow_share is not None:
            self.flow_share.forget()


def _events_of(fields: dict[bytes, Any]) -> tuple[list[list[Any]], array, list[str | None] | None]:
    """A stream entry's routing events: [[replica, wall time, hash count]], the hashes, and
    each event's LoRA adapter (None: the base model) where any event had one."""
    try:
        index = orjson.loads(fields[b"e"])
        hashes = array("Q")
        hashes.frombytes(fields[b"h"])
    except KeyError as exc:
        raise MalformedEntry(f"no field {exc}") from None
    except (ValueError, TypeError) as exc:  # not JSON; not whole 64-bit hashes
        raise MalformedEntry(f"unreadable events: {exc}") from None
    if not isinstance(index, list):
        raise MalformedEntry("events are not a list")
    total = 0
    for event in index:
        # bool is an int to Python, never in what kvlb writes.
        if not (isinstance(event, list) and len(event) == 3 and type(event[0]) is str
                and type(event[1]) in (int, float) and type(event[2]) is int and event[2] >= 0):
            raise MalformedEntry(f"an event is not [replica, time, hash count]: {reprlib.repr(event)}")
        total += event[2]
    if total != len(hashes):
        raise MalformedEntry(f"events count {total} hashes, the entry holds {len(hashes)}")
    adapters = None
    if b"a" in fields:
        try:
            adapters = orjson.loads(fields[b"a"])
        except (ValueError, TypeError) as exc:
            raise MalformedEntry(f"unreadable adapters: {exc}") from None
        if not (isinstance(adapters, list) and len(adapters) == len(index)
                and all(a is None or (type(a) is str and a) for a in adapters)):
            raise MalformedEntry(f"adapters are not one name or null per event: {reprlib.repr(adapters)}")
    return index, hashes, adapters


def _snapshot_of(raw: Any) -> tuple[float, dict[str, list[int]]]:
    """A peer's load snapshot: (its wall time, {replica: [in flight, queued prefill tokens,
    decoding, their context tokens, the adapter loads they wait out in ms]}); versions before
    the fourth and the fifth send three and four."""
    try:
        snapshot = orjson.loads(raw)
    except (ValueError, TypeError) as exc:
        raise MalformedEntry(f"unreadable load snapshot: {exc}") from None
    taken = snapshot.get("t") if isinstance(snapshot, dict) else None
    load = snapshot.get("l") if isinstance(snapshot, dict) else None
    if type(taken) not in (int, float) or not isinstance(load, dict):
        raise MalformedEntry("a load snapshot is not {t: time, l: {replica: counts}}")
    for counts in load.values():
        # A later version may count more; the first five are these (three or four from older ones).
        if not (isinstance(counts, list) and len(counts) >= 3 and all(type(c) is int for c in counts[:5])):
            raise MalformedEntry(f"a replica's load is not [in flight, prefill tokens, decoding, context tokens]: {reprlib.repr(counts)}")
    return float(taken), load
