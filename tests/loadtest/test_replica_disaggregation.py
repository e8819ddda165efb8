"""Prefill/decode disaggregation: replicas playing either half, in SGLang's and vLLM's protocols.

Real replicas in this process, real sockets on 127.0.0.1: a router's part is played here,
sending SGLang's bootstrap fields to both halves at once, or vLLM's prefill leg and then its
decode leg with the prefill answer's kv_transfer_params.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.replica.cli import config_from_args, main
from loadtest.replica.config import KvTransferConfig, ReplicaConfig
from loadtest.replica.engine import Engine, EngineConfig
from loadtest.replica.handoff import HandoffTable, TransferCounters
from loadtest.replica.launch import ReplicaProcess, running_replica
from loadtest.replica.profiles import PROFILES, get_profile
from loadtest.replica.server import ReplicaServer
from tests.loadtest.test_replica_cli import parse

SCALE = 30.0  # fast, yet slow enough for model times to show through the noise
BLOCK = 16
NIXL = KvTransferConfig("NixlConnector")
ROUTES = ("completions", "chat", "generate")


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


def config(**fields: Any) -> ReplicaConfig:
    fields.setdefault("time_scale", SCALE)
    return ReplicaConfig(**fields)


@contextlib.asynccontextmanager
async def replicas(*configs: ReplicaConfig) -> AsyncIterator[list[ReplicaServer]]:
    """Replicas started in order, all stopped on exit, however the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        # Bootstrap ports drawn below the ephemeral range, as every test port, and drawn
        # again when taken (port 0 would take one above it).
        started = [running_replica(c, pick_bootstrap_port=True) for c in configs]
        yield [await stack.enter_async_context(r) for r in started]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def bootstrap(prefill: ReplicaServer, room: int | None = None) -> dict[str, Any]:
    """The three fields SGLang's router adds to both halves' body."""
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.randrange(2**63) if room is None else room,
    }


def request(route: str, text: str, max_tokens: int, stream: bool = False) -> tuple[str, dict]:
    if route == "generate":
        body: dict[str, Any] = {"text": text, "sampling_params": {"max_new_tokens": max_tokens}}
        path = "/generate"
    elif route == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": text, "max_tokens": max_tokens}
        path = "/v1/completions"
    if stream:
        body["stream"] = True
        if route != "generate":
            body["stream_options"] = {"include_usage": True}
    return path, body


class Answer:
    """One answer, streamed or not, in any of the three routes' shapes."""

    def __init__(self, status: int, body: Any, tokens: int, cached: int, ttft_s: float | None):
        self.status = status
        self.body = body
        self.tokens = tokens
        self.cached = cached
        self.ttft_s = ttft_s  # streams: from sending to the first token's chunk


