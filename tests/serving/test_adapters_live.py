"""LoRA adapters through kvlb in front of simulated replicas that serve them as vLLM does: what
the replicas list, a prompt's cache keyed by its adapter, and an adapter nobody serves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from typing import Any

import aiohttp

from loadtest.replica.launch import ReplicaProcess
from policies.base import RequestFeatures
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


async def generate(http: aiohttp.ClientSession, url: str, lora_path: str | None) -> tuple[int, dict, dict]:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    async with http.post(url + "/generate", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_sglang_generate_names_its_adapter_in_lora_path() -> None:
    # Only r1 serves `sql`: a /generate naming it must go there, not to any replica.
    with ExitStack() as processes:
        plain = processes.enter_context(ReplicaProcess(["--model", BASE, "--time-scale", "20"]))
        lora = processes.enter_context(ReplicaProcess(LORA_ARGS))
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": plain.url, "name": "r0"},
                                      {"url": lora.url, "name": "r1", "max_loras": 1, "lora_load_ms": 20}],
                                     policy={"name": "predictive", "seed": 0}, routing={"route_header": True})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                for _ in range(2):
                    status, headers, body = await generate(http, running.url, "sql")
                    assert status == 200 and headers["x-kvlb-replica"] == "r1", body
                assert terms_of(headers["x-kvlb-route"])["cached"] > 0
                assert body["meta_info"]["cached_tokens"] > 0

                # The same text under another adapter, or the base model: kvlb claims no hit.
                status, headers, body = await generate(http, running.url, "chat")
                assert status == 200 and headers["x-kvlb-replica"] == "r1", body
                assert terms_of(headers["x-kvlb-route"])["cached"] == 0
                assert body["meta_info"]["cached_tokens"] == 0
                status, headers, body = await generate(http, running.url, None)
                assert status == 200, body
                route = headers["x-kvlb-route"]
                assert all(float(part.split("=", 1)[1]) == 0
                           for part in route.replace(";", " ").split() if part.startswith("cached=")), route

                status, _, body = await generate(http, running.url, "nobody-serves-this")
                assert status == 404 and body["error"]["code"] == "model_not_found", body


async def test_an_adapter_falls_under_its_base_models_per_model_entry() -> None:
    # Real time (scale 1), so one streamed answer of 100 tokens holds its place for about a second.
    args = [*LORA_ARGS[:-1], "1"]
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(args)) for _ in range(2)]
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": r.url, "name": f"r{i}"} for i, r in enumerate(replicas)],
                                     policy={"name": "predictive", "seed": 0},
                                     per_model=[{"model": BASE, "policy": {"name": "round_robin"}, "max_in_flight": 1}])
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                # The base's round robin, not predictive, which would keep the cached prompt on one.
                served = []
                for model in ("sql", "sql", f"{BASE}:sql", "sql"):
                    status, headers, body = await complete(http, running.url, model)
                    assert status == 200, body
                    served.append(headers["x-kvlb-replica"])
                assert served in (["r0", "r1"] * 2, ["r1", "r0"] * 2), served

                async def stream_slowly(model: str) -> int:
                    body = {"model": model, "prompt": "p", "max_tokens": 100, "stream": True}
                    async with http.post(running.url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        return resp.status

                # One adapter's request holds the base model's one place: the other adapter's waits its turn.
                slow = asyncio.create_task(stream_slowly("chat"))
                await asyncio.sleep(0.3)
                status, _, body = await complete(http, running.url, "sql")
                assert status == 429 and body["error"]["code"] == "model_at_capacity", body
                assert await slow == 200
                assert (await complete(http, running.url, "sql"))[0] == 200


async def test_a_hot_adapter_is_loaded_on_one_more_replica_and_a_cold_one_is_not() -> None:
    args = ["--model", BASE, "--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "2",
            "--time-scale", "20"]
    loadable = [{"name": "sql", "path": "/adapters/sql", "base": BASE}]
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(args)) for _ in range(2)]
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": r.url, "name": f"r{i}", "max_loras": 2} for i, r in enumerate(replicas)],
                                     policy={"name": "predictive", "seed": 0},
                                     adapters={"load_on_demand": loadable})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                async def loads() -> float:
                    async with http.get(running.url + "/metrics") as resp:
                        text = await resp.text()
                    line = 'kvlb_adapter_loads_total{adapter="sql",outcome="loaded"} '
                    return sum(float(row[len(line):]) for row in text.splitlines() if row.startswith(line))

                # One at a time, the same prompt: the replica that loaded it keeps it, alone.
                first = set()
                for _ in range(6):
                    status, headers, body = await complete(http, running.url, "sql")
                    assert status == 200, body
                    first.add(headers["x-kvlb-replica"])
                assert len(first) == 1 and await loads() == 1

                # Many at once, each with a long prompt of its own: one replica's queue is worth a load elsewhere.
                async def busy(i: int) -> tuple[int, str]:
                    body = {"model": "sql", "prompt": f"question {i} " + "tell me more " * 700, "max_tokens": 32}
                    async with http.post(running.url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        return resp.status, resp.headers.get("x-kvlb-replica", "")

                results = await asyncio.gather(*(busy(i) for i in range(24)))
                assert [status for status, _ in results] == [200] * 24
                assert {replica for _, replica in results} == {"r0", "r1"}
                assert await loads() == 2
                for replica in replicas:
                    async with http.get(replica.url + "/v1/models") as resp:
                        listed = {card["id"] for card in (await resp.json())["data"]}
                    assert "sql" in listed


async def test_the_engine_says_how_many_adapters_it_holds_and_which_run() -> None:
    # Config names no max_loras: kvlb takes the engine's 2, not vLLM's default of 1. And an
    # adapter a client runs on the replica without kvlb is in its slots all the same.
    args = ["--model", BASE, "--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "sum=/a/sum",
            "--max-loras", "2", "--time-scale", "1"]
    with ExitStack() as processes:
        replica = processes.enter_context(ReplicaProcess(args))
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": replica.url, "name": "r0", "lora_load_ms": 500}],
                                     policy={"name": "predictive", "seed": 0}, routing={"route_header": True},
                                     models={"refresh_s": 0.1})
            running = await stack.enter_async_context(run_balancer(settings))
            slots = running.balancer.fleet.by_name["r0"].adapter_slots
            assert slots.capacity == 2
            async with aiohttp.ClientSession() as http:
                async def load_priced(model: str, base: str = running.url) -> float:
                    body = {"model": model, "prompt": "a short question", "max_tokens": 1}
                    async with http.post(base + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        return terms_of(resp.headers["x-kvlb-route"])["adapter_ms"]

                # Two slots: sql is still there after chat.
                assert [await load_priced(m) for m in ("sql", "chat", "sql")] == [500, 500, 0]
                async with http.get(running.url + "/metrics") as resp:
                    metrics = await resp.text()
                for line in ('kvlb_replica_adapter_slots{replica="r0"} 2.0',
                             'kvlb_replica_adapters_resident{replica="r0"} 2.0',
                             'kvlb_replica_adapter_loads_total{replica="r0"} 2.0',
                             'kvlb_replica_adapter_loading_ms{replica="r0"} 0.0'):
                    assert line in metrics, line

                # `sum` streams straight from the replica, where kvlb cannot see it...
                async def direct() -> None:
                    body = {"model": "sum", "prompt": "p", "max_tokens": 300, "stream": True}
                    async with http.post(replica.url + "/v1/completions", json=body) as resp:
                        await resp.read()

                beside = asyncio.create_task(direct())
                try:
                    # ...but the engine's lora_requests_info names it, and the next round of
                    # discovery puts it in kvlb's account: no load priced for it.
                    deadline = asyncio.get_running_loop().time() + 2.0
                    while not slots.holds("sum"):
                        assert asyncio.get_running_loop().time() < deadline, slots.resident()
                        await asyncio.sleep(0.05)
                    assert await load_priced("sum") == 0
                finally:
                    beside.cancel()


async def listed_adapters(http: aiohttp.ClientSession, replica_url: str) -> set[str]:
    async with http.get(replica_url + "/v1/models") as resp:
        return {card["id"] for card in (await resp.json())["data"] if card.get("parent")}


async def unloads(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    line = "kvlb_adapter_unloads_total{"
    counted = {}
    for row in text.splitlines():
        if row.startswith(line):
            labels, _, value = row.partition("} ")
            counted[labels[len(line):]] = float(value)
    return counted


def sglang_registry(limit: int, *modules: str, time_scale: float = 20) -> list[str]:
    """A replica that keeps at most `limit` adapters registered, as SGLang's --max-loaded-loras."""
    args = ["--model", BASE, "--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "1",
            "--max-loaded-loras", str(limit), "--time-scale", str(time_scale)]
    return args + (["--lora-modules", *modules] if modules else [])


