"""Precise mode's event decoding and the exact index it keeps, fed as engines feed it."""

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from balancer.config import KvEventsSettings, RoutingSettings
from balancer.routing.kv_events import (
    Cleared,
    MalformedEvents,
    Removed,
    Stored,
    decode_batch,
)
from balancer.routing.precise import PreciseTracker
from balancer.watchers.kv_events import KvEventSubscriber
from loadtest.procs import free_port

BS = 4  # block size of these tests' engine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_tracker(clock=None, **kv) -> PreciseTracker:
    return PreciseTracker(RoutingSettings(), KvEventsSettings(enabled=True, block_size=BS, **kv), clock or Clock())


def stored(hashes, parent, tokens, block_size=BS, **kw) -> Stored:
    return Stored(list(hashes), parent, list(tokens), block_size, kw.get("lora_id"), kw.get("medium", "GPU"),
                  kw.get("lora_name"))


PROMPT = list(range(100, 117))  # 17 tokens: 4 whole blocks and one more token


class FakeReplicaState:
    """All the tracker reads of a replica: its name (load is the routing core's)."""

    def __init__(self, name: str) -> None:
        self.name = name


A = FakeReplicaState("a")


def cached_on(tracker: PreciseTracker, prompt) -> dict[str, int]:
    return tracker.predict(prompt).cached


# -- decoding ----------------------------------------------------------------------------------


def test_decodes_map_events_as_current_vllm_sends_them():
    payload = msgpack.packb([
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
             "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": [None, None], "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNewer", "x": 1},
        ],
        0,
    ])
    timestamp, events, rank = decode_batch(payload)
    assert timestamp == 1.5 and rank == 0
    assert events == [stored([11, 12], None, range(8)), Removed([12], "GPU"), Cleared()]


def test_decodes_tagged_arrays_bytes_hashes_and_two_element_batches():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    payload = msgpack.packb([
        2.0,
        [["BlockStored", [h2], h1, [1, 2, 3, 4], 4, None, "GPU"], ["BlockRemoved", [h2], "GPU"], ["AllBlocksCleared"]],
    ])
    _, events, rank = decode_batch(payload)
    assert rank is None
    assert events == [stored([h2], h1, [1, 2, 3, 4]), Removed([h2], "GPU"), Cleared()]


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0]), msgpack.packb([1.0, 5, 0]),
    msgpack.packb([1.0, [{"type": "BlockStored"}], 0]), msgpack.packb([1.0, [7], 0]),
])  # fmt: skip
def test_malformed_batches_are_refused_with_a_reason(payload):
    with pytest.raises(MalformedEvents):
        decode_batch(payload)


# -- the exact index -----------------------------------------------------------------------------


def test_stored_blocks_make_a_prompt_match_to_the_engines_block():
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2], None, PROMPT[:8])])
    tracker.events.apply("a", [stored([3], 2, PROMPT[8:12])])
    assert cached_on(tracker, PROMPT) == {"a": 12}
    # A prompt that differs in its third block matches only two.
    other = PROMPT[:9] + [0] + PROMPT[10:]
    assert cached_on(tracker, other) == {"a": 8}
    tracker.exact.check_invariants()


def test_a_hit_never_covers_the_whole_prompt():
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    # 16 tokens, all cached: the engine computes the last one, so 3 blocks come from cache.
    assert cached_on(tracker, PROMPT[:16]) == {"a": 12}
    assert cached_on(tracker, PROMPT) == {"a": 16}


def test_removal_drops_the_block_and_everything_after_it():
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    tracker.events.apply("b", [stored([21, 22, 23, 24], None, PROMPT[:16])])
    tracker.events.apply("a", [Removed([2], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 4, "b": 16}
    # Removing what is already gone, or was never known, changes nothing.
    tracker.events.apply("a", [Removed([3, 99], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 4, "b": 16}
    tracker.exact.check_invariants()


def test_all_blocks_cleared_forgets_that_replica_only():
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2], None, PROMPT[:8])])
    tracker.events.apply("b", [stored([1, 2], None, PROMPT[:8])])  # engines may reuse hashes
    tracker.events.apply("a", [Cleared()])
    assert cached_on(tracker, PROMPT) == {"b": 8}
    # And the engine's hash 1 no longer maps for a: a child of it is unknown.
    tracker.events.apply("a", [stored([3], 2, PROMPT[8:12])])
    assert tracker.events.stats.unknown_parent == 1
    assert cached_on(tracker, PROMPT) == {"b": 8}


