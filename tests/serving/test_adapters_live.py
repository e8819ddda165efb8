"""LoRA adapters through kvlb in front of simulated replicas that serve them as vLLM does: what
the replicas list, a prompt's cache keyed by its adapter, and an adapter nobody serves."""

from __future__ import annotations

from contextlib import AsyncExitStack, ExitStack

import aiohttp

from loadtest.replica.launch import ReplicaProcess
from tests.conftest import make_settings, run_balancer

BASE = "base-model"
LORA_ARGS = ["--model", BASE, "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat",
             "--max-loras", "1", "--time-scale", "20"]
PROMPT = "you are the support assistant of one product and answer from its manual only " * 60


def terms_of(route: str) -> dict[str, float]:
    """The chosen replica's terms from x-kvlb-route: `chosen=NAME k=v ...; next=...`."""
    chosen = route.split(";")[0].split()
    return {k: float(v) for k, v in (part.split("=", 1) for part in chosen[1:])}


async def complete(http: aiohttp.ClientSession, url: str, model: str) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_adapters_are_listed_once_and_their_caches_never_mix() -> None:
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(LORA_ARGS)) for _ in range(2)]
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": r.url, "name": f"r{i}", "max_loras": 1, "lora_load_ms": 20}
                                      for i, r in enumerate(replicas)],
                                     policy={"name": "predictive", "seed": 0}, routing={"route_header": True})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                async with http.get(running.url + "/v1/models") as resp:
                    cards = (await resp.json())["data"]
                ids = sorted(card["id"] for card in cards)
                assert ids == [BASE, "chat", "sql"]
                assert {c["id"]: c.get("parent") for c in cards}["sql"] == BASE

                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200, body
                first = headers["x-kvlb-replica"]
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200 and headers["x-kvlb-replica"] == first
                assert terms_of(headers["x-kvlb-route"])["cached"] > 0
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

                # The same prompt under another adapter, and under the base model: nothing cached.
                for model in ("chat", BASE):
                    status, headers, body = await complete(http, running.url, model)
                    assert status == 200, body
                    route = headers["x-kvlb-route"]
                    assert all(float(part.split("=", 1)[1]) == 0
                               for part in route.replace(";", " ").split() if part.startswith("cached=")), route
                    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

                status, _, body = await complete(http, running.url, "nobody-serves-this")
                assert status == 404 and body["error"]["code"] == "model_not_found"
                assert "nobody-serves-this" in body["error"]["message"]
