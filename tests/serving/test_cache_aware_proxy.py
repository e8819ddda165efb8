"""Cache-aware routing through the proxy, against simulated replicas with real prefix caches."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import pytest

from balancer.routing.request import canonical_prompt
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import usage_reporting_app

MODEL = "sim"


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def start(stack: AsyncExitStack, replicas: int, **sections):
    servers = [
        await stack.enter_async_context(running_replica(ReplicaConfig(model=MODEL, time_scale=200)))
        for _ in range(replicas)
    ]
    urls = {f"r{i}": f"http://127.0.0.1:{s.port}" for i, s in enumerate(servers)}
    settings = make_settings(
        [{"url": url, "name": name} for name, url in urls.items()],
        policy={"name": "cache_aware", "seed": 7},
        **sections,
    )
    running = await stack.enter_async_context(run_balancer(settings))
    return running, urls


async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict], **headers) -> tuple[str, int, int, dict]:
    async with http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4},
                         headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        usage = body["usage"]
        return (resp.headers["x-kvlb-replica"], usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"], dict(resp.headers))


async def test_sessions_stick_to_the_replica_that_holds_their_prefix() -> None:
    async with AsyncExitStack() as stack:
        running, _ = await start(stack, 4)
        async with aiohttp.ClientSession() as http:

            async def session(n: int) -> list[tuple[str, int, int]]:
                messages = [{"role": "system", "content": words(f"s{n}x", 400)}]
                turns = []
                for turn in range(4):
                    messages.append({"role": "user", "content": words(f"q{n}t{turn}x", 20)})
                    replica, prompt, cached, _ = await chat(http, running.url, messages)
                    turns.append((replica, prompt, cached))
                    messages.append({"role": "assistant", "content": "ok"})
                return turns

            sessions = await asyncio.gather(*(session(n) for n in range(8)))
    for turns in sessions:
        first_replica = turns[0][0]
        assert all(replica == first_replica for replica, _, _ in turns), turns
        for _, _, cached in turns[1:]:
            assert cached >= 400, turns  # the system prompt and earlier turns came from cache
    # Eight sessions did not pile onto one replica.
    used = {turns[0][0] for turns in sessions}
    assert len(used) >= 3, used


async def test_index_forgets_what_a_flushed_replica_lost() -> None:
    async with AsyncExitStack() as stack:
        running, urls = await start(stack, 2, routing={"route_header": True})
        tracker = running.balancer.tracker
        assert tracker is not None
        async with aiohttp.ClientSession() as http:
            old = [{"role": "system", "content": words("old", 300)}, {"role": "user", "content": "a"}]
            replica, _, _, _ = await chat(http, running.url, old)
            # A second, newer prefix on the same replica (asked for by residency-free affinity:
            # send it until it lands there).
            for n in range(20):
                new = [{"role": "system", "content": words(f"new{n}x", 300)}, {"role": "user", "content": "b"}]
                landed, _, _, _ = await chat(http, running.url, new)
                if landed == replica:
                    break
            assert landed == replica
            # The replica restarts with an empty cache (SGLang's /flush_cache).
            async with http.post(urls[replica] + "/flush_cache") as resp:
                assert resp.status == 200
            again, _, cached, headers = await chat(http, running.url, new)
            assert again == replica  # the index still believed it held the prefix
            assert f"chosen={replica}" in headers["x-kvlb-route"]
            assert cached == 0
            assert running.balancer.metrics.corrections[replica] == 1
            # The older prefix, which the flush took too, is no longer predicted there...
            prompt = canonical_prompt("/v1/chat/completions", {"messages": old})
            assert replica not in tracker.predict(prompt).cached
            # ...while the prefix just recomputed is.
            prompt = canonical_prompt("/v1/chat/completions", {"messages": new})
            assert tracker.predict(prompt).cached.get(replica, 0) > 0


async def test_residency_header_is_a_hard_filter() -> None:
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(running_replica(ReplicaConfig(model=MODEL, time_scale=200)))
            for _ in range(2)
        ]
        settings = make_settings(
            [{"url": f"http://127.0.0.1:{s.port}", "name": f"r{i}", "labels": {"region": ("eu", "us")[i]}}
             for i, s in enumerate(servers)],
            policy={"name": "cache_aware"},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                replica, *_ = await chat(http, running.url, [{"role": "user", "content": "hi"}],
                                         **{"x-kvlb-allowed-regions": "eu"})
                assert replica == "r0"
            async with http.post(running.url + "/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                 headers={"x-kvlb-allowed-regions": "ap-south"}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_replica_in_allowed_regions"


async def test_tokens_per_character_is_learned_from_the_replicas_usage() -> None:
    # Words of 7 characters with their space: the replicas count one token per word, a
    # quarter token per character would overestimate every prompt 1.75x.
    def prompt(n: int) -> list[dict]:
        return [{"role": "user", "content": " ".join(f"{n:03d}{i:03d}" for i in range(300))}]

    async with AsyncExitStack() as stack:
        running, _ = await start(stack, 2)
        tracker = running.balancer.tracker
        assert tracker is not None
        async with aiohttp.ClientSession() as http:
            for n in range(40):
                await chat(http, running.url, prompt(n))
            _, tokens, _, _ = await chat(http, running.url, prompt(999))
            async with http.get(running.url + "/metrics") as resp:
                metrics = await resp.text()
    chars = len(canonical_prompt("/v1/chat/completions", {"messages": prompt(999)}))
    truth = tokens / chars
    line = next(line for line in metrics.splitlines() if line.startswith('kvlb_tokens_per_char{model="sim"}'))
    assert float(line.split()[-1]) == pytest.approx(truth, rel=0.05)
    fresh = canonical_prompt("/v1/chat/completions", {"messages": prompt(998)})
    assert tracker.predict(fresh, MODEL).prompt_tokens == pytest.approx(tokens, rel=0.05)


async def test_prompt_counts_teach_tokens_per_character_without_cache_reports() -> None:
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(usage_reporting_app(natural_length=1, report_cached=False)))
        settings = make_settings([{"url": url, "name": "r0", "model": MODEL}], policy={"name": "predictive"})
        running = await stack.enter_async_context(run_balancer(settings))
        tracker = running.balancer.tracker
        assert tracker is not None
        async with aiohttp.ClientSession() as http:
            for n in range(40):
                text = " ".join(f"{n:03d}{i:03d}" for i in range(300))  # 7 characters a token
                body = {"model": MODEL, "prompt": text, "stream": n % 2 == 0,
                        "stream_options": {"include_usage": True}}
                async with http.post(running.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
    assert tracker.ratio.of(MODEL) == pytest.approx(1 / 7, rel=0.05)
    # No cached figures, so nothing to judge the index's guesses by.
    assert not running.balancer.metrics.predicted_tokens