def test_events_kvlb_cannot_use_are_counted_not_indexed():
    tracker = make_tracker()
    tracker.events.apply("a", [
        stored([1], None, PROMPT[:8], block_size=8),  # another block size
        stored([2], None, PROMPT[:4], lora_id=3),  # an adapter's cache, named only by its engine's id
        stored([3], None, PROMPT[:4], medium="CPU"),  # an offloaded copy
        stored([4, 5], None, PROMPT[:4]),  # token count does not fit the blocks
        stored([6], 12345, PROMPT[4:8]),  # parent never seen
    ])
    assert cached_on(tracker, PROMPT) == {}
    assert tracker.events.stats.ignored == 5 and tracker.events.stats.unknown_parent == 1


def test_an_adapters_blocks_match_only_requests_on_that_adapter():
    """vLLM keys its blocks by the adapter's name and says it in `lora_name`: the same tokens
    cached under adapter `sql` are a hit for `sql` only, never for the base model or another."""
    payload = msgpack.packb([1.0, [["BlockStored", [1, 2], None, PROMPT[:8], BS, 1, "GPU", "sql"]]])
    _, events, _ = decode_batch(payload)
    assert events == [stored([1, 2], None, PROMPT[:8], lora_id=1, lora_name="sql")]
    tracker = make_tracker()
    tracker.events.apply("a", events)
    tracker.events.apply("a", [stored([3], 2, PROMPT[8:12], lora_id=1, lora_name="sql")])
    assert tracker.predict(PROMPT, adapter="sql").cached == {"a": 12}
    assert tracker.predict(PROMPT).cached == {}
    assert tracker.predict(PROMPT, adapter="chat").cached == {}
    assert tracker.events.stats.ignored == 0


def test_a_sequence_gap_drops_the_replicas_entries_and_it_rebuilds_from_new_events():
    tracker = make_tracker()
    events = tracker.events
    events.sequence("a", 0)
    events.apply("a", [stored([1, 2], None, PROMPT[:8])])
    events.sequence("a", 1)
    events.apply("a", [stored([3], 2, PROMPT[8:12])])
    assert cached_on(tracker, PROMPT) == {"a": 12}
    events.sequence("a", 5)  # messages 2 to 4 were lost
    assert events.stats.gaps == 1
    assert cached_on(tracker, PROMPT) == {}
    events.apply("a", [stored([7], None, PROMPT[:4])])
    assert cached_on(tracker, PROMPT) == {"a": 4}
    # An engine that restarts counts from 0 again: also a gap.
    events.sequence("a", 0)
    assert events.stats.gaps == 2 and cached_on(tracker, PROMPT) == {}


def test_the_engine_hash_map_is_bounded():
    tracker = make_tracker(max_blocks_per_replica=3)
    tracker.events.apply("a", [stored([1, 2], None, PROMPT[:8])])
    tracker.events.apply("a", [stored([3, 4], 2, PROMPT[8:16])])
    assert cached_on(tracker, PROMPT) == {}  # over the bound: dropped, not grown


# -- speculation --------------------------------------------------------------------------------


def test_a_routed_prompt_counts_as_cached_while_prefilling_and_until_its_events_are_due():
    clock = Clock()
    tracker = make_tracker(clock, speculative_ttl_s=2.0)
    routed = tracker.predict(PROMPT)
    tracker.start(routed, A)
    assert cached_on(tracker, PROMPT) == {"a": 16}
    clock.now += 30  # queued for long: still on its way
    assert cached_on(tracker, PROMPT) == {"a": 16}
    tracker.first_byte(routed, A)  # prefilled: its events follow within speculative_ttl_s
    clock.now += 1.5
    assert cached_on(tracker, PROMPT) == {"a": 16}
    clock.now += 1.0  # no event came: the guess lapses
    assert cached_on(tracker, PROMPT) == {}
    tracker.finish(routed, A, answered=True, prefilled=True)
    # The exact index is untouched by routing.
    assert tracker.exact.entries == 0


def test_a_failed_attempt_leaves_no_guess():
    tracker = make_tracker()
    routed = tracker.predict(PROMPT)
    tracker.start(routed, A)
    tracker.finish(routed, A, answered=False, prefilled=False)
    assert cached_on(tracker, PROMPT) == {}