LOADABLE = [{"name": name, "path": f"/adapters/{name}", "base": BASE} for name in ("sql", "chat", "sum")]


@asynccontextmanager
async def two_registered(entry: dict) -> AsyncIterator[tuple[ReplicaProcess, Any, aiohttp.ClientSession]]:
    """A replica that keeps 2 adapters registered (config entry `entry`), kvlb loading sql,
    chat and sum on demand, after requests for sql, then chat twice: it holds both, sql the
    colder."""
    with ReplicaProcess(sglang_registry(2)) as replica:
        settings = make_settings([{"url": replica.url, "name": "r0", **entry}],
                                 adapters={"load_on_demand": LOADABLE, "load_path": "/load_lora_adapter"})
        async with run_balancer(settings) as running, aiohttp.ClientSession() as http:
            for model in ("sql", "chat", "chat"):
                assert (await complete(http, running.url, model))[0] == 200
            yield replica, running, http


async def test_a_replica_refusing_past_its_most_adapters_unloads_the_coldest_first() -> None:
    # Config gives the KV capacity and the replica starts with no adapter, so kvlb never asks
    # its /get_server_info and does not know its limit: the refusal says it.
    async with two_registered({"kv_capacity_tokens": 100000}) as (replica, running, http):
        # Full: sql, asked for once and longest ago, makes room for sum.
        status, headers, body = await complete(http, running.url, "sum")
        assert status == 200 and headers["x-kvlb-replica"] == "r0", body
        assert await listed_adapters(http, replica.url) == {"chat", "sum"}
        assert await unloads(http, running.url) == {'adapter="sql",outcome="unloaded"': 1.0}
        assert running.balancer.fleet.by_name["r0"].max_loaded_loras is None
        # And back: sql is loaded again, in place of the colder of the other two.
        assert (await complete(http, running.url, "sql"))[0] == 200
        assert "sql" in await listed_adapters(http, replica.url)
        assert len(await listed_adapters(http, replica.url)) == 2


