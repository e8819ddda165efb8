"""The OpenAI SDK works through kvlb unchanged: only its base URL points at the balancer."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import openai
import pytest

from loadtest.compare.stub_replica import make_stub_app
from tests.conftest import make_settings, run_balancer, serve_app


async def start_fleet(stack: AsyncExitStack, names: list[str], model: str = "stub-model", **sections) -> str:
    urls = [await stack.enter_async_context(serve_app(make_stub_app(n, model))) for n in names]
    replicas = [{"url": u, "name": n} for u, n in zip(urls, names, strict=True)]
    running = await stack.enter_async_context(run_balancer(make_settings(replicas, **sections)))
    return running.url


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


async def test_chat_and_completions_non_streaming() -> None:
    async with AsyncExitStack() as stack:
        url = await start_fleet(stack, ["a", "b"])
        async with client(url) as oai:
            chat = await oai.chat.completions.create(
                model="stub-model", messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            assert chat.choices[0].message.content.split()[0] in {"[a]", "[b]"}
            assert chat.usage.completion_tokens == 4
            comp = await oai.completions.create(model="stub-model", prompt="hello", max_tokens=3)
            assert comp.choices[0].text.split()[0] in {"[a]", "[b]"}
            assert len(comp.choices[0].text.split()) == 3


async def test_chat_and_completions_streaming() -> None:
    async with AsyncExitStack() as stack:
        url = await start_fleet(stack, ["a", "b"])
        async with client(url) as oai:
            stream = await oai.chat.completions.create(
                model="stub-model",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                if chunk.usage:
                    usage = chunk.usage
            assert len("".join(pieces).split()) == 5
            assert usage is not None and usage.completion_tokens == 5

            stream = await oai.completions.create(model="stub-model", prompt="x", max_tokens=3, stream=True)
            texts = [c.choices[0].text async for c in stream]
            assert len(texts) == 3


async def test_response_names_replica_and_carries_request_id() -> None:
    async with AsyncExitStack() as stack:
        url = await start_fleet(stack, ["a", "b"])
        async with client(url) as oai:
            raw = await oai.chat.completions.with_raw_response.create(
                model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            served_by = raw.headers["x-kvlb-replica"]
            assert served_by in {"a", "b"}
            assert raw.parse().choices[0].message.content.startswith(f"[{served_by}]")
            assert len(raw.headers["x-request-id"]) >= 16

        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "p"},
                                 headers={"x-request-id": "my-id-1"}) as resp:
                assert resp.headers["x-request-id"] == "my-id-1"


async def test_replica_header_can_be_switched_off() -> None:
    async with AsyncExitStack() as stack:
        url = await start_fleet(stack, ["a"], headers={"expose_replica": False})
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "p"}) as resp:
                assert resp.status == 200
                assert "x-kvlb-replica" not in resp.headers


async def test_models_is_the_union_listed_once() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a", "llama")))
        b = await stack.enter_async_context(serve_app(make_stub_app("b", "llama")))
        c = await stack.enter_async_context(serve_app(make_stub_app("c", "qwen")))
        settings = make_settings([a, b, c, {"url": "http://127.0.0.1:1", "model": "declared-only"}])
        running = await stack.enter_async_context(run_balancer(settings))
        async with client(running.url) as oai:
            models = await oai.models.list()
            ids = [m.id for m in models.data]
            assert sorted(ids) == ["declared-only", "llama", "qwen"]


async def test_multi_model_routing_stays_within_the_model() -> None:
    async with AsyncExitStack() as stack:
        llama = [await stack.enter_async_context(serve_app(make_stub_app(f"l{i}", "llama"))) for i in range(2)]
        qwen = await stack.enter_async_context(serve_app(make_stub_app("q0", "qwen")))
        settings = make_settings(
            [{"url": u, "name": f"l{i}"} for i, u in enumerate(llama)] + [{"url": qwen, "name": "q0"}],
            policy={"name": "round_robin"},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with client(running.url) as oai:
            for _ in range(6):
                raw = await oai.completions.with_raw_response.create(model="qwen", prompt="p", max_tokens=1)
                assert raw.headers["x-kvlb-replica"] == "q0"
            served = set()
            for _ in range(6):
                raw = await oai.completions.with_raw_response.create(model="llama", prompt="p", max_tokens=1)
                served.add(raw.headers["x-kvlb-replica"])
            assert served == {"l0", "l1"}
            with pytest.raises(openai.NotFoundError) as info:
                await oai.completions.create(model="mistral", prompt="p", max_tokens=1)
            assert info.value.code == "model_not_found"


async def test_embeddings_and_sglang_generate() -> None:
    async with AsyncExitStack() as stack:
        url = await start_fleet(stack, ["a"])
        async with client(url) as oai:
            emb = await oai.embeddings.create(model="stub-model", input=["one", "two"])
            assert len(emb.data) == 2
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}) as resp:
                assert resp.status == 200
                body = await resp.json()
                assert body["meta_info"]["completion_tokens"] == 3
                assert resp.headers["x-kvlb-replica"] == "a"


async def test_each_model_routes_by_its_own_policy_and_limit() -> None:
    """A big model's fleet round-robins and takes one request at a time; a small model's
    keeps a session on one replica; one model at its bound refuses, the other still serves."""
    async with AsyncExitStack() as stack:
        big = [await stack.enter_async_context(serve_app(make_stub_app(f"big{i}", "big", token_delay_s=0.05)))
               for i in range(2)]
        small = [await stack.enter_async_context(serve_app(make_stub_app(f"small{i}", "small"))) for i in range(2)]
        settings = make_settings(
            [{"url": u, "name": f"big{i}"} for i, u in enumerate(big)]
            + [{"url": u, "name": f"small{i}"} for i, u in enumerate(small)],
            policy={"name": "random"},
            per_model=[{"model": "big", "policy": {"name": "round_robin"}, "max_in_flight": 1},
                       {"model": "small", "policy": {"name": "consistent_hash"}}],
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            async def send(model: str, session: str = "s", max_tokens: int = 2) -> tuple[int, str, dict]:
                body = {"model": model, "prompt": "p", "max_tokens": max_tokens}
                async with http.post(running.url + "/v1/completions", json=body,
                                     headers={"x-session-id": session}) as resp:
                    return resp.status, resp.headers.get("x-kvlb-replica", ""), await resp.json()

            served = [(await send("big"))[1] for _ in range(6)]
            assert served in (["big0", "big1"] * 3, ["big1", "big0"] * 3), served
            for session in ("alice", "bob", "carol"):
                assert len({(await send("small", session))[1] for _ in range(4)}) == 1
            async def stream_slowly() -> int:
                body = {"model": "big", "prompt": "p", "max_tokens": 20, "stream": True}
                async with http.post(running.url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            # One big request streams its 20 tokens slowly: the next big one is refused, a
            # small one is not.
            slow = asyncio.create_task(stream_slowly())
            await asyncio.sleep(0.3)
            status, _, body = await send("big")
            assert status == 429 and body["error"]["code"] == "model_at_capacity", body
            assert (await send("small"))[0] == 200
            assert await slow == 200
            assert (await send("big"))[0] == 200
