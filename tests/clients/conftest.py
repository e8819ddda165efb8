"""What the standard-client suites share: a fleet of simulated replicas with kvlb in front, a
word-level tokenizer built from aiperf's corpus, and the replicas' own prompt counters."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from loadtest.client.runner import run_load
from loadtest.client.workloads import WorkRequest
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


def cache_reads(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the prompt tokens between two `prompt_counters` served from cache."""
    return (after[1] - before[1]) / (after[0] - before[0])


async def harness_cache_reads(url: str, replicas: list[ReplicaProcess], requests: Sequence[WorkRequest]) -> float:
    """kvlb's own harness sends `requests` through kvlb: the replicas' cache reads over them."""
    before = await prompt_counters(replicas)
    records, _ = await run_load(url, requests, model=MODEL, time_scale=TIME_SCALE, timeout_s=60, progress=False)
    after = await prompt_counters(replicas)
    assert all(r.ok for r in records)
    return cache_reads(before, after)


def assert_reads_as_harness(client: str, client_reads: float, harness_reads: float) -> None:
    print(f"cache reads: {client} {client_reads:.3f}, kvlb's harness {harness_reads:.3f}")
    assert client_reads > 0.5
    assert abs(client_reads - harness_reads) <= 0.1 * harness_reads
