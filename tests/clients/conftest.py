"""What the standard-client suites share: a fleet of simulated replicas with kvlb in front, a
word-level tokenizer built from aiperf's corpus, and the replicas' own prompt counters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from loadtest.clients.aiperf import CORPUS, VENV, word_tokenizer
from loadtest.replica.launch import ReplicaProcess
from tests.conftest import make_settings, run_balancer

MODEL = "m"
TIME_SCALE = 10
REPLICAS = 4


@asynccontextmanager
async def fleet() -> AsyncIterator[tuple[str, list[ReplicaProcess]]]:
    """Simulated replicas and kvlb in front; yields kvlb's URL and the replicas."""
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(["--model", MODEL, "--time-scale", str(TIME_SCALE)]))
                    for _ in range(REPLICAS)]
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": r.url, "name": f"r{i}"} for i, r in enumerate(replicas)],
                                     policy={"name": "predictive", "seed": 0})
            running = await stack.enter_async_context(run_balancer(settings))
            yield running.url, replicas


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its vocabulary is aiperf's corpus (inference-perf ships the same text): prompts keep
    their words, and client and replica count one token per word."""
    if not (VENV / CORPUS).exists():
        pytest.skip("aiperf is not installed: make test-clients")
    return word_tokenizer(tmp_path_factory.mktemp("tokenizer"), VENV / CORPUS)


async def prompt_counters(replicas: list[ReplicaProcess]) -> tuple[int, int]:
    """(prompt tokens, of which served from cache), summed over the replicas' own counters."""
    prompt = cached = 0
    async with aiohttp.ClientSession() as http:
        for replica in replicas:
            async with http.get(replica.url + "/admin/stats") as resp:
                engine = (await resp.json())["engine"]
            prompt += engine["prompt_tokens"]
            cached += engine["cached_prompt_tokens"]
    return prompt, cached
