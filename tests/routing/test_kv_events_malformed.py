"""A malformed KV event batch is counted and dropped whole, and precise mode goes on.

Engines are not the only ones who may publish on an events socket, and a new engine version
may send a field kvlb does not expect: neither may end the subscription or leave half a batch
in the exact index.
"""

from __future__ import annotations

import logging

import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from balancer.routing.kv_events import MalformedEvents, decode_batch
from balancer.watchers.kv_events import KvEventsCollector, KvEventSubscriber
from loadtest.procs import free_port
from tests.routing.test_kv_events import BS, PROMPT, batch, cached_on, make_tracker, wait_for

TOPIC = b"kv-events"


def stored_map(hashes, parent, tokens, **fields) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU", **fields}


GOOD = stored_map([1, 2], None, PROMPT[:8])
# Each a whole payload, wrong in one way only; none of these is a batch kvlb can apply.
BAD_PAYLOADS = {
    "timestamp a string": msgpack.packb(["soon", [GOOD], 0]),
    "timestamp a numeric string": msgpack.packb(["1.5", [GOOD], 0]),
    "timestamp null": msgpack.packb([None, [GOOD], 0]),
    "timestamp a list": msgpack.packb([[1.0], [GOOD], 0]),
    "timestamp a bool": msgpack.packb([True, [GOOD], 0]),
    "timestamp not a number": msgpack.packb([float("nan"), [GOOD], 0]),
    "rank a string": msgpack.packb([1.0, [GOOD], "0"]),
    "token ids strings": msgpack.packb([1.0, [stored_map([1], None, ["a", "b", "c", "d"])], 0]),
    "token ids floats": msgpack.packb([1.0, [stored_map([1], None, [1.5, 2.0, 3.0, 4.0])], 0]),
    "token ids negative": msgpack.packb([1.0, [stored_map([1], None, [-1, 2, 3, 4])], 0]),
    "token ids past 32 bits": msgpack.packb([1.0, [stored_map([1], None, [1 << 32, 2, 3, 4])], 0]),
    "token ids a string": msgpack.packb([1.0, [stored_map([1], None, "abcd")], 0]),
    "token ids bytes": msgpack.packb([1.0, [stored_map([1], None, b"\0" * 16)], 0]),
    "token ids a map": msgpack.packb([1.0, [stored_map([1], None, {1: 2, 3: 4})], 0]),
    "block hash a map": msgpack.packb([1.0, [stored_map([{"h": 1}], None, PROMPT[:4])], 0]),
    "block hash a nested list": msgpack.packb([1.0, [stored_map([[1, [2]]], None, PROMPT[:4])], 0]),
    "block hashes an int": msgpack.packb([1.0, [stored_map(7, None, PROMPT[:4])], 0]),
    "block hashes null": msgpack.packb([1.0, [stored_map(None, None, PROMPT[:4])], 0]),
    "parent a map": msgpack.packb([1.0, [stored_map([3], {"h": 2}, PROMPT[:4])], 0]),
    "block size a string": msgpack.packb([1.0, [stored_map([1], None, PROMPT[:4], block_size="4")], 0]),
    "block size a float": msgpack.packb([1.0, [stored_map([1], None, PROMPT[:4], block_size=4.0)], 0]),
    "block size null": msgpack.packb([1.0, [stored_map([1], None, PROMPT[:4], block_size=None)], 0]),
    "medium a map": msgpack.packb([1.0, [stored_map([1], None, PROMPT[:4], medium={"tier": "GPU"})], 0]),
    "lora id a list": msgpack.packb([1.0, [stored_map([1], None, PROMPT[:4], lora_id=[1])], 0]),
    "removed hash a map": msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [{}], "medium": "GPU"}], 0]),
    "removed medium an int": msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 5}], 0]),
    "array removed without hashes": msgpack.packb([1.0, [["BlockRemoved"]], 0]),
    "array stored hash a map": msgpack.packb([1.0, [["BlockStored", [{}], None, PROMPT[:4], BS, None, "GPU"]], 0]),
    # A good event first: it must not be applied either.
    "good event then a bad one": msgpack.packb([1.0, [GOOD, stored_map([3], 2, PROMPT[8:12], block_size="4")], 0]),
}  # fmt: skip


