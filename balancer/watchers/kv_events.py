"""Precise mode's intake: one ZMQ SUB socket per replica, each message decoded and applied
to the exact index (`balancer.routing.kv_events`), and the `kvlb_kv_events_*` metrics.

The message format and what a gap or a malformed message does to the index are described
in `balancer.routing.kv_events`; this module only connects, reconnects and hands messages on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from balancer.logs import ThrottledWarnings
from balancer.routing.kv_events import EventStats, KvEventIndex, MalformedEvents

log = logging.getLogger("kvlb.kv_events")

RECONNECT_S = 1.0
# A publisher that sends garbage sends it with every batch: one warning per replica this
# often, the rest at debug.
WARN_EVERY_S = 60.0


class KvEventsCollector:
    """The `kvlb_kv_events_*` metrics, registered only in precise mode."""

    def __init__(self, stats: EventStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats
        yield GaugeMetricFamily("kvlb_kv_events_subscribed_replicas", "Replicas whose KV event stream is subscribed", value=len(s.connected))
        yield CounterMetricFamily("kvlb_kv_events_batches", "KV event messages applied to the exact index", value=s.batches)
        blocks = CounterMetricFamily("kvlb_kv_events_blocks", "Blocks in KV events, by what became of them", labels=["outcome"])
        blocks.add_metric(["stored"], s.stored_blocks)
        blocks.add_metric(["removed"], s.removed_blocks)
        blocks.add_metric(["unknown_parent"], s.unknown_parent)
        blocks.add_metric(["ignored"], s.ignored)
        yield blocks
        yield CounterMetricFamily("kvlb_kv_events_cleared", "AllBlocksCleared events applied", value=s.cleared)
        yield CounterMetricFamily("kvlb_kv_events_gaps", "Sequence gaps: a replica's entries dropped after lost events", value=s.gaps)
        yield CounterMetricFamily("kvlb_kv_events_malformed", "Messages dropped because they were not well-formed KV event batches", value=s.malformed)
        yield GaugeMetricFamily("kvlb_kv_events_lag_seconds", "From the engine's timestamp to applying its last batch", value=s.last_lag_s)



def is_bind_endpoint(endpoint: str) -> bool:
    """`tcp://*:5557`: kvlb binds and the engine connects (the engine's rule, mirrored)."""
    return endpoint.startswith("tcp://*:")


class KvEventSubscriber:
    """One SUB socket per replica, feeding a `KvEventIndex` from the event loop."""

    def __init__(self, events: KvEventIndex, topic: str = "", clock: Callable[[], float] = time.time) -> None:
        self.events = events
        self.topic = topic.encode()
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._context: Any = None
        self._warnings = ThrottledWarnings(log, WARN_EVERY_S)

    def _zmq(self) -> Any:
        import zmq.asyncio

        if self._context is None:
            self._context = zmq.asyncio.Context()
        return self._context

    def subscribe(self, replica: str, endpoint: str) -> None:
        if replica in self._tasks:
            return
        self._tasks[replica] = asyncio.get_running_loop().create_task(self._run(replica, endpoint))

    def unsubscribe(self, replica: str) -> None:
        task = self._tasks.pop(replica, None)
        if task is not None:
            task.cancel()
        self.events.forget(replica)
        self.events.stats.connected.discard(replica)
        self._warnings.forget(replica)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _run(self, replica: str, endpoint: str) -> None:
        import zmq

        while True:
            sock = self._zmq().socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            try:
                if is_bind_endpoint(endpoint):
                    sock.bind(endpoint)
                else:
                    sock.connect(endpoint)
                self.events.stats.connected.add(replica)
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                watch = asyncio.ensure_future(self._watch(replica, monitor))
                try:
                    await self._receive(replica, sock)
                finally:
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watch
                    sock.disable_monitor()
                    monitor.close(0)
            except zmq.ZMQError as exc:
                log.warning("replica %s: KV events on %s: %s; retrying", replica, endpoint, exc)
            finally:
                self.events.stats.connected.discard(replica)
                sock.close(0)
            await asyncio.sleep(RECONNECT_S)

    async def _watch(self, replica: str, monitor: Any) -> None:
        """A dropped connection to the publisher (the engine restarted, or the network broke)
        may have lost events, and a restarted engine's sequence can resume at any number
        after its first messages are lost to ZMQ's slow joiner: count it as a gap."""
        while True:
            await monitor.recv_multipart()
            self.events.stats.gaps += 1
            log.warning("replica %s: KV event connection dropped; its index entries are dropped", replica)
            self.events.reset(replica)
            self.events.restart_sequence(replica)

    async def _receive(self, replica: str, sock: Any) -> None:
        events, stats = self.events, self.events.stats
        while True:
            parts = await sock.recv_multipart()
            try:
                if len(parts) != 3 or len(parts[1]) != 8:
                    raise MalformedEvents("not three frames [topic, 8-byte sequence number, payload]")
                events.receive(replica, int.from_bytes(parts[1], "big"), parts[2], self._clock())
            except MalformedEvents as exc:
                stats.malformed += 1
                self._complain(replica, "malformed KV event message dropped: %s", exc)
            except Exception as exc:  # a bug here must not end precise mode for the replica
                stats.malformed += 1
                # The batch may be half applied, so the replica's entries cannot be trusted.
                with contextlib.suppress(Exception):
                    events.reset(replica)
                self._complain(replica, "KV event message failed (%r); its index entries are dropped", exc,
                               exc_info=True)

    def _complain(self, replica: str, message: str, *args: Any, exc_info: bool = False) -> None:
        self._warnings.warn(replica, "replica %s: " + message, replica, *args, exc_info=exc_info)
