"""The replica's KV cache events (ZMQ, as vLLM sends them) and its `/tokenize` route.

A real SUB socket on 127.0.0.1 listens while real HTTP requests fill, evict and flush the
replica's prefix cache; the events must say exactly what the cache did.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from loadtest.procs import free_port
from loadtest.replica.cache import PrefixCache
from loadtest.replica.cli import config_from_args
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.engine import Engine, EngineConfig, EngineSequence
from loadtest.replica.kv_events import Encoding, KvEventPublisher, publisher_binds
from loadtest.replica.launch import running_replica
from loadtest.replica.profiles import get_profile
from loadtest.replica.server import ReplicaServer
from loadtest.replica.tokens import ROOT_HASH, chain_hash, chat_tokens, token_ids, word_token_id
from tests.loadtest.test_replica_cli import parse

FAST = 1000.0
BLOCK = 16
# After the link's handshake, the subscription still has to reach the publisher's filter;
# on loopback that takes about a millisecond.
SETTLE_S = 0.1
FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


# -- a subscriber ------------------------------------------------------------------------


@dataclass
class Message:
    topic: bytes
    sequence: int
    timestamp: float
    events: list[dict[str, Any]]  # array events turned into maps
    rank: int


def as_map(event: Any, encoding: str) -> dict[str, Any]:
    if encoding == "map":
        assert isinstance(event, dict)
        return event
    assert isinstance(event, list)
    tag, *values = event
    assert len(values) == len(FIELDS[tag])
    return {"type": tag, **dict(zip(FIELDS[tag], values, strict=True))}


class Subscriber:
    """A SUB socket on 127.0.0.1 that binds when the replica's endpoint makes it connect,
    and connects when the replica binds."""

    def __init__(self, replica_binds: bool, topic: str = "kv-events", encoding: str = "map"):
        self.port = free_port()
        self.encoding = encoding
        self.replica_binds = replica_binds
        self.endpoint = f"tcp://*:{self.port}" if replica_binds else f"tcp://127.0.0.1:{self.port}"
        self._context = zmq.asyncio.Context()
        self.socket = self._context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.subscribe(topic.encode())
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        if not replica_binds:
            self.socket.bind(f"tcp://127.0.0.1:{self.port}")

    async def attach(self) -> None:
        """Once the replica runs: connect if it bound, and wait until the link is up."""
        if self.replica_binds:
            self.socket.connect(f"tcp://127.0.0.1:{self.port}")
        async with asyncio.timeout(5):
            while True:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    break
        # A bound SUB sends its subscription on an accepted link only once its own thread
        # handles the socket's pending commands, which reading the events makes it do.
        self.socket.getsockopt(zmq.EVENTS)
        await asyncio.sleep(SETTLE_S)

    async def message(self, timeout: float = 5.0) -> Message:
        async with asyncio.timeout(timeout):
            topic, number, payload = await self.socket.recv_multipart()
        assert len(number) == 8
        timestamp, events, rank = msgpack.unpackb(payload, raw=False)
        return Message(
            topic,
            int.from_bytes(number, "big"),
            timestamp,
            [as_map(event, self.encoding) for event in events],
            rank,
        )

    async def assert_quiet(self, for_s: float = 0.2) -> None:
        with pytest.raises(TimeoutError):
            await self.message(timeout=for_s)

    def close(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(0)
        self.socket.close(0)
        self._context.term()


@contextlib.asynccontextmanager
async def replica_with_events(
    replica_binds: bool = False,
    encoding: Encoding = "map",
    topic: str = "kv-events",
    **config: Any,
) -> AsyncIterator[tuple[ReplicaServer, Subscriber]]:
    subscriber = Subscriber(replica_binds, topic, encoding)
    try:
        replica_config = ReplicaConfig(
            time_scale=FAST,
            block_size=BLOCK,
            kv_events_endpoint=subscriber.endpoint,
            kv_events_topic=topic,
            kv_events_encoding=encoding,
            **config,
        )
        async with running_replica(replica_config) as server:
            await subscriber.attach()
            yield server, subscriber
    finally:
        subscriber.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def stored(
    hashes: Sequence[int], parent: int | None, ids: Sequence[int], block_size: int = BLOCK
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
    }


def removed(block_hash: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU"}


# -- events from a running replica -------------------------------------------------------


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("replica_binds", [True, False], ids=["replica-binds", "replica-connects"])
async def test_stored_blocks_chain_and_flush_clears(http, replica_binds, encoding):
    topic = "kvlb-test" if encoding == "array" else "kv-events"
    async with replica_with_events(replica_binds, encoding, topic) as (server, sub):
        system = {"role": "system", "content": words("s", 30)}
        # <|system|> + 30 words + <|user|> is exactly two blocks; the user turns part there.
        first = [system, {"role": "user", "content": words("a", 20)}]
        second = [system, {"role": "user", "content": words("b", 20)}]
        first_ids = (await post(http, server.url + "/tokenize", {"messages": first}))["tokens"]
        second_ids = (await post(http, server.url + "/tokenize", {"messages": second}))["tokens"]
        assert len(first_ids) == len(second_ids) == 53  # three full blocks and a partial one

        before = time.time()
        await post(http, server.url + "/v1/chat/completions", {"messages": first, "max_tokens": 1})
        message = await sub.message()
        assert (message.topic, message.sequence, message.rank) == (topic.encode(), 0, 0)
        assert before - 1 <= message.timestamp <= time.time() + 1
        (event,) = message.events
        hashes = event["block_hashes"]
        assert len(hashes) == 3
        assert event == stored(hashes, None, first_ids[: 3 * BLOCK])
        assert all(block_hash in server.engine.cache for block_hash in hashes)

        # The second prompt shares the first two blocks: only its third is new.
        await post(http, server.url + "/v1/chat/completions", {"messages": second, "max_tokens": 1})
        message = await sub.message()
        assert message.sequence == 1
        (event,) = message.events
        assert event == stored(event["block_hashes"], hashes[1], second_ids[2 * BLOCK : 3 * BLOCK])
        assert len(event["block_hashes"]) == 1 and event["block_hashes"][0] not in hashes

        async with http.post(server.url + "/flush_cache") as response:
            assert response.status == 200
        message = await sub.message()
        assert message.sequence == 2
        assert message.events == [{"type": "AllBlocksCleared"}]
        assert server.engine.cache.cached_blocks == 0
        await sub.assert_quiet()

        async with http.get(server.url + "/get_server_info") as response:
            info = await response.json()
        assert info["kv_events_endpoint"] == sub.endpoint
        assert info["block_size"] == BLOCK
        assert (info["kv_events_topic"], info["kv_events_encoding"]) == (topic, encoding)
        async with http.get(server.url + "/admin/stats") as response:
            stats = (await response.json())["kv_events"]
        assert (stats["messages_sent"], stats["messages_dropped"]) == (3, 0)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_evicted_blocks_are_removed(http, encoding):
    # Room for four blocks: a second three-block prompt must evict two of the first's.
    async with replica_with_events(encoding=encoding, kv_capacity_tokens=4 * BLOCK) as (
        server,
        sub,
    ):
        first, second = words("a", 3 * BLOCK), words("b", 3 * BLOCK)
        await post(http, server.url + "/v1/completions", {"prompt": first, "max_tokens": 1})
        (event,) = (await sub.message()).events
        first_hashes = event["block_hashes"]
        assert event == stored(first_hashes, None, token_ids(first.split()))

        await post(http, server.url + "/v1/completions", {"prompt": second, "max_tokens": 1})
        message = await sub.message()
        assert message.sequence == 1
        *removals, event = message.events
        # Evicted leaf first, in the same iteration that stores the new prompt's blocks.
        assert removals == [removed(first_hashes[2]), removed(first_hashes[1])]
        assert event == stored(event["block_hashes"], None, token_ids(second.split()))

        # What a subscriber rebuilds from the events is what the cache holds.
        picture = {first_hashes[0], *event["block_hashes"]}
        assert server.engine.cache.cached_blocks == len(picture) == 4
        assert all(block_hash in server.engine.cache for block_hash in picture)
        await sub.assert_quiet()


async def test_decoded_blocks_are_stored_as_they_fill(http):
    async with replica_with_events() as (server, sub):
        prompt = words("p", BLOCK + 4)
        body = {"prompt": prompt, "max_tokens": 2 * BLOCK}
        answer = await post(http, server.url + "/v1/completions", body)
        everything = prompt.split() + answer["choices"][0]["text"].split()
        events = []
        sequences = []
        while sum(len(e["block_hashes"]) for e in events) < 3:
            message = await sub.message()
            sequences.append(message.sequence)
            events.extend(message.events)
        assert sequences == list(range(len(sequences)))
        # One block from the prompt, then each block of generated tokens as it fills.
        assert [len(e["block_hashes"]) for e in events] == [1, 1, 1]
        parent = None
        for i, event in enumerate(events):
            assert event["parent_block_hash"] == parent
            assert event["token_ids"] == token_ids(everything[i * BLOCK : (i + 1) * BLOCK])
            parent = event["block_hashes"][0]
        await sub.assert_quiet()


def test_endpoint_forms_follow_vllm():
    assert publisher_binds("tcp://*:5557")
    assert publisher_binds("tcp://[::]:5557")
    assert publisher_binds("ipc:///tmp/kv-events")
    assert not publisher_binds("tcp://127.0.0.1:5557")
    assert not publisher_binds("tcp://balancer.local:5557")


async def test_full_subscriber_makes_messages_drop_and_counts_them():
    port = free_port()
    context = zmq.Context()
    reader = context.socket(zmq.SUB)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.RCVBUF, 4096)
    reader.setsockopt(zmq.LINGER, 0)
    reader.subscribe(b"")
    reader.bind(f"tcp://127.0.0.1:{port}")
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}", hwm=1)
    try:
        await asyncio.sleep(SETTLE_S)
        reader.getsockopt(zmq.EVENTS)  # subscribe on the accepted link (see Subscriber.attach)
        await asyncio.sleep(SETTLE_S)
        block = ["w"] * 4096
        started = time.monotonic()
        for _ in range(5000):
            publisher.blocks_stored([1], None, block)
            publisher.flush()
            if publisher.dropped:
                break
        assert publisher.dropped > 0
        assert publisher.sent > 0  # it was connected: messages went out until the reader filled
        assert publisher.sequence == publisher.sent + publisher.dropped
        assert time.monotonic() - started < 10  # and nothing ever waited on the reader
        # The first message is whole and numbered 0; the gaps show later.
        topic, number, _ = reader.recv_multipart()
        assert (topic, int.from_bytes(number, "big")) == (b"kv-events", 0)
    finally:
        publisher.close()
        reader.close(0)
        context.term()


# -- the cache's listener, without a server ----------------------------------------------


class Replay:
    """A subscriber's picture of the cache, rebuilt from the listener's calls, each checked
    as it comes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: set[int] = set()
        self.calls = {"stored": 0, "removed": 0, "cleared": 0}

    def blocks_stored(
        self, hashes: Sequence[int], parent: int | None, tokens: Sequence[str]
    ) -> None:
        size = self.block_size
        assert hashes and len(tokens) == size * len(hashes)
        assert parent is None or parent in self.blocks
        previous = ROOT_HASH if parent is None else parent
        for i, block_hash in enumerate(hashes):
            assert block_hash not in self.blocks  # a shared block is never stored again
            previous = chain_hash(tokens[i * size : (i + 1) * size], previous)
            assert block_hash == previous  # the tokens are the block's own
            self.blocks.add(block_hash)
        self.calls["stored"] += 1

    def block_removed(self, block_hash: int) -> None:
        self.blocks.remove(block_hash)
        self.calls["removed"] += 1

    def all_cleared(self) -> None:
        self.blocks.clear()
        self.calls["cleared"] += 1

    def matches(self, cache: PrefixCache) -> bool:
        return len(self.blocks) == cache.cached_blocks and all(h in cache for h in self.blocks)


