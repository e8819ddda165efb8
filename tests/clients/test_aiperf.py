"""NVIDIA's aiperf, unchanged, against kvlb in front of simulated replicas (`make test-clients`):
a synthetic run, a shared-prefix run that resets the fleet's caches first, and a multi-turn
run, each with no errors and token counts that match the replicas' own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from loadtest.client.workloads import load_workload
from loadtest.clients.aiperf import aiperf_bin, metric, profile
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
    pytest.mark.skipif(not aiperf_bin().exists(), reason="aiperf is not installed: make test-clients"),
]

async def aiperf(url: str, tokenizer: Path, out: Path, *args: str) -> dict:
    # aiperf blocks until done; kvlb runs on this loop, so it must keep running meanwhile.
    return await asyncio.to_thread(profile, url, MODEL, tokenizer, out, list(args))


def assert_clean(summary: dict, requests: int) -> None:
    assert summary["error_summary"] == [], summary["error_summary"]
    assert len(summary["records"]) == requests
    assert all(metric(r, "usage_prompt_tokens") for r in summary["records"])


async def test_a_synthetic_run_counts_tokens_as_the_replicas_do(tokenizer: Path, tmp_path: Path) -> None:
    async with fleet() as (url, _):
        summary = await aiperf(
            url, tokenizer, tmp_path, "--endpoint-type", "completions", "--streaming", "--request-count", "40",
            "--concurrency", "4", "--prompt-input-tokens-mean", "256", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", "32", "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true")
    assert_clean(summary, 40)
    for record in summary["records"]:
        assert metric(record, "usage_prompt_tokens") == metric(record, "input_sequence_length") == 256
        assert metric(record, "usage_completion_tokens") == metric(record, "output_sequence_length") == 32


async def test_a_shared_prefix_run_resets_the_caches_and_reads_them_as_kvlbs_harness_does(
        tokenizer: Path, tmp_path: Path) -> None:
    entries, rounds = 12, 4
    async with fleet() as (url, replicas):
        async with aiohttp.ClientSession() as http:  # something cached, for the reset to clear
            body = {"model": MODEL, "prompt": "warm the caches " * 50, "max_tokens": 2}
            for _ in range(4):
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
        before = await prompt_counters(replicas)
        summary = await aiperf(
            url, tokenizer, tmp_path / "aiperf", "--endpoint-type", "chat", "--streaming",
            "--request-count", str(entries * rounds), "--concurrency", "4", "--num-dataset-entries", str(entries),
            "--shared-system-prompt-length", "512", "--user-context-prompt-length", "128",
            "--prompt-input-tokens-mean", "128", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", "16", "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--reset-kv-cache")
        after = await prompt_counters(replicas)
        assert_clean(summary, entries * rounds)
        # The replicas' count is the client's plus the chat template's: one per message, and one.
        for record in summary["records"]:
            assert metric(record, "usage_prompt_tokens") == metric(record, "input_sequence_length") + 4
        aiperf_reads = cache_reads(before, after)

        # The same bodies in the same order through kvlb's own harness, on caches reset again.
        async with aiohttp.ClientSession() as http, http.post(url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        workload = load_workload(f"payloads:{tmp_path / 'aiperf' / 'inputs.json'},repeat={rounds},rate=20")
        harness_reads = await harness_cache_reads(url, replicas, workload.requests)
    assert_reads_as_harness("aiperf", aiperf_reads, harness_reads)


async def test_a_multi_turn_run_is_served_whole(tokenizer: Path, tmp_path: Path) -> None:
    async with fleet() as (url, replicas):
        before = await prompt_counters(replicas)
        summary = await aiperf(
            url, tokenizer, tmp_path, "--endpoint-type", "chat", "--streaming", "--conversation-num", "6",
            "--conversation-turn-mean", "3", "--conversation-turn-stddev", "0",
            "--prompt-input-tokens-mean", "128", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", "16", "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true")
        after = await prompt_counters(replicas)
    assert_clean(summary, 18)
    # Later turns resend the conversation so far: the replicas serve much of it from cache.
    assert after[1] - before[1] > 0
