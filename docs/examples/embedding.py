"""kvlb inside a Python program: the routing core alone, then a whole balancer.

    .venv/bin/python docs/examples/embedding.py

Part one ranks replicas for a prompt with no network at all. Part two starts two simulated
replicas (kvlb's test bed) and a balancer in front of them, in this process, sends one
request through it and stops everything.
"""

from __future__ import annotations

import asyncio

import aiohttp

from balancer import RequestFeatures, build_core, parse_settings, start_balancer
from balancer.protocol import REPLICA_HEADER
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica

MODEL = "demo-model"
PROMPT = "You are a careful assistant who answers in one sentence. " * 30
ROUTE = "/v1/completions"


def rank_with_the_core() -> None:
    settings = parse_settings({
        "replicas": [{"url": "http://127.0.0.1:9101", "name": "a"}, {"url": "http://127.0.0.1:9102", "name": "b"}],
        "policy": {"name": "cache_aware"},
    })
    core = build_core(settings)
    features = RequestFeatures(ROUTE, model=MODEL)
    # The core reads no clock: the caller says what time it is.
    journey = core.plan(ROUTE, features, PROMPT, core.candidates(MODEL, None, now=0.0))
    chosen = core.next_attempt(journey, now=0.0)  # sent there: the index records the prompt
    assert chosen is not None
    core.first_byte(journey)
    core.end_attempt(journey, answered=True)
    again = core.plan(ROUTE, features, PROMPT, core.candidates(MODEL, None, now=1.0))
    best = again.ranking[0]
    print(f"core: first sent to {chosen.name}; the same prompt now ranks "
          f"{[choice.replica.name for choice in again.ranking]}, cached={best.terms['cached']:g} tokens")
    assert best.replica is chosen


async def serve_in_process() -> None:
    config = ReplicaConfig(model=MODEL, time_scale=50.0)
    async with running_replica(config) as a, running_replica(config) as b:
        settings = parse_settings({
            "listen": {"host": "127.0.0.1"},
            "replicas": [{"url": a.url, "name": "a"}, {"url": b.url, "name": "b"}],
            "policy": {"name": "cache_aware"},
        })
        running = await start_balancer(settings, port=0)  # any free port
        try:
            url = f"http://127.0.0.1:{running.port}{ROUTE}"
            async with aiohttp.ClientSession() as session:
                for turn in (1, 2):
                    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
                    async with session.post(url, json=body) as resp:
                        answer = await resp.json()
                        usage = answer["usage"]
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                        print(f"balancer: request {turn} -> {resp.status} from {resp.headers[REPLICA_HEADER]}, "
                              f"{cached} of {usage['prompt_tokens']} prompt tokens cached")
                        assert resp.status == 200
        finally:
            await running.close(grace_s=1.0)


if __name__ == "__main__":
    rank_with_the_core()
    asyncio.run(serve_in_process())
