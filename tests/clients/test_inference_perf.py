"""The Kubernetes serving group's inference-perf, unchanged, against kvlb in front of simulated
replicas (`make test-clients`; it needs Python 3.12): a synthetic run and a shared-prefix run,
with no errors, its own check that client and server count tokens alike, and cache reads as
kvlb's harness finds them on the same shape."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadtest.client.workloads import load_workload
from loadtest.clients.inference_perf import inference_perf_bin, run
from tests.clients.conftest import (
    MODEL,
    assert_reads_as_harness,
    cache_reads,
    fleet,
    harness_cache_reads,
    prompt_counters,
)

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(not inference_perf_bin().exists(),
                       reason="inference-perf is not installed (it needs Python 3.12): make test-clients"),
]


async def inference_perf(url: str, tokenizer: Path, out: Path, **kwargs) -> dict:
    return await asyncio.to_thread(run, url, MODEL, tokenizer, out, **kwargs)


def assert_clean(summary: dict, requests: int) -> dict:
    successes = summary["successes"]
    assert summary["failures"]["count"] == 0, summary["failures"]
    assert successes["count"] == requests
    # Its own check: the server's usage against its tokenizer's count, request by request.
    assert successes["token_count_mismatches"] == 0
    assert successes["client_fallback_requests"] == {"prompt": 0, "output": 0}
    return successes


async def test_a_synthetic_run_counts_tokens_as_the_replicas_do(tokenizer: Path, tmp_path: Path) -> None:
    fixed = {"min": 256, "max": 256, "mean": 256, "std_dev": 0, "total_count": 40}
    out = {"min": 32, "max": 32, "mean": 32, "std_dev": 0, "total_count": 40}
    async with fleet() as (url, _):
        summary = await inference_perf(url, tokenizer, tmp_path, api={"type": "completion", "streaming": True},
                                       data={"type": "synthetic", "input_distribution": fixed,
                                             "output_distribution": out},
                                       rate=10, duration_s=4)
    successes = assert_clean(summary, 40)
    assert successes["prompt_tokens"]["mean"] == 256 and successes["output_tokens"]["mean"] == 32


async def test_a_shared_prefix_run_reads_the_caches_as_kvlbs_harness_does(tokenizer: Path, tmp_path: Path) -> None:
    # Enough prompts per group that a group split over two replicas moves the figure little.
    groups, per_group, system, question = 4, 16, 512, 64
    async with fleet() as (url, replicas):
        before = await prompt_counters(replicas)
        summary = await inference_perf(
            url, tokenizer, tmp_path, api={"type": "chat", "streaming": True},
            data={"type": "shared_prefix", "shared_prefix": {
                "num_groups": groups, "num_prompts_per_group": per_group, "system_prompt_len": system,
                "question_len": question, "output_len": 16}},
            rate=16, duration_s=groups * per_group / 16)
        after = await prompt_counters(replicas)
        successes = assert_clean(summary, groups * per_group)
        client_reads = successes["prompt_tokens"]["cached"] / successes["prompt_tokens"]["total"]
        replica_reads = cache_reads(before, after)
        assert abs(client_reads - replica_reads) < 0.01  # what it read of usage is what the replicas did

    # kvlb's harness, the same shape, on a fresh fleet.
    workload = load_workload(f"shared-prefix,groups={groups},prompts_per_group={per_group},"
                             f"system_tokens={system},question_tokens={question},output_tokens=16,rate=16")
    async with fleet() as (url, replicas):
        harness_reads = await harness_cache_reads(url, replicas, workload.requests)
    assert_reads_as_harness("inference-perf", replica_reads, harness_reads)


async def test_a_multi_turn_run_is_served_whole(tokenizer: Path, tmp_path: Path) -> None:
    """16 conversations of two turns, four of them opening on each shared prompt: the second
    turn resends the first with its answer, which the replicas serve much of from cache."""
    async with fleet() as (url, replicas):
        before = await prompt_counters(replicas)
        summary = await inference_perf(
            url, tokenizer, tmp_path, api={"type": "chat", "streaming": True},
            data={"type": "shared_prefix", "shared_prefix": {
                "num_groups": 4, "num_prompts_per_group": 4, "system_prompt_len": 256, "question_len": 32,
                "output_len": 16, "enable_multi_turn_chat": True}},
            rate=4, duration_s=8)
        after = await prompt_counters(replicas)
    prompt_tokens = assert_clean(summary, 32)["prompt_tokens"]
    assert prompt_tokens["max"] > 2 * prompt_tokens["min"]  # second turns carry the first
    reads = cache_reads(before, after)
    print(f"cache reads of a two-turn run: {reads:.3f}")
    # Routing blind to the cache reads about 0.30 here; all of it on one replica about 0.53. A
    # conversation or a shared prompt that kvlb copies to an idle replica costs 0.02 each, and
    # kvlb may do that a few times when it predicts the copy to be faster.
    assert reads > 0.42
