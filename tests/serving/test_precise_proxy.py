"""Precise mode through the proxy: simulated replicas publish their KV events over ZMQ, kvlb
subscribes, tokenizes through their /tokenize, and predicts what they will report."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import AsyncExitStack

import aiohttp

from loadtest.procs import free_port
from loadtest.real_engines.e2e import predicted_cached
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica
from tests.conftest import make_settings, run_balancer

MODEL = "sim"
BLOCK = 16


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def start(stack: AsyncExitStack, replicas: int, kv_capacity_tokens: int | None = None):
    configs, servers = [], []
    for _ in range(replicas):
        config = ReplicaConfig(model=MODEL, time_scale=200, block_size=BLOCK, port=free_port(),
                               kv_capacity_tokens=kv_capacity_tokens,
                               kv_events_endpoint=f"tcp://*:{free_port()}")
        configs.append(config)
        servers.append(await stack.enter_async_context(running_replica(config)))
    settings = make_settings(
        [{"url": f"http://127.0.0.1:{s.port}", "name": f"r{i}",
          "kv_events_endpoint": c.kv_events_endpoint.replace("*", "127.0.0.1")}
         for i, (s, c) in enumerate(zip(servers, configs, strict=True))],
        policy={"name": "cache_aware", "seed": 7},
        routing={"route_header": True},
        kv_events={"enabled": True, "block_size": BLOCK},
    )
    running = await stack.enter_async_context(run_balancer(settings))
    stats = running.balancer.tracker.events.stats
    for _ in range(100):  # the subscriptions reach the publishers
        if len(stats.connected) == replicas:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    return running, servers, configs


async def chat(http, url, messages):
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
        return resp.headers["x-kvlb-replica"], usage["prompt_tokens_details"]["cached_tokens"], predicted_cached(resp.headers["x-kvlb-route"])


async def settle(running, blocks_at_least: int) -> None:
    stats = running.balancer.tracker.events.stats
    for _ in range(100):
        if stats.stored_blocks >= blocks_at_least:
            return
        await asyncio.sleep(0.02)


async def caught_up(running, servers) -> None:
    """Wait until kvlb has applied every KV event message each replica has sent."""
    events = running.balancer.tracker.events
    for _ in range(250):
        if all(s.kv_events.pending == 0
               and events.last_sequence(f"r{i}") == (s.kv_events.sequence - 1 if s.kv_events.sequence else None)
               for i, s in enumerate(servers)):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("kvlb never caught up with the replicas' KV events")


async def test_predictions_equal_what_the_replicas_report_even_as_they_evict():
    async with AsyncExitStack() as stack:
        # 640 tokens each: eight conversations of up to ~400 tokens do not fit in three.
        running, servers, _ = await start(stack, 3, kv_capacity_tokens=640)
        async with aiohttp.ClientSession() as http:
            # Turns of eight conversations interleaved, one request at a time, each sent once
            # kvlb has every event the last one caused: a prediction can then only be wrong
            # through the index, never through an eviction still on the wire or one caused
            # by a request running at the same moment.
            histories = {n: [{"role": "system", "content": words(f"s{n % 4}x", 200)}] for n in range(8)}
            turns = []
            for turn in range(5):
                for n, messages in histories.items():
                    messages.append({"role": "user", "content": words(f"q{n}t{turn}x", 30)})
                    await caught_up(running, servers)
                    turns.append(await chat(http, running.url, messages))
                    messages.append({"role": "assistant", "content": "the quick brown fox"})
        stats = running.balancer.tracker.events.stats
        assert stats.removed_blocks > 0, "the replicas were meant to evict"
        within = [abs(cached - guess) <= BLOCK for _, cached, guess in turns]
        assert all(within), turns
        # And the guesses were worth making: later turns came from cache.
        assert sum(cached for _, cached, _ in turns) > 0.5 * sum(guess for _, _, guess in turns)
        assert stats.gaps == 0 and stats.malformed == 0


async def test_a_flush_reaches_the_index_as_all_blocks_cleared():
    async with AsyncExitStack() as stack:
        running, servers, _ = await start(stack, 2)
        async with aiohttp.ClientSession() as http:
            messages = [{"role": "system", "content": words("doc", 300)}, {"role": "user", "content": "a"}]
            replica, _, _ = await chat(http, running.url, messages)
            await settle(running, 300 // BLOCK)
            again, cached, guess = await chat(http, running.url, messages)
            assert again == replica and guess >= 288 and abs(cached - guess) <= BLOCK
            server = servers[int(replica[1:])]
            async with http.post(f"http://127.0.0.1:{server.port}/flush_cache") as resp:
                assert resp.status == 200
            tracker = running.balancer.tracker
            for _ in range(100):
                if tracker.events.stats.cleared:
                    break
                await asyncio.sleep(0.02)
            # The replica is idle after answering, so the flush drops all of it at once.
            assert tracker.events.stats.cleared == 1
            assert tracker.exact.entries_of(replica) == 0
            async with http.get(running.url + "/metrics") as resp:
                text = await resp.text()
            assert "kvlb_kv_events_cleared_total 1.0" in text
            assert "kvlb_kv_events_subscribed_replicas 2.0" in text


async def test_a_restarted_replica_loses_its_entries_in_the_index():
    async with AsyncExitStack() as stack:
        running, servers, configs = await start(stack, 1)
        async with aiohttp.ClientSession() as http:
            messages = [{"role": "system", "content": words("doc", 200)}, {"role": "user", "content": "a"}]
            await chat(http, running.url, messages)
            await settle(running, 200 // BLOCK)
            await chat(http, running.url, messages)  # a second message: the sequence is at 1
            tracker = running.balancer.tracker
            assert tracker.exact.entries_of("r0") > 0
            await servers[0].stop()
            # The same addresses, an empty cache, and a publisher counting from 0 again. ZMQ
            # releases a closed socket's address in its own thread, a moment later.
            async with AsyncExitStack() as restarted:
                for _ in range(100):
                    try:
                        await restarted.enter_async_context(
                            running_replica(dataclasses.replace(configs[0], port=servers[0].port)))
                        break
                    except OSError:
                        await asyncio.sleep(0.05)
                for n in range(50):
                    # A new prompt each time, so each answer publishes blocks: the first
                    # messages go before the resubscription reaches the new publisher.
                    other = [{"role": "system", "content": words(f"new{n}x", 100)}, {"role": "user", "content": "b"}]
                    await chat(http, running.url, other)
                    if tracker.events.stats.gaps:
                        break
                    await asyncio.sleep(0.1)
                assert tracker.events.stats.gaps == 1
                _, cached, guess = await chat(http, running.url, messages)
                assert cached == 0 and guess == 0  # the old prefix is not predicted there anymore
