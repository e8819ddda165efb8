"""The HTTP face, spoken to by the official `openai` SDK and by raw HTTP for SGLang's routes."""

import asyncio
import gc
import socket
import time

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.replica.config import ReplicaConfig
from loadtest.replica.driver import TokenListener
from loadtest.replica.engine import EngineSequence
from loadtest.replica.launch import running_replica
from loadtest.replica.streaming import SseStream
from loadtest.replica.tokens import output_text

FAST = 1000.0  # time scale for tests that check shapes, not timing


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


@pytest.fixture
async def replica():
    async with running_replica(ReplicaConfig(time_scale=FAST)) as server:
        yield server


@pytest.fixture
async def client(replica):
    sdk = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def sse_payloads(response: aiohttp.ClientResponse) -> list[bytes]:
    payloads = []
    async for line in response.content:
        if line.startswith(b"data: "):
            payloads.append(line[6:].strip())
    return payloads


async def test_chat_completion(client, replica):
    completion = await client.chat.completions.create(
        model="any-name",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=7,
    )
    assert completion.choices[0].message.content == output_text(7)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == 6  # 3 words + 2 role markers + assistant marker
    assert completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    assert completion.model == "any-name"


async def test_chat_stream_with_usage(client):
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": words("w", 100)}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) == 12  # one chunk per token
    assert "".join(pieces) == output_text(12)
    assert finish == "length"
    assert usage.prompt_tokens == 102 and usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens == 0


async def test_shared_prefix_is_reported_as_cached(client):
    shared = words("sys", 4096)
    cached = []
    for question in ("first question", "second question"):
        completion = await client.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": shared}, {"role": "user", "content": question}],
            max_tokens=2,
        )
        cached.append(completion.usage.prompt_tokens_details.cached_tokens)
    # <|system|> + 4,096 words + <|user|> are shared: 4,098 tokens, 256 whole blocks.
    assert cached == [0, 4096]


async def test_text_completions(client):
    completion = await client.completions.create(model="m", prompt=words("p", 50), max_tokens=5)
    assert completion.choices[0].text == output_text(5)
    assert completion.usage.prompt_tokens == 50
    stream = await client.completions.create(
        model="m",
        prompt=list(range(40)),
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        texts += [choice.text for choice in chunk.choices]
    assert "".join(texts) == output_text(5)
    assert usage.prompt_tokens == 40


async def test_default_max_tokens(client):
    completion = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}]
    )
    assert completion.usage.completion_tokens == 16


async def test_models_and_info_routes(client, replica, http):
    models = await client.models.list()
    assert [model.id for model in models.data] == ["kvlb-sim-llama-3.1-8b"]
    for path in ("/get_server_info", "/server_info"):
        async with http.get(replica.url + path) as response:
            info = await response.json()
        assert info["profile"] == "llama-3.1-8b-h100"
        assert info["kv_capacity_tokens"] == 440_000
        assert info["block_size"] == 16
        assert info["time_scale"] == FAST
        assert info["model"] == "kvlb-sim-llama-3.1-8b"
    for path in ("/get_model_info", "/model_info"):
        async with http.get(replica.url + path) as response:
            assert (await response.json())["model_path"] == "kvlb-sim-llama-3.1-8b"
    for path in ("/health", "/health_generate"):
        async with http.get(replica.url + path) as response:
            assert response.status == 200


