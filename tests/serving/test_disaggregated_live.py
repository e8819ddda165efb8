"""Prefill/decode disaggregation through kvlb in front of simulated prefill and decode replicas,
in SGLang's protocol and in vLLM's: every request completes, streamed and not, on a decode
replica; a mostly cached prompt runs whole where vLLM's protocol allows it; a decode replica
killed while requests wait for their KV costs no request."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import AsyncExitStack, ExitStack

import aiohttp
import orjson
import pytest

from loadtest.replica.launch import ReplicaProcess
from tests.conftest import make_settings, run_balancer

MODEL = "m"
KV_BOTH = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
PROMPT = "summarize the quarterly report of the northern division in plain words " * 40


def replica_args(role: str, protocol: str, gbps: float = 400.0, time_scale: float = 20.0) -> list[str]:
    args = ["--model", MODEL, "--time-scale", str(time_scale), "--kv-transfer-gbps", str(gbps),
            "--disaggregation-wait-s", "10"]
    if protocol == "sglang":
        args += ["--disaggregation-mode", role]
    else:
        args += ["--kv-transfer-config", KV_BOTH]
    return args


def replica(role: str, protocol: str, **fields: float) -> ReplicaProcess:
    # Bootstrap ports drawn below the ephemeral range and drawn again when taken; a replica
    # that serves no KV ignores its own.
    return ReplicaProcess(replica_args(role, protocol, **fields), pick_bootstrap_port=True)


def entries(prefill: list[ReplicaProcess], decode: list[ReplicaProcess]) -> list[dict]:
    out = [{"url": r.url, "name": f"p{i}", "role": "prefill", "bootstrap_port": r.bootstrap_port,
            "labels": {"host": "node-0"}} for i, r in enumerate(prefill)]
    out += [{"url": r.url, "name": f"d{i}", "role": "decode", "labels": {"host": "node-0"}}
            for i, r in enumerate(decode)]
    return out


async def ask(http: aiohttp.ClientSession, url: str, route: str, stream: bool, prompt: str = PROMPT,
              max_tokens: int = 8) -> tuple[int, dict, dict]:
    """One request; a stream is read to its end and its usage chunk returned as the body."""
    if route == "/v1/chat/completions":
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    else:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url + route, json=body) as resp:
        if not stream or resp.status != 200:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)
        usage: dict = {}
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                usage = event.get("usage") or usage
        return resp.status, dict(resp.headers), {"usage": usage}


async def metric(http: aiohttp.ClientSession, url: str, outcome: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(f'kvlb_disaggregation_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_every_request_completes_on_a_decode_replica_streamed_and_not(protocol: str) -> None:
    with ExitStack() as processes:
        prefill = [processes.enter_context(replica("prefill", protocol)) for _ in range(2)]
        decode = [processes.enter_context(replica("decode", protocol)) for _ in range(2)]
        settings = make_settings(entries(prefill, decode), policy={"name": "predictive", "seed": 0},
                                 routing={"route_header": True}, disaggregation={"protocol": protocol})
        async with AsyncExitStack() as stack:
            running = await stack.enter_async_context(run_balancer(settings))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            n = 0
            for route in ("/v1/completions", "/v1/chat/completions"):
                for stream in (False, True):
                    n += 1
                    status, headers, body = await ask(http, running.url, route, stream, f"{n} {PROMPT}")
                    assert status == 200, body
                    assert headers["x-kvlb-replica"] in {"d0", "d1"}, headers
                    assert headers["x-kvlb-route"].startswith("prefill: chosen=p"), headers["x-kvlb-route"]
                    assert "decode: chosen=d" in headers["x-kvlb-route"]
                    assert body["usage"]["completion_tokens"] == 8, body
            assert await metric(http, running.url, "disaggregated") == 4
            # The two streamed answers fitted their decode replicas' speed.
            fleet = running.balancer.fleet
            assert fleet.by_name["d0"].itl_samples + fleet.by_name["d1"].itl_samples == 2
            # The same prompt again: its prefill replica holds it. SGLang's decode replica
            # reports that hit; vLLM's protocol runs a mostly cached prompt whole instead.
            status, headers, body = await ask(http, running.url, "/v1/completions", False, f"1 {PROMPT}")
            assert status == 200, body
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, body
            outcome = "disaggregated" if protocol == "sglang" else "colocated_cached"
            assert await metric(http, running.url, outcome) == (5 if protocol == "sglang" else 1)


async def test_a_decode_replica_killed_before_the_first_token_costs_no_request() -> None:
    # A slow link keeps every decode replica waiting for its KV for about half a second of
    # real time: long enough to kill one while its requests wait.
    with ExitStack() as processes:
        prefill = [processes.enter_context(replica("prefill", "sglang")) for _ in range(2)]
        decode = [processes.enter_context(replica("decode", "sglang", gbps=0.05))
                  for _ in range(2)]
        settings = make_settings(entries(prefill, decode), policy={"name": "predictive", "seed": 0},
                                 disaggregation={"protocol": "sglang"})
        async with AsyncExitStack() as stack:
            running = await stack.enter_async_context(run_balancer(settings))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            sent = [asyncio.ensure_future(ask(http, running.url, "/v1/completions", i % 2 == 0, f"{i} {PROMPT}"))
                    for i in range(8)]
            await asyncio.sleep(0.25)
            assert not any(task.done() for task in sent), "the link was meant to hold every request"
            os.kill(decode[0].pid, signal.SIGKILL)  # no goodbye: its connections just drop
            results = await asyncio.gather(*sent)
            for status, headers, body in results:
                assert status == 200, body
                assert headers["x-kvlb-replica"] == "d1"
                assert body["usage"]["completion_tokens"] == 8
            # Some of them were waiting on the killed replica: their pairs were retried whole.
            async with http.get(running.url + "/metrics") as resp:
                lines = (await resp.text()).splitlines()
            failed = [line for line in lines if line.startswith('kvlb_upstream_attempts_total{')
                      and 'replica="d0"' in line and 'outcome="ok"' not in line]
            assert sum(float(line.split()[-1]) for line in failed) > 0, failed


async def test_a_client_setting_the_balancers_fields_gets_a_clear_400_and_others_are_served() -> None:
    with ExitStack() as processes:
        prefill = [processes.enter_context(replica("prefill", "sglang"))]
        decode = [processes.enter_context(replica("decode", "sglang"))]
        settings = make_settings(entries(prefill, decode), disaggregation={"protocol": "sglang"})
        async with AsyncExitStack() as stack:
            running = await stack.enter_async_context(run_balancer(settings))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "bootstrap_room": 7}
            async with http.post(running.url + "/v1/completions", json=body) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["code"] == "reserved_field"
                assert error["param"] == "bootstrap_room" and "balancer" in error["message"]
            async with http.post(running.url + "/v1/completions", data=b"[1, 2]",
                                 headers={"content-type": "application/json"}) as resp:
                assert resp.status == 400 and "error" in await resp.json()
            # A room per sequence is a field kvlb writes: a request for a million is refused.
            many = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 1_000_000}
            async with http.post(running.url + "/v1/completions", json=many) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["code"] == "batch_too_large", error
            status, _, body = await ask(http, running.url, "/v1/completions", True)
            assert status == 200 and body["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_request_the_replicas_refuse_gets_their_400_and_costs_the_pool_nothing(protocol: str) -> None:
    """The engines' own refusal reaches its client, whichever half answers it; it is the
    request's fault, so it never ejects the prefill replica from under everyone else."""
    with ExitStack() as processes:
        prefill = [processes.enter_context(replica("prefill", protocol))]
        decode = [processes.enter_context(replica("decode", protocol))]
        settings = make_settings(entries(prefill, decode), disaggregation={"protocol": protocol})
        async with AsyncExitStack() as stack:
            running = await stack.enter_async_context(run_balancer(settings))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            bad = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": "hot"}
            for _ in range(8):
                async with http.post(running.url + "/v1/completions", json=bad) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 400 and error["param"] == "temperature", error
            async with http.get(running.url + "/metrics") as resp:
                metrics = await resp.text()
            assert 'kvlb_replica_breaker_state{replica="p0"} 0.0' in metrics
            assert 'outcome="http_400"' not in metrics
            status, headers, body = await ask(http, running.url, "/v1/completions", False)
            assert status == 200 and headers["x-kvlb-replica"] == "d0", body


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_an_adapter_unloaded_behind_kvlbs_back_moves_the_pair_on(side: str) -> None:
    # Every replica lists `sql` at start; then it is unloaded from one pool behind kvlb's back.
    # Their 404s are no fault of the replicas': the client is told to come back, and the next
    # request runs whole on the pool that still holds it (vLLM's kv_both engines serve alone).
    lora = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-modules", "sql=/adapters/sql"]
    with ExitStack() as processes:
        pools = {role: [processes.enter_context(ReplicaProcess(replica_args(role, "vllm") + lora,
                                                                       pick_bootstrap_port=True))
                        for _ in range(2)] for role in ("prefill", "decode")}
        settings = make_settings(entries(pools["prefill"], pools["decode"]), policy={"name": "predictive", "seed": 0},
                                 disaggregation={"protocol": "vllm"})
        async with AsyncExitStack() as stack:
            running = await stack.enter_async_context(run_balancer(settings))
            http = await stack.enter_async_context(aiohttp.ClientSession())

            async def ask_sql(n: int) -> tuple[int, dict, dict]:
                body = {"model": "sql", "prompt": f"{n} {PROMPT}", "max_tokens": 8}
                async with http.post(running.url + "/v1/completions", json=body) as resp:
                    return resp.status, dict(resp.headers), await resp.json(content_type=None)

            status, headers, body = await ask_sql(0)
            assert status == 200 and headers["x-kvlb-replica"] in {"d0", "d1"}, body
            for r in pools[side]:
                async with http.post(r.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as resp:
                    assert resp.status == 200
            status, headers, body = await ask_sql(1)
            assert status == 503 and body["error"]["code"] == "adapter_not_loaded", body
            assert headers["Retry-After"] == "1"
            async with http.get(running.url + "/metrics") as resp:
                lines = (await resp.text()).splitlines()
            gone = [line for line in lines if line.startswith("kvlb_upstream_attempts_total{")
                    and 'outcome="adapter_gone"' in line]
            assert sum(float(line.split()[-1]) for line in gone) == 2, gone
            fleet = running.balancer.fleet
            assert all(not fleet.by_name[f"{side[0]}{i}"].breaker.ejections for i in range(2))
            status, headers, body = await ask_sql(2)
            assert status == 200, body
            assert await metric(http, running.url, "colocated_no_pair") == 1
            other = "p" if side == "decode" else "d"
            assert headers["x-kvlb-replica"] in {f"{other}0", f"{other}1"}, headers