@pytest.mark.parametrize("payload", BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
def test_each_bad_shape_is_refused_by_decoding(payload):
    with pytest.raises(MalformedEvents):
        decode_batch(payload)


@pytest.mark.parametrize("payload", BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
def test_a_bad_batch_changes_nothing_in_the_index(payload):
    tracker = make_tracker()
    events = tracker.events
    events.receive("a", 0, msgpack.packb([1.0, [GOOD], 0]), now=1.0)
    before = (cached_on(tracker, PROMPT), tracker.exact.entries, dict(events._blocks("a").kvlb_hash))
    with pytest.raises(MalformedEvents):
        events.receive("a", 1, payload, now=1.0)
    assert (cached_on(tracker, PROMPT), tracker.exact.entries, dict(events._blocks("a").kvlb_hash)) == before
    assert events.stats.batches == 1 and events.stats.gaps == 0
    # The sequence did not move on: a batch numbered 1 follows without a gap.
    events.receive("a", 1, msgpack.packb([1.0, [stored_map([3], 2, PROMPT[8:12])], 0]), now=1.0)
    assert events.stats.gaps == 0
    assert cached_on(tracker, PROMPT) == {"a": 12}
    tracker.exact.check_invariants()


def test_the_engines_own_batch_lost_to_garbling_counts_as_a_gap():
    tracker = make_tracker()
    events = tracker.events
    events.receive("a", 0, msgpack.packb([1.0, [GOOD], 0]), now=1.0)
    with pytest.raises(MalformedEvents):
        events.receive("a", 1, BAD_PAYLOADS["removed hash a map"], now=1.0)
    # Its events (an eviction, perhaps) are lost: the replica's entries cannot be trusted.
    events.receive("a", 2, msgpack.packb([1.0, [stored_map([7], None, PROMPT[:4])], 0]), now=1.0)
    assert events.stats.gaps == 1
    assert cached_on(tracker, PROMPT) == {"a": 4}


def test_checks_stop_at_the_edges_of_what_engines_send():
    # Each hash kind, the largest token id, null medium and an integer timestamp all decode...
    payload = msgpack.packb([
        7, [stored_map([1 << 63, b"\1" * 32, [1, 2]], None, [0, (1 << 32) - 1] * 6, medium=None),
            ["BlockRemoved", [b"\1" * 32]], {"type": "BlockRemoved", "block_hashes": [[1, 2]], "medium": "CPU"}],
    ])  # fmt: skip
    timestamp, events, rank = decode_batch(payload)
    assert timestamp == 7.0 and rank is None and len(events) == 3
    # ...one past the largest token id does not.
    with pytest.raises(MalformedEvents, match="token_ids"):
        decode_batch(msgpack.packb([7, [stored_map([1], None, [0, 1, 2, 1 << 32])]]))


# -- over a real ZMQ socket ----------------------------------------------------------------------


class Publisher:
    """A PUB socket on 127.0.0.1 that kvlb's subscriber connects to, past ZMQ's slow joiner."""

    def __init__(self) -> None:
        self.port = free_port()
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def joined(self, stats) -> None:
        def landed() -> bool:
            # PUB drops what it sends before the subscription arrives: keep publishing
            # something harmless until one lands.
            self.socket.send_multipart(batch(self.seq, [{"type": "AllBlocksCleared"}]))
            self.seq += 1
            return stats.batches > 0

        # Clears still on their way land before anything sent next: one socket keeps order.
        await wait_for(landed)

    async def send(self, events) -> None:
        await self.socket.send_multipart(batch(self.seq, events))
        self.seq += 1

    async def send_payload(self, payload: bytes, seq: int) -> None:
        await self.socket.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def metrics_text(stats) -> str:
    registry = CollectorRegistry()
    registry.register(KvEventsCollector(stats))
    return generate_latest(registry).decode()


async def test_malformed_batches_are_counted_and_the_next_good_one_lands(caplog):
    caplog.set_level(logging.DEBUG, logger="kvlb.kv_events")
    tracker = make_tracker()
    stats = tracker.events.stats
    subscriber = KvEventSubscriber(tracker.events, topic="kv")
    publisher = Publisher()
    try:
        subscriber.subscribe("a", publisher.endpoint)
        await publisher.joined(stats)
        await publisher.send([GOOD])
        await wait_for(lambda: cached_on(tracker, PROMPT) == {"a": 8})
        # Every bad shape, each numbered as the next batch would be: none moves the sequence.
        for payload in BAD_PAYLOADS.values():
            await publisher.send_payload(payload, publisher.seq)
        await publisher.send([stored_map([3], 2, PROMPT[8:12])])
        await wait_for(lambda: cached_on(tracker, PROMPT) == {"a": 12})
        assert stats.malformed == len(BAD_PAYLOADS)
        assert stats.gaps == 0
        assert "a" in stats.connected
        assert f"kvlb_kv_events_malformed_total {float(len(BAD_PAYLOADS))}" in metrics_text(stats)
        # One warning for the lot; the rest at debug, so garbage cannot flood the log.
        warnings = [r for r in caplog.records if r.name == "kvlb.kv_events" and r.levelno == logging.WARNING]
        debug = [r for r in caplog.records if r.name == "kvlb.kv_events" and r.levelno == logging.DEBUG]
        assert len(warnings) == 1 and "malformed" in warnings[0].getMessage()
        assert len(debug) == len(BAD_PAYLOADS) - 1
        # The engine's own batch garbled: the sequence shows it lost, and the index starts over.
        await publisher.send_payload(BAD_PAYLOADS["removed hash a map"], publisher.seq)
        publisher.seq += 1
        await publisher.send([stored_map([7], None, PROMPT[:4])])
        await wait_for(lambda: stats.gaps == 1)
        await wait_for(lambda: cached_on(tracker, PROMPT) == {"a": 4})
        assert stats.malformed == len(BAD_PAYLOADS) + 1
    finally:
        publisher.close()
        await subscriber.close()


async def test_an_unexpected_failure_applying_a_batch_drops_the_replicas_entries_not_the_subscription():
    tracker = make_tracker()
    events, stats = tracker.events, tracker.events.stats
    apply = events.apply

    def failing(replica, batch_events):
        apply(replica, batch_events)
        if any(getattr(e, "block_hashes", None) == [99] for e in batch_events):
            raise RuntimeError("a bug, half way through a batch")

    events.apply = failing
    subscriber = KvEventSubscriber(events, topic="kv")
    publisher = Publisher()
    try:
        subscriber.subscribe("a", publisher.endpoint)
        await publisher.joined(stats)
        await publisher.send([GOOD])
        await wait_for(lambda: cached_on(tracker, PROMPT) == {"a": 8})
        await publisher.send([stored_map([3], 2, PROMPT[8:12]), {"type": "BlockRemoved", "block_hashes": [99]}])
        await wait_for(lambda: stats.malformed == 1)
        assert cached_on(tracker, PROMPT) == {}  # half applied: none of it can be trusted
        await publisher.send([stored_map([5, 6], None, PROMPT[:8])])
        await wait_for(lambda: cached_on(tracker, PROMPT) == {"a": 8})
        assert "a" in stats.connected and stats.gaps == 0
    finally:
        publisher.close()
        await subscriber.close()