def test_shared_blocks_are_not_stored_again():
    cache = PrefixCache(capacity_tokens=4 * 10, block_size=4)
    replay = Replay(4)
    cache.listener = replay
    tokens = [f"t{i}" for i in range(12)]
    hashes = [chain_hash(tokens[0:4], ROOT_HASH)]
    hashes.append(chain_hash(tokens[4:8], hashes[0]))
    hashes.append(chain_hash(tokens[8:12], hashes[1]))
    cache.allocate(2)
    cache.commit(hashes[:2], None, tokens, 0)
    cache.allocate(3)
    cache.commit(hashes, None, tokens, 0)  # a second request: the first two are shared
    assert replay.calls["stored"] == 2 and replay.matches(cache)
    cache.release(hashes[:2], 0)
    cache.clear()  # the second request still holds its blocks: they stay
    assert replay.calls == {"stored": 2, "removed": 0, "cleared": 0} and replay.matches(cache)
    cache.release(hashes, 0)
    cache.clear()
    assert replay.calls["cleared"] == 1 and replay.matches(cache) and not replay.blocks


@pytest.mark.parametrize("seed", range(4))
def test_replayed_events_rebuild_the_cache(seed):
    rng = random.Random(seed)
    block_size = 4
    engine = Engine(
        EngineConfig(
            profile=get_profile("llama-3.1-8b-h100"),
            kv_capacity_tokens=block_size * 40,
            block_size=block_size,
            max_running=6,
            max_batched_tokens=48,
        )
    )
    replay = Replay(block_size)
    engine.set_cache_listener(replay)
    prefixes = [[f"p{k}w{i}" for i in range(rng.randrange(3, 40))] for k in range(6)]
    live: list[EngineSequence] = []
    now = 0.0

    def step() -> None:
        nonlocal now
        start = engine.next_step_time()
        assert start is not None
        now = max(now, start)
        run = engine.decode_run()
        if run > 1 and rng.random() < 0.5:
            done, end = engine.decode_run_times(now, run)
            engine.advance_decode(now, done, end)
        else:
            engine.step(now)
        now = engine.busy_until

    for round_ in range(2500):
        choice = rng.random()
        if choice < 0.3 and engine.num_waiting < 12:
            tokens = rng.choice(prefixes) + [f"r{round_}x{i}" for i in range(rng.randrange(1, 20))]
            max_tokens = rng.randrange(1, 16)
            if len(tokens) + max_tokens <= engine.max_sequence_tokens:
                live.append(engine.submit(tokens, max_tokens, now))
        elif choice < 0.33:
            engine.clear_cache()  # while requests run: only the unreferenced blocks go
        elif choice < 0.36 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        elif round_ % 400 == 0:
            while engine.has_work:
                step()
            engine.clear_cache()  # idle: everything goes at once
        elif engine.has_work:
            step()
        assert replay.matches(engine.cache)
    assert all(count > 10 for count in replay.calls.values()), replay.calls
    assert engine.cache.evicted_blocks_total > replay.calls["cleared"]