async def test_generate_plain_and_streamed(replica, http):
    body = {"text": words("g", 30), "sampling_params": {"max_new_tokens": 4}}
    async with http.post(replica.url + "/generate", json=body) as response:
        answer = await response.json()
    assert answer["text"] == output_text(4)
    meta = answer["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (30, 4, 0)
    assert meta["finish_reason"] == {"type": "length", "length": 4}

    body = {"input_ids": list(range(40)), "sampling_params": {"max_new_tokens": 3}, "stream": True}
    async with http.post(replica.url + "/generate", json=body) as response:
        payloads = await sse_payloads(response)
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert [c["text"] for c in chunks] == [output_text(n) for n in (1, 2, 3)]  # cumulative
    assert chunks[-1]["meta_info"]["completion_tokens"] == 3
    # The first 32 ids were cached by nothing yet, so this is a cold prompt.
    assert chunks[-1]["meta_info"]["cached_tokens"] == 0


async def test_get_load_and_metrics(replica, http):
    async with http.get(replica.url + "/get_load") as response:
        load = await response.json()
    assert load == [{"dp_rank": 0, "num_tokens": 0, "num_reqs": 0, "num_waiting_reqs": 0}]
    shared = words("s", 64)
    for tail in ("a", "b"):
        body = {"prompt": f"{shared} {tail}", "max_tokens": 1}
        async with http.post(replica.url + "/v1/completions", json=body) as response:
            assert response.status == 200
    async with http.get(replica.url + "/metrics") as response:
        text = await response.text()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples["vllm:num_requests_running"] == 0
    assert samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:kv_cache_usage_perc"] == 0
    assert samples["vllm:prefix_cache_queries_total"] == 130
    assert samples["vllm:prefix_cache_hits_total"] == 64
    assert samples["sglang:num_running_reqs"] == 0
    assert samples["sglang:num_queue_reqs"] == 0
    assert samples["sglang:token_usage"] == 0
    assert samples["sglang:cache_hit_rate"] == pytest.approx(64 / 130)


async def test_load_while_busy(http):
    config = ReplicaConfig(time_scale=FAST, max_running=1)
    async with running_replica(config) as server:
        body = {"prompt": words("x", 100), "max_tokens": 100_000 - 200}
        tasks = [
            asyncio.create_task(http.post(server.url + "/v1/completions", json=body))
            for _ in range(2)
        ]
        try:
            for _ in range(200):
                if server.engine.num_running == 1 and server.engine.num_waiting == 1:
                    break
                await asyncio.sleep(0.01)
            async with http.get(server.url + "/get_load") as response:
                (load,) = await response.json()
            assert load["num_reqs"] == 2 and load["num_waiting_reqs"] == 1
            assert load["num_tokens"] >= 200  # KV in use plus the waiting prompt
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def wait_until_idle(server, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine.has_work and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_client_disconnect_frees_the_request(replica, http):
    body = {
        "messages": [{"role": "user", "content": words("w", 500)}],
        "max_tokens": 100_000,
        "stream": True,
    }
    async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
        await response.content.readline()  # the first chunk has arrived
        assert replica.engine.num_running == 1
        assert replica.engine.cache.used_blocks > 0
        response.close()
    await wait_until_idle(replica)
    assert not replica.engine.has_work
    assert replica.engine.cache.used_blocks == 0
    assert replica.engine.counters.requests_aborted == 1


async def test_answered_requests_leave_nothing_for_the_cycle_collector(replica, http):
    # A sequence holds its prompt's tokens. A reference cycle through it (sequence <-> its
    # listener or stream) would keep every answered request's tokens alive until the cycle
    # collector runs, which in a replica making little other garbage may be long. (A client
    # that leaves mid-stream is another matter: aiohttp keeps the failed write's exception,
    # whose traceback holds the engine loop's frames, in a cycle of its own.)
    gc.collect()
    gc.disable()
    try:
        for stream in (True, False):
            body = {
                "messages": [{"role": "user", "content": words("w", 300)}],
                "max_tokens": 40,
                "stream": stream,
            }
            async with http.post(replica.url + "/v1/chat/completions", json=body) as response:
                await response.read()
        await wait_until_idle(replica)
        await asyncio.sleep(0.05)  # the handlers' last lines
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kept = [o for o in gc.garbage if isinstance(o, EngineSequence | TokenListener | SseStream)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert kept == []


async def test_disconnect_while_waiting_without_streaming():
    async with running_replica(ReplicaConfig(time_scale=FAST, max_running=1)) as server:
        body = {"prompt": "x y z", "max_tokens": 100_000}
        async with aiohttp.ClientSession() as session:
            tasks = [
                asyncio.create_task(session.post(server.url + "/v1/completions", json=body))
                for _ in range(2)
            ]
            for _ in range(200):
                if server.engine.num_waiting == 1:
                    break
                await asyncio.sleep(0.01)
            assert server.engine.num_running == 1 and server.engine.num_waiting == 1
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until_idle(server)
        assert not server.engine.has_work
        assert server.engine.cache.used_blocks == 0


async def test_stream_follows_the_model_clock(http):
    # At time scale 20, 8,192 prompt tokens prefill in ~9 ms and each of 30 decode steps takes
    # ~0.43 ms of real time; the stream can be late (a busy test machine) but never early.
    async with running_replica(ReplicaConfig(time_scale=20)) as server:
        body = {"prompt": words("w", 8192), "max_tokens": 31, "stream": True}
        started = time.monotonic()
        arrivals = []
        async with http.post(server.url + "/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
    profile = server.engine.profile
    prefill_s = profile.prefill_ms(8192) / 1000 / 20
    decode_s = 30 * profile.decode_step_ms(1, 8192 + 16) / 1000 / 20
    assert len(arrivals) == 31
    assert arrivals[0] - started >= 0.9 * prefill_s
    # After a late wake-up the replica catches up with the model's schedule, so single
    # gaps may be short; the schedule itself is never run ahead of.
    assert arrivals[-1] - started >= 0.9 * (prefill_s + decode_s)
    assert arrivals[-1] - started < 10 * (prefill_s + decode_s) + 0.5


async def wait_for(condition, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_queue_bound_answers_503():
    config = ReplicaConfig(time_scale=FAST, max_running=1, max_waiting=1)
    async with running_replica(config) as server:
        body = {"prompt": "a b c", "max_tokens": 100_000}
        engine = server.engine
        async with aiohttp.ClientSession() as session:
            tasks = []
            try:
                tasks.append(
                    asyncio.create_task(session.post(server.url + "/v1/completions", json=body))
                )
                await wait_for(lambda: engine.num_running == 1)
                tasks.append(
                    asyncio.create_task(session.post(server.url + "/v1/completions", json=body))
                )
                await wait_for(lambda: engine.num_waiting == 1)
                async with session.post(server.url + "/v1/completions", json=body) as response:
                    assert response.status == 503
                    error = (await response.json())["error"]
                    assert error["code"] == "service_unavailable"
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)


async def test_stop_with_requests_in_flight_is_prompt(http):
    async with running_replica(ReplicaConfig(time_scale=1)) as server:
        body = {"prompt": "a b", "max_tokens": 100_000, "stream": True}
        response = await http.post(server.url + "/v1/completions", json=body)
        await response.content.readline()
        started = time.monotonic()
    assert time.monotonic() - started < 3
    response.close()


async def test_a_client_that_stops_reading_costs_bounded_memory():
    async with running_replica(ReplicaConfig(time_scale=FAST)) as server:
        body = orjson.dumps({"prompt": "a b c", "max_tokens": 120_000, "stream": True})
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # kernel buffers stay small
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            await reader.readline()  # status line: streaming has begun; now stop reading
            # 20,000 chunks are over 3 MB; the replica must not hold them all.
            await wait_for(lambda: server.engine.counters.generation_tokens > 20_000, 10)
            (connection,) = server._runner.server.connections
            assert connection.transport.get_write_buffer_size() < 256 * 1024
        finally:
            writer.close()
        await wait_until_idle(server)
        assert not server.engine.has_work
