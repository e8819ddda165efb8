"""End to end against real engines: vLLM built for CPU, a tiny local model, `kvlb launch`.

`make test-engine` runs this (it is left out of `make test`). The engine is installed into a
cache folder outside the checkout when missing; if that or an engine's start fails, the suite
fails with the reason, it never skips.
"""

import asyncio
import socket

import aiohttp
import pytest

from loadtest.real_engines.e2e import Workload, compare_on, launched_fleet, print_table
from loadtest.real_engines.setup import ensure_engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

REPLICAS = 3


@pytest.fixture(scope="module")
def engine():
    return ensure_engine()


def port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) == 0


async def test_kvlb_routes_real_engines_by_their_own_kv_events(engine):
    async with launched_fleet(engine.python, engine.model, REPLICAS) as fleet:
        # The launcher's own kvlb (precise mode, its generated configuration) serves.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "the quick fox"}], "max_tokens": 4}
            async with session.post(f"{fleet.kvlb_url}/v1/chat/completions", json=body) as answer:
                assert answer.status == 200, await answer.text()
                assert answer.headers["x-kvlb-replica"]
                assert (await answer.json())["usage"]["completion_tokens"] == 4
            async with session.get(f"{fleet.kvlb_url}/metrics") as answer:
                metrics = await answer.text()
            assert f"kvlb_kv_events_subscribed_replicas {REPLICAS}.0" in metrics

        report = await compare_on(fleet, engine.model, Workload())
        print_table(report)
        modes = report["modes"]
        random_ratio = modes["random"]["cached_ratio"]
        # The engines' own cached_tokens: routing by their events keeps conversations and
        # shared system prompts where they are cached.
        assert modes["precise"]["cached_ratio"] >= 1.15 * random_ratio, modes
        assert modes["approximate"]["cached_ratio"] > random_ratio, modes
        # Small KV caches: the engines evicted, and kvlb's predictions still matched them.
        assert modes["precise"]["kv_events"]["removed_blocks"] > 0, modes["precise"]
        assert modes["precise"]["predicted_within_one_block"] >= 0.95, modes["precise"]
        assert modes["precise"]["kv_events"]["gaps"] == 0

    # Ctrl-C stopped the launcher, kvlb and every engine.
    assert fleet.process.returncode == 0
    await asyncio.sleep(0.5)
    assert not any(port_open(url) for url in [*fleet.engines, fleet.kvlb_url])
