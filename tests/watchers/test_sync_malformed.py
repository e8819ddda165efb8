"""What a peer writes to Redis in a shape kvlb does not expect is counted and skipped: the
instance keeps reading its peers (balancer/watchers/sync.py), through a real Redis server."""

from __future__ import annotations

import time
from array import array

import aiohttp
import msgpack
import orjson
import redis.asyncio as aioredis

from loadtest.compare.stub_replica import make_stub_app
from tests.conftest import make_settings, run_balancer, serve_app
from tests.redis_server import RedisServer
from tests.watchers.test_sync import complete, two_instances, until

MODEL = "sim-model"
PEER = "fake-peer"
PROMPT = "a document the peer routed " * 40
POISON = "a document only a garbled entry names " * 40
H = b"\1" * 8  # one hash's worth of bytes


def snapshot(load: dict[str, list[int]]) -> bytes:
    return orjson.dumps({"t": time.time(), "l": load})


def entry(events: list, hashes: list[int], load: dict[str, list[int]]) -> dict[str, bytes]:
    """A stream entry as kvlb writes one."""
    return {"e": orjson.dumps(events), "h": array("Q", hashes).tobytes(), "l": snapshot(load)}


def garbage(poison: list[int]) -> dict[str, dict[str, bytes | str]]:
    """Entries wrong in one way each; `poison`: hashes only a bad entry names."""
    idle = snapshot({"replica-0": [0, 0, 0]})
    one = array("Q", poison[:1]).tobytes()
    return {
        "no fields kvlb writes": {"x": "1"},
        "events missing": {"h": b"", "l": idle},
        "events not JSON": {"e": "not json", "h": b"", "l": idle},
        "events msgpack": {"e": msgpack.packb([["replica-0", 1.0, 1]]), "h": one, "l": idle},
        "events not a list": {"e": "5", "h": b"", "l": idle},
        "event too short": {"e": '[["replica-0", 1.0]]', "h": b"", "l": idle},
        "replica a list": {"e": '[[["replica-0"], 1.0, 1]]', "h": one, "l": idle},
        "time a string": {"e": '[["replica-0", "soon", 1]]', "h": one, "l": idle},
        "count a string": {"e": '[["replica-0", 1.0, "1"]]', "h": one, "l": idle},
        "count negative": {"e": '[["replica-0", 1.0, -1]]', "h": b"", "l": idle},
        "more hashes counted than sent": {"e": '[["replica-0", 1.0, 2]]', "h": one, "l": idle},
        "hashes not whole": {"e": '[["replica-0", 1.0, 1]]', "h": b"\1" * 7, "l": idle},
        # A good event first: none of the entry may apply, so the poison stays unknown.
        "good event then a bad one": {
            "e": orjson.dumps([["replica-0", 1.0, len(poison)], ["replica-0", "soon", 0]]),
            "h": array("Q", poison).tobytes(), "l": idle,
        },
        "adapters not JSON": {"e": '[["replica-0", 1.0, 1]]', "h": one, "l": idle, "a": "garbage"},
        "adapters one short": {"e": '[["replica-0", 1.0, 1]]', "h": one, "l": idle, "a": "[]"},
        "adapter a number": {"e": '[["replica-0", 1.0, 1]]', "h": one, "l": idle, "a": "[7]"},
        "adapter empty": {"e": '[["replica-0", 1.0, 1]]', "h": one, "l": idle, "a": '[""]'},
        "load not JSON": {"e": "[]", "h": b"", "l": "garbage"},
        "load a list": {"e": "[]", "h": b"", "l": "[1, 2]"},
        "load time a string": {"e": "[]", "h": b"", "l": '{"t": "soon", "l": {}}'},
        "load counts a map": {"e": "[]", "h": b"", "l": '{"t": 1e12, "l": {"replica-0": {"in_flight": 9}}}'},
        "load counts too few": {"e": "[]", "h": b"", "l": '{"t": 1e12, "l": {"replica-0": [9, 9]}}'},
        "load counts floats": {"e": "[]", "h": b"", "l": '{"t": 1e12, "l": {"replica-0": [9.5, 0, 0]}}'},
        "adapter loads a float": {"e": "[]", "h": b"", "l": '{"t": 1e12, "l": {"replica-0": [0, 0, 0, 0, 0.5]}}'},
    }