def test_listener_changes_nothing_the_engine_does():
    def run(listen: bool) -> list[tuple[float, int, int]]:
        engine = Engine(
            EngineConfig(profile=get_profile("llama-3.1-8b-h100"), kv_capacity_tokens=16 * 30)
        )
        if listen:
            engine.set_cache_listener(Replay(16))
        rng = random.Random(7)
        now = 0.0
        trace = []
        for n in range(200):
            tokens = [f"shared{i}" for i in range(rng.randrange(0, 64))]
            tokens += [f"q{n}w{i}" for i in range(rng.randrange(1, 64))]
            engine.submit(tokens, rng.randrange(1, 40), now)
            while (start := engine.next_step_time()) is not None and start <= now + 0.05:
                iteration = engine.step(max(now, start))
                assert iteration is not None
                trace.append((iteration.end, iteration.prefill_tokens, iteration.decode_seqs))
            now += 0.05
        return trace

    assert run(True) == run(False)


# -- /tokenize ---------------------------------------------------------------------------


def test_word_token_ids():
    assert [word_token_id(w) for w in ("0", "7", "42", "2147483647")] == [0, 7, 42, 2**31 - 1]
    # Not canonical numerals, too big, not ASCII, or not numerals at all: hashed, top bit set.
    for word in ("007", "2147483648", "99999999999", "٣", "-1", "+1", "hello", "<|user|>"):
        token_id = word_token_id(word)
        assert 2**31 <= token_id < 2**32, word
    assert word_token_id("hello") == word_token_id("hello") != word_token_id("hello!")
    assert token_ids(["a", "5"]) == [word_token_id("a"), 5]


