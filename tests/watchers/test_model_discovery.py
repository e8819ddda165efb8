"""What model discovery reads of a vLLM replica's adapter slots, through a real socket: the
`vllm:lora_requests_info` gauge as vLLM writes it (balancer/watchers/models.py)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from balancer.config import ModelDiscoverySettings, ReplicaSettings
from balancer.routing.fleet import Fleet
from balancer.watchers.models import MAX_METRICS_BYTES, ModelWatcher
from tests.conftest import serve_app

MODELS = {"object": "list", "data": [
    {"id": "base", "object": "model"},
    {"id": "sql", "object": "model", "parent": "base"},
    {"id": 'odd"name', "object": "model", "parent": "base"},
]}


def vllm_app(metrics: str) -> web.Application:
    app = web.Application()

    async def models(request: web.Request) -> web.Response:
        return web.json_response(MODELS)

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=metrics, content_type="text/plain")

    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", page)
    return app  # no /get_server_info: vLLM has none


async def discovered(metrics: str, max_loras: int | None = None) -> Fleet:
    async with serve_app(vllm_app(metrics)) as url, aiohttp.ClientSession() as session:
        fleet = Fleet([ReplicaSettings(url=url, name="r0", max_loras=max_loras)])
        await ModelWatcher(fleet, ModelDiscoverySettings(), session).refresh_once()
        return fleet


async def test_the_newest_lora_requests_info_gives_the_slots_and_what_runs() -> None:
    page = "\n".join([
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09',
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="sql,odd\\"name",waiting_lora_adapters="x"} 1.8e+09',
        'vllm:num_requests_running{model_name="base"} 2.0',
        "",
    ])
    slots = (await discovered(page)).replicas[0].adapter_slots
    assert slots.capacity == 3
    assert slots.resident() == ["sql", 'odd"name']
    # What config says wins over what the engine says.
    slots = (await discovered(page, max_loras=5)).replicas[0].adapter_slots
    assert slots.capacity == 5 and slots.resident() == ["sql", 'odd"name']


async def test_a_page_without_the_gauge_or_past_the_bound_changes_nothing() -> None:
    assert (await discovered("vllm:num_requests_running 1.0\n")).replicas[0].adapter_slots.capacity == 1
    # The gauge only after MAX_METRICS_BYTES of other series is not read.
    filler = "# filler line to pad the page out\n" * (MAX_METRICS_BYTES // 34 + 10)
    late = filler + 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1.0\n'
    slots = (await discovered(late)).replicas[0].adapter_slots
    assert slots.capacity == 1 and slots.resident() == []


async def test_a_listing_asked_for_before_kvlb_unloaded_an_adapter_does_not_bring_it_back() -> None:
    unload_meanwhile: list[Fleet] = []

    async def models(request: web.Request) -> web.Response:
        for fleet in unload_meanwhile:  # kvlb unloads sql while this answer is on its way
            fleet.replicas[0].adapter_unloaded("sql")
        return web.json_response(MODELS)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        fleet = Fleet([ReplicaSettings(url=url, name="r0")])
        watcher = ModelWatcher(fleet, ModelDiscoverySettings(), session)
        replica = fleet.replicas[0]
        await watcher.refresh_once()
        assert replica.serves("sql")
        unload_meanwhile.append(fleet)
        await watcher.refresh_once()
        assert not replica.serves("sql") and not replica.serves_adapter("sql")
        assert replica.serves_adapter('odd"name')
        # The next listing, asked for after, is believed.
        unload_meanwhile.clear()
        await watcher.refresh_once()
        assert replica.serves("sql") and replica.serves_adapter("sql")


async def test_the_engine_says_how_many_adapters_it_keeps_registered() -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response(MODELS)

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"max_loaded_loras": 4, "max_loras_per_batch": 2})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", info)
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        fleet = Fleet([ReplicaSettings(url=url, name="r0"), ReplicaSettings(url=url, name="r1", max_loaded_loras=9)])
        await ModelWatcher(fleet, ModelDiscoverySettings(), session).refresh_once()
        assert [r.max_loaded_loras for r in fleet.replicas] == [4, 9]
    # vLLM has no /get_server_info, and no such limit.
    assert (await discovered("")).replicas[0].max_loaded_loras is None
