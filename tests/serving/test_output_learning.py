"""The predictive policy learns from how answers end, through kvlb: how long they run, and
how fast each replica decodes them."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import pytest

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import usage_reporting_app

MODEL = "m"
NATURAL_LENGTH = 20  # what this model writes when nothing stops it


def expected_output(headers: dict) -> float:
    chosen = headers["x-kvlb-route"].split(";")[0]
    return float(next(t for t in chosen.split() if t.startswith("output_tokens=")).split("=")[1])


async def test_expected_output_is_learned_from_answers_that_ended_on_their_own() -> None:
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(usage_reporting_app(natural_length=NATURAL_LENGTH)))
        settings = make_settings([{"url": url, "name": "r0", "model": MODEL}],
                                 policy={"name": "predictive"}, routing={"route_header": True})
        running = await stack.enter_async_context(run_balancer(settings))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def send(n: int, **extra) -> float:
            body = {"model": MODEL, "prompt": f"question {n} " * 50, **extra}
            async with http.post(running.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
                return expected_output(dict(resp.headers))

        # Answers cut at their max_tokens say nothing of how long the model would write.
        for n in range(6):
            assert await send(n, max_tokens=5) == 5
        assert await send(99) == 256  # default_output_tokens: nothing learned yet
        # Streamed with usage, and not streamed: both teach.
        seen = [await send(100 + n, stream=n % 2 == 0, stream_options={"include_usage": True}) for n in range(8)]
        assert seen[-1] == NATURAL_LENGTH
        # max_tokens still bounds what is expected.
        assert await send(200, max_tokens=8) == 8


async def send_streamed(http: aiohttp.ClientSession, url: str, n: int) -> dict[str, str]:
    """A streamed completion that reports its usage, read whole; its answer's headers."""
    body = {"model": MODEL, "prompt": f"question {n} " * 50, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
        return dict(resp.headers)


def gauge(metrics: str, name: str, replica: str) -> float:
    prefix = f'{name}{{replica="{replica}"}}'
    return float(next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1])


async def test_a_replica_that_decodes_slower_is_fitted_and_loses_long_answers() -> None:
    async with AsyncExitStack() as stack:
        # The profile predicts about 8.4 ms per token on an idle replica.
        fast = await stack.enter_async_context(
            serve_app(usage_reporting_app(natural_length=NATURAL_LENGTH, token_gap_s=0.008)))
        slow = await stack.enter_async_context(
            serve_app(usage_reporting_app(natural_length=NATURAL_LENGTH, token_gap_s=0.04)))
        settings = make_settings([{"url": fast, "name": "fast", "model": MODEL},
                                  {"url": slow, "name": "slow", "model": MODEL}],
                                 policy={"name": "predictive", "seed": 3})
        running = await stack.enter_async_context(run_balancer(settings))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def send(n: int) -> str:
            return (await send_streamed(http, running.url, n))["x-kvlb-replica"]

        warm = []
        for wave in range(4):  # concurrent waves, so both replicas answer some
            warm += await asyncio.gather(*(send(wave * 8 + i) for i in range(8)))
        assert {"fast", "slow"} <= set(warm)
        async with http.get(running.url + "/metrics") as resp:
            metrics = await resp.text()
        assert gauge(metrics, "kvlb_replica_itl_scale", "slow") > 2 * gauge(metrics, "kvlb_replica_itl_scale", "fast")
        assert "kvlb_itl_prediction_ratio_count" in metrics
        later = [await send(100 + n) for n in range(6)]
    assert later.count("fast") == len(later), later


async def test_the_batchs_persistence_is_learned_from_streamed_answers_and_exported() -> None:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(
            serve_app(usage_reporting_app(natural_length=NATURAL_LENGTH, token_gap_s=0.002))) for _ in range(2)]
        settings = make_settings([{"url": url, "name": f"r{i}", "model": MODEL} for i, url in enumerate(urls)],
                                 policy={"name": "predictive", "seed": 5}, routing={"route_header": True})
        running = await stack.enter_async_context(run_balancer(settings))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def send(n: int) -> str:
            return (await send_streamed(http, running.url, n))["x-kvlb-route"]

        async def persistence() -> float | None:
            async with http.get(running.url + "/metrics") as resp:
                lines = (await resp.text()).splitlines()
            found = [line for line in lines if line.startswith(f'kvlb_batch_persistence{{model="{MODEL}"}}')]
            return float(found[0].split()[-1]) if found else None

        # Concurrent waves of different sizes: the replicas' batches differ when each is sent.
        for wave in range(6):
            await asyncio.gather(*(send(wave * 10 + i) for i in range(2 + wave)))
        assert await persistence() is None  # too few answers to say: priced as the batch stands
        for wave in range(16):
            await asyncio.gather(*(send(1000 + wave * 10 + i) for i in range(1 + wave % 4 * 2)))
        learned = await persistence()
        assert learned is not None and 0.0 <= learned <= 1.0
        # Each decision says the persistence it priced the batch at. A request sent alone, once
        # every answer above has ended: the last wave's own decisions came before its answers
        # taught the figure read above.
        chosen = (await send(2000)).split(";")[0]
        used = float(next(t for t in chosen.split() if t.startswith("persistence=")).split("=")[1])
        assert used == pytest.approx(learned, abs=0.1)