async def test_an_adapter_in_use_is_not_unloaded_to_make_room() -> None:
    # Started with sql and chat registered, so kvlb reads the limit of 2 from the engine and
    # makes room before it asks; chat streams meanwhile and must finish.
    with ExitStack() as processes:
        replica = processes.enter_context(ReplicaProcess(
            sglang_registry(2, "sql=/adapters/sql", "chat=/adapters/chat", time_scale=1)))
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": replica.url, "name": "r0"}],
                                     adapters={"load_on_demand": LOADABLE, "load_path": "/load_lora_adapter"})
            running = await stack.enter_async_context(run_balancer(settings))
            assert running.balancer.fleet.by_name["r0"].max_loaded_loras == 2
            async with aiohttp.ClientSession() as http:
                assert (await complete(http, running.url, "sql"))[0] == 200

                async def stream_chat() -> tuple[int, int]:
                    body = {"model": "chat", "prompt": "write at length", "max_tokens": 200, "stream": True}
                    async with http.post(running.url + "/v1/completions", json=body) as resp:
                        chunks = [line async for line in resp.content if line.startswith(b"data: {")]
                        return resp.status, len(chunks)

                streaming = asyncio.create_task(stream_chat())
                await asyncio.sleep(0.2)  # chat is running on r0 now (200 tokens take over a second)
                assert not streaming.done()
                status, _, body = await complete(http, running.url, "sum")
                assert status == 200, body
                assert await streaming == (200, 200)
                assert await listed_adapters(http, replica.url) == {"chat", "sum"}
                # sql was listed when kvlb started, and is not served there now: it is loaded
                # again, in place of an idle one, not sent to a replica that would refuse it.
                status, _, body = await complete(http, running.url, "sql")
                assert status == 200, body
                assert "sql" in await listed_adapters(http, replica.url)
                assert sum((await unloads(http, running.url)).values()) == 2
                # None may go when config lists all it holds on it: a clear 503.
                held = sorted(await listed_adapters(http, replica.url))
                extra = [{"name": "extra", "path": "/adapters/extra", "base": BASE}]
                only_theirs = make_settings([{"url": replica.url, "name": "r0", "adapters": held}],
                                            adapters={"load_on_demand": extra, "load_path": "/load_lora_adapter"})
                theirs = await stack.enter_async_context(run_balancer(only_theirs))
                status, headers, body = await complete(http, theirs.url, "extra")
                assert status == 503 and body["error"]["code"] == "adapter_load_failed", body
                assert "its most" in body["error"]["message"] and int(headers["Retry-After"]) >= 1