def test_pending_prompts_sharing_a_prefix_leave_one_at_a_time():
    tracker = make_tracker()
    short, long = tracker.predict(PROMPT[:9]), tracker.predict(PROMPT)
    tracker.start(short, A)
    tracker.start(long, A)
    tracker.finish(long, A, answered=False, prefilled=False)
    assert cached_on(tracker, PROMPT) == {"a": 8}  # the shorter prompt still holds its blocks
    tracker.finish(short, A, answered=False, prefilled=False)
    assert cached_on(tracker, PROMPT) == {}
    assert tracker._pending == {} and tracker.pending.entries == 0


# -- over real ZMQ sockets -----------------------------------------------------------------------


async def wait_for(condition, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def batch(seq: int, events, topic=b"kv-events") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([0.0, events, 0])]


@pytest.mark.parametrize("kvlb_binds", [False, True])
async def test_subscriber_follows_a_publisher_either_side_binding(kvlb_binds):
    port = free_port()
    tracker = make_tracker()
    subscriber = KvEventSubscriber(tracker.events, topic="kv")
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        if kvlb_binds:
            subscriber.subscribe("a", f"tcp://*:{port}")
            await asyncio.sleep(0.1)
            pub.connect(f"tcp://127.0.0.1:{port}")
        else:
            pub.bind(f"tcp://127.0.0.1:{port}")
            subscriber.subscribe("a", f"tcp://127.0.0.1:{port}")
        event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                 "token_ids": PROMPT[:8], "block_size": BS, "lora_id": None, "medium": "GPU"}
        seq = 0

        def connected() -> bool:
            nonlocal seq
            # PUB drops what it sends before the subscription arrives (ZMQ's slow joiner), so
            # keep publishing something harmless until the first batch lands.
            pub.send_multipart(batch(seq, [{"type": "AllBlocksCleared"}]))
            seq += 1
            return tracker.events.stats.batches > 0

        await wait_for(connected)
        await pub.send_multipart(batch(seq, [event]))
        seq += 1
        await wait_for(lambda: bool(cached_on(tracker, PROMPT)))
        assert cached_on(tracker, PROMPT) == {"a": 8}
        # Another topic is not subscribed; garbage is counted and skipped.
        await pub.send_multipart(batch(seq, [{"type": "AllBlocksCleared"}], topic=b"other"))
        await pub.send_multipart([b"kv-events", b"short", b"x"])
        await pub.send_multipart([b"kv-events", b"\0" * 8, b"\xc1"])
        await pub.send_multipart(batch(seq, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}]))
        await wait_for(lambda: cached_on(tracker, PROMPT) == {"a": 4})
        assert tracker.events.stats.malformed == 2
        assert tracker.events.stats.gaps == 0
    finally:
        pub.close(0)
        context.term()
        await subscriber.close()


def test_an_eviction_overrules_a_routing_guess_on_that_replica():
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    routed = tracker.predict(PROMPT)
    tracker.start(routed, A)  # the guess: a holds the whole prompt
    tracker.first_byte(routed, A)  # and has prefilled it: its events are on the way
    tracker.index.record("b", routed.hashes)  # b too (another instance routed it there)
    # Under memory pressure the engine evicts the prompt's tail before the guess lapses.
    tracker.events.apply("a", [Removed([3], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 8, "b": 16}


def test_a_block_stays_until_its_last_copy_is_removed():
    # Two requests prefilling the same prefix at once: vLLM caches two physical copies under
    # one hash, and later evicts them one at a time.
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2], None, PROMPT[:8])])
    tracker.events.apply("a", [stored([1, 2], None, PROMPT[:8])])
    tracker.events.apply("a", [Removed([2], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 8}
    tracker.events.apply("a", [Removed([2], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 4}
    # A cleared engine has no copies left either.
    tracker.events.apply("a", [stored([2], 1, PROMPT[4:8]), stored([2], 1, PROMPT[4:8]), Cleared()])
    tracker.events.apply("a", [stored([1, 2], None, PROMPT[:8]), Removed([2], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 4}


def test_an_eviction_does_not_cancel_the_guess_of_a_prompt_still_being_prefilled():
    tracker = make_tracker()
    tracker.events.apply("a", [stored([1, 2, 3, 4], None, PROMPT[:16])])
    waiting = tracker.predict(PROMPT)
    tracker.start(waiting, A)  # sent, no first byte yet
    # The engine evicts the tail before it schedules the request, which will compute it again.
    tracker.events.apply("a", [Removed([3], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 16}
    # Once answered, an eviction is believed at once.
    tracker.first_byte(waiting, A)
    tracker.events.apply("a", [Removed([2], "GPU")])
    assert cached_on(tracker, PROMPT) == {"a": 4}
    tracker.finish(waiting, A, answered=True, prefilled=True)
    assert tracker._pending == {}