def one_instance(url: str, redis_server: RedisServer):
    sync = redis_server.sync_settings(load_interval_s=0.05, load_ttl_s=30.0)
    return run_balancer(make_settings(
        [{"url": url, "name": "replica-0", "model": MODEL}], policy={"name": "cache_aware"}, sync=sync,
    ))


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        return await resp.text()


async def test_garbage_in_a_peer_stream_is_skipped_and_its_next_entry_applied(redis_server):
    redis = aioredis.Redis.from_url(redis_server.url)
    async with serve_app(make_stub_app("r0", model=MODEL)) as url, one_instance(url, redis_server) as kvlb:
        sync, tracker = kvlb.balancer.sync, kvlb.balancer.tracker
        replica = kvlb.balancer.fleet.replicas[0]
        hashes, poison = list(tracker.predict(PROMPT).hashes), list(tracker.predict(POISON).hashes)
        bad = garbage(poison)
        stream = f"{redis_server.prefix}:routes:{PEER}"
        try:
            for fields in bad.values():
                await redis.xadd(stream, fields)
            await redis.set(f"{redis_server.prefix}:instance:{PEER}", snapshot({"replica-0": [0, 0, 0]}), px=30_000)
            await until(lambda: sync.stats.peers == 1)
            await redis.xadd(stream, entry([["replica-0", time.time(), len(hashes)]], hashes, {"replica-0": [2, 50, 1]}))
            await until(lambda: tracker.predict(PROMPT).cached.get("replica-0", 0) > 0)
            await until(lambda: replica.remote_in_flight == 2)
            assert sync.stats.malformed == len(bad)
            assert tracker.predict(POISON).cached == {}
            assert sync.stats.applied == 1 and sync.stats.errors == 0
            assert (replica.remote_in_flight, replica.remote_prefill_tokens_queued, replica.remote_decoding) == (2, 50, 1)
            assert f"kvlb_sync_malformed_entries_total {float(len(bad))}" in await metrics(kvlb.url)
            # And it goes on reading: the peer's next entry lands too.
            await redis.xadd(stream, entry([], [], {"replica-0": [0, 0, 0]}))
            await until(lambda: replica.remote_in_flight == 0)
        finally:
            await redis.aclose()


async def test_a_bad_key_or_snapshot_among_the_peers_keys_hides_no_one(redis_server):
    redis = aioredis.Redis.from_url(redis_server.url)
    async with serve_app(make_stub_app("r0", model=MODEL)) as url, one_instance(url, redis_server) as kvlb:
        sync = kvlb.balancer.sync
        replica = kvlb.balancer.fleet.replicas[0]
        try:
            # A key no kvlb writes (not UTF-8) and a peer whose snapshot is not one.
            await redis.set(f"{redis_server.prefix}:instance:".encode() + b"\xff\xfe", b"{}", px=30_000)
            await redis.set(f"{redis_server.prefix}:instance:odd-peer", b'{"t": 1e12, "l": {"replica-0": 3}}', px=30_000)
            await redis.set(f"{redis_server.prefix}:instance:{PEER}", snapshot({"replica-0": [4, 0, 0]}), px=30_000)
            await until(lambda: replica.remote_in_flight == 4)
            await until(lambda: sync.stats.malformed >= 4)  # each is counted whenever it is read
            assert sync.stats.errors == 0
        finally:
            await redis.aclose()


async def test_a_real_peer_is_followed_past_garbage_in_its_stream(redis_server):
    redis = aioredis.Redis.from_url(redis_server.url)
    async with two_instances(2, redis_server.sync_settings()) as (a, b), aiohttp.ClientSession() as http:
        try:
            await until(lambda: b.balancer.sync.stats.peers == 1)
            bad = garbage(list(b.balancer.tracker.predict(POISON).hashes))
            for fields in bad.values():
                await redis.xadd(a.balancer.sync.stream_key, fields)
            prompt = "after the garbage " * 400
            status, first = await complete(http, a.url, prompt)
            assert status == 200
            await until(lambda: b.balancer.tracker.predict(prompt).cached.get(first, 0) > 0)
            await until(lambda: all(r.remote_in_flight == 0 for r in b.balancer.fleet.replicas))
            assert b.balancer.sync.stats.malformed == len(bad)
            assert b.balancer.tracker.predict(POISON).cached == {}
        finally:
            await redis.aclose()