async def test_an_adapter_unloaded_behind_kvlbs_back_is_retried_where_it_still_is() -> None:
    # A peer instance, or an operator, unloads sql from the replica that holds its prompt:
    # kvlb, which last read that replica's listing before, is told 404 there and goes on.
    args = ["--model", BASE, "--enable-lora", "--allow-runtime-lora-updating", "--lora-modules", "sql=/adapters/sql",
            "--max-loras", "1", "--time-scale", "20"]
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(args)) for _ in range(2)]
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": r.url, "name": f"r{i}"} for i, r in enumerate(replicas)],
                                     policy={"name": "predictive", "seed": 0})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                status, headers, _ = await complete(http, running.url, "sql")
                assert status == 200
                first = int(headers["x-kvlb-replica"][1:])
                async with http.post(replicas[first].url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as resp:
                    assert resp.status == 200
                # The same prompt ranks the replica holding it first; it answers 404, the other 200.
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200, body
                assert headers["x-kvlb-replica"] == f"r{1 - first}"
                async with http.get(running.url + "/metrics") as resp:
                    metrics = await resp.text()
                assert f'kvlb_upstream_attempts_total{{outcome="adapter_gone",replica="r{first}"}} 1.0' in metrics
                # Unloaded on the other too: a clear 503 that says to come back, then a 404 of
                # kvlb's own, since no replica serves it any more.
                async with http.post(replicas[1 - first].url + "/v1/unload_lora_adapter",
                                     json={"lora_name": "sql"}) as resp:
                    assert resp.status == 200
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 503 and body["error"]["code"] == "adapter_not_loaded", body
                assert headers["Retry-After"] == "1"
                status, _, body = await complete(http, running.url, "sql")
                assert status == 404 and body["error"]["code"] == "model_not_found", body


async def test_a_loadable_adapter_unloaded_behind_kvlbs_back_is_loaded_again_for_the_request() -> None:
    # A peer instance made room, or an operator unloaded it: the replica kvlb routes it to
    # answers 404. The adapter is one kvlb may load, so the client gets its answer, not a 503.
    args = ["--model", BASE, "--enable-lora", "--allow-runtime-lora-updating", "--lora-modules", "sql=/adapters/sql",
            "--max-loras", "1", "--time-scale", "20"]
    loadable = [{"name": "sql", "path": "/adapters/sql", "base": BASE}]
    with ReplicaProcess(args) as replica:
        async with AsyncExitStack() as stack:
            settings = make_settings([{"url": replica.url, "name": "r0"}], adapters={"load_on_demand": loadable})
            running = await stack.enter_async_context(run_balancer(settings))
            async with aiohttp.ClientSession() as http:
                assert (await complete(http, running.url, "sql"))[0] == 200
                async with http.post(replica.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as resp:
                    assert resp.status == 200
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200 and headers["x-kvlb-replica"] == "r0", body
                assert "sql" in await listed_adapters(http, replica.url)
                async with http.get(running.url + "/metrics") as resp:
                    metrics = await resp.text()
                assert 'kvlb_upstream_attempts_total{outcome="adapter_gone",replica="r0"} 1.0' in metrics
                assert 'kvlb_adapter_loads_total{adapter="sql",outcome="loaded"} 1.0' in metrics


async def test_a_404_that_does_not_name_the_adapter_leaves_it_where_it_is() -> None:
    # The replica has no embeddings route: its 404 is about the route, not the adapter, and
    # is relayed as it is; the adapter stays routed there.
    args = ["--model", BASE, "--enable-lora", "--lora-modules", "sql=/adapters/sql", "--max-loras", "1",
            "--time-scale", "20"]
    with ReplicaProcess(args) as replica:
        async with AsyncExitStack() as stack:
            running = await stack.enter_async_context(run_balancer(make_settings([{"url": replica.url}])))
            async with aiohttp.ClientSession() as http:
                async with http.post(running.url + "/v1/embeddings", json={"model": "sql", "input": "hi"}) as resp:
                    assert resp.status == 404
                    text = await resp.text()
                    assert "Not Found" in text and "sql" not in text, text
                status, _, body = await complete(http, running.url, "sql")
                assert status == 200, body
                async with http.get(running.url + "/metrics") as resp:
                    assert 'outcome="adapter_gone"' not in await resp.text()


async def test_an_adapter_a_request_is_about_to_be_routed_to_is_not_unloaded_to_make_room() -> None:
    # A request for sql has been through the loader (it is registered) but has not reached a
    # replica yet: while it waits, another adapter's load must not take sql's place, or the
    # request would find no replica serving it.
    async with two_registered({"max_loaded_loras": 2}) as (replica, running, http):
        loader = running.balancer.adapters
        waiting = RequestFeatures("/v1/completions", model="sql", adapter="sql", prompt_tokens=10)
        await loader.ensure("/v1/completions", waiting, None, None)
        try:
            # sql, asked for once and longest ago, would be the one to go.
            assert (await complete(http, running.url, "sum"))[0] == 200
            assert await listed_adapters(http, replica.url) == {"sql", "sum"}
        finally:
            loader.release("sql")
        assert await unloads(http, running.url) == {'adapter="chat",outcome="unloaded"': 1.0}


async def test_a_hot_adapter_unloads_another_to_spread_only_when_a_second_load_is_worth_it() -> None:
    # sql is on r0; r1 keeps two adapters registered, its most. Spreading sql to r1 unloads one
    # of them, whose next request loads it again: two loads, against r0's queue.
    def args(*modules: str) -> list[str]:
        return ["--model", BASE, "--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "2",
                "--max-loaded-loras", "2", "--lora-load-ms", "500", "--time-scale", "20", "--lora-modules", *modules]

    loadable = [{"name": name, "path": f"/adapters/{name}", "base": BASE} for name in ("sql", "f1", "f2")]
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(args("sql=/adapters/sql"))),
                    processes.enter_context(ReplicaProcess(args("f1=/adapters/f1", "f2=/adapters/f2")))]
        async with AsyncExitStack() as stack:
            entries = [{"url": r.url, "name": f"r{i}", "max_loras": 2, "max_loaded_loras": 2, "lora_load_ms": 500}
                       for i, r in enumerate(replicas)]
            settings = make_settings(entries, policy={"name": "predictive", "seed": 0},
                                     adapters={"load_on_demand": loadable, "load_path": "/load_lora_adapter"})
            running = await stack.enter_async_context(run_balancer(settings))
            r0 = running.balancer.fleet.by_name["r0"]
            async with aiohttp.ClientSession() as http:
                # An idle r0 keeps it (and now holds it in a slot, as far as kvlb knows).
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200 and headers["x-kvlb-replica"] == "r0", body
                # r0's queue, about 800 ms of prefill: more than one load on r1, less than two.
                r0.prefill_tokens_queued += 42_000
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200 and headers["x-kvlb-replica"] == "r0", body
                assert await listed_adapters(http, replicas[1].url) == {"f1", "f2"}
                assert await unloads(http, running.url) == {}
                # About 2.3 s: worth both.
                r0.prefill_tokens_queued += 78_000
                status, headers, body = await complete(http, running.url, "sql")
                assert status == 200, body
                listed = await listed_adapters(http, replicas[1].url)
                assert "sql" in listed and len(listed) == 2
                assert sum((await unloads(http, running.url)).values()) == 1
                r0.prefill_tokens_queued -= 120_000