async def test_tokenize_prompt_and_messages(http):
    async with running_replica(ReplicaConfig(time_scale=FAST, context_limit=4096)) as server:
        url = server.url + "/tokenize"
        answer = await post(
            http, url, {"model": "m", "prompt": "hello 42 world", "add_special_tokens": True}
        )
        assert answer == {
            "count": 3,
            "max_model_len": 4096,
            "tokens": [word_token_id("hello"), 42, word_token_id("world")],
        }
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
        ]
        answer = await post(http, url, {"messages": messages, "return_token_strs": True})
        assert answer["tokens"] == token_ids(chat_tokens(messages))
        assert answer["token_strs"] == ["<|system|>", "Be", "brief.", "<|user|>", "Hi", "there",
                                        "<|assistant|>"]  # fmt: skip
        # The count is what the engine sees of the same chat request.
        chat = await post(
            http, server.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 1}
        )
        assert answer["count"] == chat["usage"]["prompt_tokens"] == 7
        # Token ids given to the completion route are the same ids back.
        assert (await post(http, url, {"prompt": "5 17 0"}))["tokens"] == [5, 17, 0]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"{}", "prompt"),
        (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "prompt"),
        (b'{"prompt": [1, 2]}', "prompt"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
        (b'{"prompt": "a", "add_special_tokens": "yes"}', "add_special_tokens"),
        (b'{"prompt": "a", "model": 3}', "model"),
    ],
)
async def test_tokenize_refuses_bad_input(http, body, param):
    async with running_replica(ReplicaConfig(time_scale=FAST)) as server:
        async with http.post(
            server.url + "/tokenize", data=body, headers={"Content-Type": "application/json"}
        ) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert error["message"]


