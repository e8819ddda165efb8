"""LoRA adapters through kvlb in front of simulated replicas that serve them as vLLM does: what
the replicas list, a prompt's cache keyed by its adapter, and an adapter nobody serves."""

from __future__ import annotations

import asyncio
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


async def test_an_adapter_nobody_serves_is_loaded_on_demand_once() -> None:
    args = ["--model", BASE, "--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "2",
            "--time-scale", "20"]
    loadable = [{"name": "sql", "path": "/adapters/sql", "base": BASE},
                {"name": "chat", "path": "/adapters/chat", "base": BASE}]
    with ExitStack() as processes:
        replica = processes.enter_context(ReplicaProcess(args))
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": replica.url, "name": "r0", "max_loras": 2}],
                                     adapters={"load_on_demand": loadable})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200 and headers["x-kvlb-replica"] == "r0", body
                async with http.get(replica.url + "/v1/models") as resp:
                    listed = {card["id"]: card.get("parent") for card in (await resp.json())["data"]}
                assert listed["sql"] == BASE
                # Five at once for another adapter: one load, all five served.
                results = await asyncio.gather(*(complete(http, running.url, "chat") for _ in range(5)))
                assert [r[0] for r in results] == [200] * 5
                assert (await complete(http, running.url, "sql"))[0] == 200
                async with http.get(running.url + "/metrics") as resp:
                    metrics = await resp.text()
                for adapter in ("sql", "chat"):
                    assert f'kvlb_adapter_loads_total{{adapter="{adapter}",outcome="loaded"}} 1.0' in metrics
                # Neither loadable nor served: the usual 404.
                status, _, body = await complete(http, running.url, "unknown-adapter")
                assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_a_load_the_replica_refuses_is_a_clear_503() -> None:
    # Without runtime updating, the replica has no load endpoint (vLLM's rule).
    args = ["--model", BASE, "--enable-lora", "--max-loras", "1", "--time-scale", "20"]
    with ExitStack() as processes:
        replica = processes.enter_context(ReplicaProcess(args))
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": replica.url, "name": "r0"}],
                                     adapters={"load_on_demand": [{"name": "sql", "path": "/a/sql", "base": BASE}]})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 503 and body["error"]["code"] == "adapter_load_failed", body
                assert "r0" in body["error"]["message"] and "HTTP 404" in body["error"]["message"]
                assert int(headers["Retry-After"]) >= 1
                # The base model is still served meanwhile.
                assert (await complete(http, running.url, BASE))[0] == 200