async def test_a_load_passes_to_the_next_replica_when_the_first_has_no_room_left_at_its_turn() -> None:
    # r0 keeps one adapter registered, f1, idle: room for sql once f1 goes, and r1's queue
    # makes r0 the first choice. While sql's load waits its turn on r0 (a load or unload
    # under way there), a request for f1 comes through the loader, so f1 may not go.
    loadable = [{"name": name, "path": f"/adapters/{name}", "base": BASE} for name in ("sql", "f1")]
    with ExitStack() as processes:
        replicas = [processes.enter_context(ReplicaProcess(sglang_registry(1, "f1=/adapters/f1"))),
                    processes.enter_context(ReplicaProcess(sglang_registry(2)))]
        async with AsyncExitStack() as stack:
            entries = [{"url": r.url, "name": f"r{i}", "max_loaded_loras": i + 1} for i, r in enumerate(replicas)]
            settings = make_settings(entries, policy={"name": "predictive", "seed": 0},
                                     adapters={"load_on_demand": loadable, "load_path": "/load_lora_adapter"})
            running = await stack.enter_async_context(run_balancer(settings))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            loader = running.balancer.adapters
            r0, r1 = running.balancer.fleet.by_name["r0"], running.balancer.fleet.by_name["r1"]
            r1.prefill_tokens_queued += 200_000
            turn = loader._lock_of(r0)
            await turn.acquire()
            sql = asyncio.create_task(complete(http, running.url, "sql"))
            try:
                for _ in range(100):
                    if "sql" in loader._loading:
                        break
                    await asyncio.sleep(0.02)
                assert "sql" in loader._loading
                await asyncio.sleep(0.2)  # its load is waiting for r0
                f1 = RequestFeatures("/v1/completions", model="f1", adapter="f1", prompt_tokens=10)
                await loader.ensure("/v1/completions", f1, None, None)
            finally:
                turn.release()
            try:
                status, headers, body = await asyncio.wait_for(sql, 30)
            finally:
                loader.release("f1")
                r1.prefill_tokens_queued -= 200_000
            assert status == 200 and headers["x-kvlb-replica"] == "r1", body
            assert await listed_adapters(http, replicas[0].url) == {"f1"}
            assert await listed_adapters(http, replicas[1].url) == {"sql"}
            assert await unloads(http, running.url) == {}