# -- the command line --------------------------------------------------------------------


def test_flags_build_the_config():
    config = config_from_args(parse(["replica", "--port", "0"]))
    assert config.kv_events_endpoint is None
    args = parse(
        ["replica", "--port", "0", "--kv-events-endpoint", "tcp://*:5557",
         "--kv-events-topic", "t", "--kv-events-encoding", "array"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.kv_events_endpoint, config.kv_events_topic, config.kv_events_encoding) == (
        "tcp://*:5557",
        "t",
        "array",
    )
    with pytest.raises(SystemExit):
        parse(["replica", "--port", "0", "--kv-events-encoding", "json"])
    with pytest.raises(ValueError, match="endpoint"):
        ReplicaConfig(kv_events_endpoint="localhost:5557")


def test_missing_packages_fail_at_start_naming_the_extra():
    # The replica as a process, with pyzmq and msgpack made unimportable: it still builds
    # without events, and refuses to start with them.
    code = (
        "import sys; sys.modules['zmq'] = sys.modules['msgpack'] = None\n"
        "from loadtest.replica.config import ReplicaConfig\n"
        "from loadtest.replica.server import ReplicaServer\n"
        "ReplicaServer(ReplicaConfig())\n"
        "from loadtest.replica.cli import run\n"
        "sys.exit(run(['--port', '0', '--kv-events-endpoint', 'tcp://*:5557']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "kvlb[events]" in lines[0], result.stderr


async def test_taken_endpoint_is_an_error_at_start():
    port = free_port()
    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind(f"tcp://*:{port}")
    try:
        config = ReplicaConfig(time_scale=FAST, kv_events_endpoint=f"tcp://*:{port}")
        with pytest.raises(OSError, match="KV events endpoint"):
            async with running_replica(config):
                pass
    finally:
        holder.close(0)
        context.term()