async def send(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> Answer:
    started = time.monotonic()
    async with http.post(url + path, json=body) as response:
        if not body.get("stream") or response.status != 200:
            data = await response.json()
            if response.status != 200:
                return Answer(response.status, data, 0, 0, None)
            if path == "/generate":
                meta = data["meta_info"]
                assert len(data["text"].split()) == meta["completion_tokens"]
                return Answer(200, data, meta["completion_tokens"], meta["cached_tokens"], None)
            usage = data["usage"]
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert len(text.split()) == usage["completion_tokens"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            return Answer(200, data, usage["completion_tokens"], cached, None)
        chunks, ttft = [], None
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if ttft is None:
                ttft = time.monotonic() - started
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunks.append(orjson.loads(payload))
    if path == "/generate":
        meta = chunks[-1]["meta_info"]
        return Answer(200, chunks, len(chunks), meta["cached_tokens"], ttft)
    tokens = sum(1 for chunk in chunks for _ in chunk["choices"])
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == tokens
    return Answer(200, chunks, tokens, usage["prompt_tokens_details"]["cached_tokens"], ttft)


async def stats(http: aiohttp.ClientSession, server: ReplicaServer) -> dict[str, Any]:
    async with http.get(server.url + "/admin/stats") as response:
        return await response.json()


async def metrics(http: aiohttp.ClientSession, server: ReplicaServer) -> dict[tuple, float]:
    async with http.get(server.url + "/metrics") as response:
        text = await response.text()
    return {
        (sample.name, sample.labels.get("reason")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "kv_transfer" in sample.name
    }


def assert_openai_error(answer: Answer, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body
    error = answer.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- the parts -------------------------------------------------------------------------


def test_profiles_know_their_kv_bytes_per_token():
    expected = {"llama-3.1-8b": 131_072, "llama-3.1-70b": 327_680, "qwen3-8b": 147_456}
    for profile in PROFILES.values():
        assert profile.kv_bytes_per_token == expected[profile.model]
    # 1,000 tokens of llama-3.1-8b over 100 Gb/s: 131 MB, 10.5 ms.
    assert get_profile("llama-3.1-8b-h100").kv_transfer_seconds(1000, 100) == pytest.approx(
        0.01048576
    )


def test_transferred_prompt_costs_one_decode_step_and_stays_cached():
    profile = get_profile("llama-3.1-8b-h100")
    engine = Engine(EngineConfig(profile=profile))
    prompt = words("t", 100)
    seq = engine.submit(prompt.split(), 3, 0.0, kv_transferred=True)
    iteration = engine.step(0.0)
    assert (iteration.prefill_tokens, iteration.decode_seqs) == (0, 1)
    assert iteration.duration == pytest.approx(profile.decode_step_ms(1, 101) / 1000)
    assert seq.num_generated == 1 and seq.first_token_time == iteration.end
    while engine.has_work:
        engine.step(engine.next_step_time())
    assert seq.finished and engine.counters.prompt_tokens == 0
    assert engine.counters.transferred_tokens == 100
    # Its 6 full blocks are in the prefix cache, as if computed here.
    again = engine.submit(prompt.split(), 1, engine.busy_until)
    engine.step(engine.busy_until)
    assert again.cached_tokens == 96


def test_handoff_table_is_bounded_and_expires():
    now = [0.0]
    counters = TransferCounters()
    table = HandoffTable(2, ttl_s=10.0, counters=counters, clock=lambda: now[0])
    for room in (1, 2, 3):
        table.put(room, 100, 0)
    assert len(table) == 2 and counters.failures["dropped"] == 1  # room 1, the oldest
    now[0] = 11.0
    table.put(4, 100, 0)
    assert len(table) == 1 and counters.failures["expired"] == 2


async def test_handoff_table_waits_for_a_room_put_later():
    table = HandoffTable(8, ttl_s=60.0, counters=TransferCounters())
    waiting = asyncio.create_task(table.take(7, wait_s=5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    table.put(7, 50, 32)
    held = await asyncio.wait_for(waiting, 1.0)
    assert (held.prompt_tokens, held.cached_tokens) == (50, 32)
    assert await table.take(7, wait_s=0.0) is None  # fetched: gone
    assert len(table) == 0  # and no placeholder left behind by the waits


def test_flags_build_the_config():
    args = parse(
        ["replica", "--port", "0", "--disaggregation-mode", "decode",
         "--disaggregation-bootstrap-port", "9100", "--disaggregation-wait-s", "2.5",
         "--kv-transfer-gbps", "25", "--kv-transfer-ttl-s", "30"]
    )  # fmt: skip
    built = config_from_args(args)
    assert (built.disaggregation_mode, built.disaggregation_bootstrap_port) == ("decode", 9100)
    assert (built.disaggregation_wait_s, built.kv_transfer_gbps) == (2.5, 25.0)
    assert built.kv_transfer_ttl_s == 30.0 and built.kv_transfer_config is None
    defaults = config_from_args(parse(["replica", "--port", "0"]))
    assert (defaults.disaggregation_mode, defaults.disaggregation_bootstrap_port) == ("null", 8998)
    assert defaults.kv_transfer_gbps == 100.0
    vllm = config_from_args(
        parse(["replica", "--port", "0", "--kv-transfer-config",
               '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'])
    )  # fmt: skip
    assert vllm.kv_transfer_config == KvTransferConfig("NixlConnector", "kv_both")


def test_bad_disaggregation_settings_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["replica", "--port", "0", "--disaggregation-mode", "both"])
    with pytest.raises(ValueError, match="disaggregation_mode"):
        ReplicaConfig(disaggregation_mode="both")
    assert main(parse(["replica", "--port", "0", "--kv-transfer-config", "{nope"])) == 2
    assert "kv_transfer_config" in capsys.readouterr().err
    both = ["--disaggregation-mode", "prefill", "--kv-transfer-config", '{"kv_connector":"X"}']
    assert main(parse(["replica", "--port", "0", *both])) == 2
    assert "not both" in capsys.readouterr().err
    assert main(parse(["replica", "--port", "0", "--kv-transfer-gbps", "0"])) == 2


def test_prefill_process_reports_its_bootstrap_port():
    args = ["--disaggregation-mode", "prefill", "--time-scale", "50"]
    with ReplicaProcess(args, pick_bootstrap_port=True) as replica:
        with urllib.request.urlopen(replica.url + "/get_server_info", timeout=5) as response:
            info = orjson.loads(response.read())
        assert info["disaggregation_mode"] == "prefill"
        port = info["disaggregation_bootstrap_port"]
        assert isinstance(port, int) and port > 0
        assert replica.bootstrap_port == port  # also on its "listening on" line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            assert response.status == 200


async def test_a_taken_bootstrap_port_fails_the_start_at_once():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        busy = config(
            disaggregation_mode="prefill", disaggregation_bootstrap_port=taken.getsockname()[1]
        )
        with pytest.raises(OSError, match="bootstrap port"):
            async with running_replica(busy):
                pass
    finally:
        taken.close()


# -- SGLang's protocol -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", ROUTES)
async def test_sglang_pair_serves_the_same_body_sent_to_both(http, route, stream):
    async with replicas(
        config(disaggregation_mode="prefill"), config(disaggregation_mode="decode")
    ) as (prefill, decode):
        path, body = request(route, words("s", 300), 7, stream)
        cached = []
        for _ in range(2):  # the second time, the prefill replica has the prompt cached
            both = {**body, **bootstrap(prefill)}
            first, second = await asyncio.gather(
                send(http, prefill.url, path, both), send(http, decode.url, path, both)
            )
            assert (first.status, first.tokens) == (200, 1)  # a valid 1-token answer
            assert (second.status, second.tokens) == (200, 7)
            assert second.cached == first.cached  # the prefill side's hit, not the transfer's
            cached.append(second.cached)
        prompt_tokens = 300 if route != "chat" else 302  # <|user|> and <|assistant|>
        assert cached == [0, (prompt_tokens - 1) // BLOCK * BLOCK]
        decoded = (await stats(http, decode))["engine"]
        assert decoded["prefill_tokens"] == 0  # the decode replica computed no prompt
        assert decoded["transferred_tokens"] == 2 * prompt_tokens
        assert decoded["generation_tokens"] == 14
        assert (await stats(http, prefill))["engine"]["prefill_tokens"] > prompt_tokens
        sent, received = await metrics(http, prefill), await metrics(http, decode)
        assert sent[("kvlb_replica_kv_transfers_sent_total", None)] == 2
        assert received[("kvlb_replica_kv_transfers_received_total", None)] == 2
        assert not any(v for (name, _), v in received.items() if "failures" in name)


async def test_decode_asking_before_the_prefill_arrives_still_works(http):
    async with replicas(
        config(disaggregation_mode="prefill"), config(disaggregation_mode="decode")
    ) as (prefill, decode):
        path, body = request("completions", words("early", 200), 5)
        both = {**body, **bootstrap(prefill)}
        started = time.monotonic()
        decoding = asyncio.create_task(send(http, decode.url, path, both))
        await asyncio.sleep(0.3)
        assert not decoding.done()  # waiting for a room the prefill server has not heard of
        prefilled = await send(http, prefill.url, path, both)
        answer = await asyncio.wait_for(decoding, 5.0)
        assert prefilled.status == 200
        assert (answer.status, answer.tokens) == (200, 5)
        assert time.monotonic() - started >= 0.3


async def test_decode_with_unreachable_prefill_side_is_503_in_time(http):
    # A bound socket that does not listen: connections to it are refused.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        async with replicas(config(disaggregation_mode="decode", disaggregation_wait_s=0.5)) as (
            decode,
        ):
            path, body = request("chat", "hello there", 4)
            fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": closed.getsockname()[1],
                      "bootstrap_room": 12345}  # fmt: skip
            started = time.monotonic()
            answer = await send(http, decode.url, path, {**body, **fields})
            assert time.monotonic() - started < 3.0
            error = assert_openai_error(answer, 503)
            assert "prefill server" in error["message"]
            assert error["type"] == "service_unavailable_error"
            failures = await metrics(http, decode)
            assert failures[("kvlb_replica_kv_transfer_failures_total", "unreachable")] == 1
    finally:
        closed.close()


async def test_decode_with_silent_prefill_side_times_out(http):
    # Accepts connections and never answers: the deadline must end the wait.
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        async with replicas(config(disaggregation_mode="decode", disaggregation_wait_s=0.3)) as (
            decode,
        ):
            path, body = request("generate", "one two three", 2)
            port = server.sockets[0].getsockname()[1]
            fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 1}
            started = time.monotonic()
            answer = await send(http, decode.url, path, {**body, **fields})
            elapsed = time.monotonic() - started
            assert_openai_error(answer, 503)
            assert 1.0 <= elapsed < 4.0  # the wait plus its one second of slack
            failures = await metrics(http, decode)
            assert failures[("kvlb_replica_kv_transfer_failures_total", "timeout")] == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_room_that_never_appears_is_503_after_the_wait(http):
    async with replicas(
        config(disaggregation_mode="prefill"),
        config(disaggregation_mode="decode", disaggregation_wait_s=0.5),
    ) as (prefill, decode):
        path, body = request("completions", "never prefilled", 3)
        started = time.monotonic()
        answer = await send(http, decode.url, path, {**body, **bootstrap(prefill)})
        elapsed = time.monotonic() - started
        error = assert_openai_error(answer, 503)
        assert "bootstrap room" in error["message"] and "prefill server" in error["message"]
        assert 0.4 <= elapsed < 3.0
        # The prefill replica's main port is no bootstrap server: a bare 404 at once.
        wrong = {**body, **bootstrap(prefill), "bootstrap_port": prefill.port}
        assert_openai_error(await send(http, decode.url, path, wrong), 503)
        failures = await metrics(http, decode)
        assert failures[("kvlb_replica_kv_transfer_failures_total", "not_found")] == 1
        assert failures[("kvlb_replica_kv_transfer_failures_total", "bad_answer")] == 1


async def test_missing_bootstrap_fields_are_400(http):
    async with replicas(
        config(disaggregation_mode="prefill"), config(disaggregation_mode="decode")
    ) as (prefill, decode):
        for route in ROUTES:
            path, body = request(route, "a b c", 2)
            error = assert_openai_error(await send(http, decode.url, path, body), 400)
            assert error["param"] == "bootstrap_host"
            partial = {**body, **bootstrap(prefill)}
            del partial["bootstrap_port"]
            error = assert_openai_error(await send(http, decode.url, path, partial), 400)
            assert error["param"] == "bootstrap_port"
            error = assert_openai_error(await send(http, prefill.url, path, body), 400)
            assert error["param"] == "bootstrap_room"
        path, body = request("generate", "a b c", 2)
        for room in ([1, 2], -1, 2**63, "7"):
            batch = {**body, **bootstrap(prefill), "bootstrap_room": room}
            error = assert_openai_error(await send(http, prefill.url, path, batch), 400)
            assert error["param"] == "bootstrap_room"
        info = await (await http.get(prefill.url + "/get_server_info")).json()
        assert info["disaggregation_mode"] == "prefill"
        assert info["disaggregation_bootstrap_port"] == prefill.bootstrap_port
        assert decode.bootstrap_port is None  # a decode replica serves no KV


async def test_transfer_time_shows_in_time_to_first_token(http):
    slow_gbps, fast_gbps = 0.25, 1000.0
    async with replicas(
        config(disaggregation_mode="prefill"),
        config(disaggregation_mode="decode", kv_transfer_gbps=fast_gbps),
        config(disaggregation_mode="decode", kv_transfer_gbps=slow_gbps),
    ) as (prefill, fast, slow):
        path, body = request("completions", words("long", 2000), 3, stream=True)
        ttft = {}
        # The slow one goes second, when the prefill replica has the prompt cached: that
        # only shortens its wait, against what is asserted.
        for name, decode in (("fast", fast), ("slow", slow)):
            both = {**body, **bootstrap(prefill)}
            _, answer = await asyncio.gather(
                send(http, prefill.url, path, both), send(http, decode.url, path, both)
            )
            assert answer.tokens == 3
            ttft[name] = answer.ttft_s
        transfer_s = get_profile(prefill.config.profile).kv_transfer_seconds(2000, slow_gbps)
        assert ttft["slow"] >= 0.8 * transfer_s / SCALE  # 280 ms of real time
        assert ttft["slow"] > 3 * ttft["fast"]


# -- vLLM's connector flow -------------------------------------------------------------


def prefill_leg(route: str, text: str) -> tuple[str, dict]:
    """What vLLM's disaggregation proxies send the prefill engine."""
    path, body = request(route, text, 1)
    if route == "chat":
        del body["max_tokens"]
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    return path, body


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_vllm_prefill_leg_answers_kv_transfer_params(http, route):
    async with replicas(config(kv_transfer_config=NIXL)) as (server,):
        info = await (await http.get(server.url + "/get_server_info")).json()
        assert info["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        path, body = prefill_leg(route, words("v", 100))
        held = []
        for _ in range(2):
            answer = await send(http, server.url, path, body)
            assert (answer.status, answer.tokens) == (200, 1)
            params = answer.body["kv_transfer_params"]
            assert set(params) == {
                "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
                "remote_host", "remote_port", "tp_size",
            }  # fmt: skip
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["remote_engine_id"] == info["engine_id"]
            assert (params["remote_host"], params["remote_port"]) == (
                "127.0.0.1",
                server.bootstrap_port,
            )
            assert params["tp_size"] == 1
            prompt_tokens = answer.body["usage"]["prompt_tokens"]
            assert len(params["remote_block_ids"]) == -(-prompt_tokens // BLOCK)
            assert all(isinstance(b, int) for b in params["remote_block_ids"])
            held.append(set(params["remote_block_ids"]))
        assert not held[0] & held[1]  # unique per transfer


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_vllm_decode_leg_decodes_with_the_transferred_kv(http, route, stream):
    async with replicas(config(kv_transfer_config=NIXL), config(kv_transfer_config=NIXL)) as (
        prefill,
        decode,
    ):
        text = words("n", 250)
        cached = []
        for _ in range(2):
            path, body = prefill_leg(route, text)
            first = await send(http, prefill.url, path, body)
            assert first.status == 200
            _, body = request(route, text, 6, stream)
            body["kv_transfer_params"] = first.body["kv_transfer_params"]
            answer = await send(http, decode.url, path, body)
            assert (answer.status, answer.tokens) == (200, 6)
            assert answer.cached == first.cached
            cached.append(answer.cached)
        assert cached[0] == 0 and cached[1] > 0
        decoded = (await stats(http, decode))["engine"]
        assert decoded["prefill_tokens"] == 0
        assert decoded["generation_tokens"] == 12
        assert (await stats(http, decode))["kv_transfers"]["received"] == 2
        assert (await stats(http, prefill))["kv_transfers"]["sent"] == 2


async def test_vllm_unknown_or_expired_transfer_is_503(http):
    # 0.3 model seconds of TTL: 10 ms of real time at this scale.
    async with replicas(
        config(kv_transfer_config=NIXL), config(kv_transfer_config=NIXL, kv_transfer_ttl_s=0.3)
    ) as (server, short_lived):
        path, body = prefill_leg("completions", "held once")
        params = (await send(http, server.url, path, body)).body["kv_transfer_params"]
        _, decode_body = request("completions", "held once", 2)
        decode_body["kv_transfer_params"] = params
        assert (await send(http, server.url, path, decode_body)).status == 200
        # Fetched once already, and another engine's id: both unknown there.
        assert_openai_error(await send(http, server.url, path, decode_body), 503)
        other = {**params, "remote_engine_id": "someone-else"}
        assert_openai_error(
            await send(http, server.url, path, {**decode_body, "kv_transfer_params": other}), 503
        )
        params = (await send(http, short_lived.url, path, body)).body["kv_transfer_params"]
        await asyncio.sleep(0.2)
        expired = {**decode_body, "kv_transfer_params": params}
        error = assert_openai_error(await send(http, server.url, path, expired), 503)
        assert "prefill server" in error["message"]
        assert (await stats(http, short_lived))["kv_transfers"]["failures"]["expired"] == 1
        assert (await stats(http, server))["kv_transfers"]["failures"]["not_found"] == 3


async def test_kv_transfer_params_need_kv_transfer_config(http):
    async with replicas(config(), config(disaggregation_mode="prefill")) as servers:
        path, body = prefill_leg("completions", "a b c")
        for server in servers:
            error = assert_openai_error(await send(http, server.url, path, body), 400)
            assert error["param"] == "kv_transfer_params"


async def test_kv_both_replica_serves_plain_requests(http):
    async with replicas(config(kv_transfer_config=NIXL)) as (server,):
        for route in ROUTES:
            path, body = request(route, words("p", 40), 5, stream=route == "chat")
            answer = await send(http, server.url, path, body)
            assert (answer.status, answer.tokens) == (200, 5)
        path, body = prefill_leg("completions", "a b c")
        error = assert_openai_error(
            await send(http, server.url, path, {**body, "stream": True}), 400
        )
        assert error["param"] == "stream"
        path, body = request("generate", "a b c", 2)
        body["kv_transfer_params"] = {"do_remote_decode": True}
        assert_openai_error(await send(http, server.url, path, body), 400)
