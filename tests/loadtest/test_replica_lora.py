"""LoRA adapters in the simulated replica: the engine's GPU slots and adapter-keyed cache, and
vLLM's and SGLang's ways of naming, listing, loading and unloading adapters over HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.replica.cli import config_from_args, main
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.engine import Engine, EngineConfig, EngineSequence, Status
from loadtest.replica.launch import running_replica
from loadtest.replica.lora import LoraModule, LoraRegistry, parse_lora_module
from loadtest.replica.profiles import get_profile
from loadtest.replica.tokens import (
    ROOT_HASH,
    adapter_root,
    block_hashes,
    chain_hash,
    output_text,
    token_ids,
)
from tests.loadtest.test_replica_cli import parse
from tests.loadtest.test_replica_kv_events import replica_with_events, stored

H100 = get_profile("llama-3.1-8b-h100")
FAST = 1000.0
BASE = "kvlb-sim-llama-3.1-8b"
LOAD_S = 0.02


def words(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def engine(**overrides) -> Engine:
    overrides.setdefault("max_loras", 2)
    overrides.setdefault("lora_load_s", LOAD_S)
    return Engine(EngineConfig(profile=H100, **overrides))


def drain(eng: Engine, decode_runs: bool = False) -> float:
    """Step until idle; returns the time it ends."""
    now = 0.0
    while (start := eng.next_step_time()) is not None:
        now = max(now, start)
        run = eng.decode_run() if decode_runs else 0
        if run > 1:
            done, end = eng.decode_run_times(now, run)
            eng.advance_decode(now, done, end)
        else:
            assert eng.step(now) is not None
        now = eng.busy_until
    return now


def serve(
    eng: Engine, tokens: list[str], adapter: str | None, max_tokens: int = 2
) -> EngineSequence:
    """One request on an idle engine, run to its end."""
    seq = eng.submit(tokens, max_tokens, eng.busy_until, adapter=adapter)
    drain(eng)
    assert seq.finished
    return seq


# -- the engine --------------------------------------------------------------------------


def test_adapter_root_keys_hashes_by_adapter():
    assert adapter_root(None) == ROOT_HASH
    assert adapter_root("a") == adapter_root("a") != adapter_root("b")
    assert ROOT_HASH not in (adapter_root("a"), adapter_root("b"))
    assert 0 <= adapter_root("a") < 2**64
    # Not the hash of any one-token block, which a word spelled like the name would be.
    assert adapter_root("a") != chain_hash(["a"], ROOT_HASH)
    tokens = words("w", 32)
    assert block_hashes(tokens, 16, parent=adapter_root("a"))[0] == chain_hash(
        tokens[:16], adapter_root("a")
    )


def test_same_prompt_under_another_adapter_or_the_base_hits_nothing():
    eng = engine()
    prompt = words("p", 64)
    cached = [
        serve(eng, list(prompt), adapter).cached_tokens for adapter in ("a", "a", "b", None, "a")
    ]
    # 63 of 64 tokens may be found, in whole blocks: 48.
    assert cached == [0, 48, 0, 0, 48]
    assert eng.counters.prefix_hits_tokens == 96


def test_generated_blocks_chain_from_the_adapter_root():
    for decode_runs in (False, True):
        eng = engine()
        seq = eng.submit(words("p", 5), 60, 0.0, adapter="a")
        drain(eng, decode_runs)
        assert len(seq.hashes) == 4
        assert seq.hashes == block_hashes(seq.tokens, 16, parent=adapter_root("a"))


def test_an_adapter_needs_lora_on():
    with pytest.raises(ValueError, match="LoRA is off"):
        Engine(EngineConfig(profile=H100)).submit(words("p", 4), 1, 0.0, adapter="a")
    with pytest.raises(ValueError, match="empty"):
        engine().submit(words("p", 4), 1, 0.0, adapter="")
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(profile=H100, max_loras=-1)


def test_slots_hold_max_loras_and_evict_the_least_recently_used():
    eng = engine(max_loras=2)
    serve(eng, words("p", 20), "a")
    serve(eng, words("q", 20), "b")
    assert eng.resident_adapters() == ["a", "b"]
    assert (eng.counters.lora_loads, eng.counters.lora_evictions) == (2, 0)
    serve(eng, words("r", 20), "a")  # resident: no load, and now the most recently used
    assert eng.resident_adapters() == ["b", "a"]
    assert eng.counters.lora_loads == 2
    serve(eng, words("s", 20), None)  # the base model takes no slot
    serve(eng, words("t", 20), "c")
    assert eng.resident_adapters() == ["a", "c"]
    assert (eng.counters.lora_loads, eng.counters.lora_evictions) == (3, 1)
    assert eng.adapter_users() == {"a": 0, "c": 0}


def test_busy_slots_pass_a_request_over_and_admit_those_behind():
    eng = engine(max_loras=1)
    long = eng.submit(words("long", 40), 30, 0.0, adapter="a")
    now = eng.step(0.0).end
    blocked = eng.submit(words("b", 40), 3, now, adapter="b")
    same = eng.submit(words("a", 40), 3, now, adapter="a")
    base = eng.submit(words("base", 40), 3, now)
    iteration = eng.step(now)
    # "b" cannot have the only slot while "a" runs: it keeps its place at the head, and
    # those behind it that need no other slot go ahead.
    assert blocked.status is Status.WAITING
    assert same.status is Status.RUNNING and base.status is Status.RUNNING
    assert eng.waiting() == [blocked]
    assert iteration.lora_loads == 0
    assert eng.adapter_users() == {"a": 2}
    later = eng.submit(words("later", 40), 3, iteration.end)
    drain(eng)
    assert all(seq.finished for seq in (long, blocked, same, base, later))
    # "b" loaded once the last sequence on "a" had ended, evicting it.
    assert blocked.first_token_time > max(long.finish_time, same.finish_time)
    assert later.first_token_time < blocked.first_token_time
    assert eng.resident_adapters() == ["b"]
    assert (eng.counters.lora_loads, eng.counters.lora_evictions) == (2, 1)


def test_a_load_adds_its_time_to_the_iteration():
    with_adapter, without = engine(), engine()
    first = with_adapter.submit(words("p", 300), 2, 0.0, adapter="a")
    plain = without.submit(words("p", 300), 2, 0.0)
    loading, cold = with_adapter.step(0.0), without.step(0.0)
    assert (loading.lora_loads, cold.lora_loads) == (1, 0)
    assert loading.duration == pytest.approx(cold.duration + LOAD_S)
    drain(with_adapter)
    drain(without)
    assert first.first_token_time - first.arrival_time == pytest.approx(
        plain.first_token_time - plain.arrival_time + LOAD_S
    )
    # Resident now: the next request on it loads nothing.
    start = with_adapter.busy_until
    with_adapter.submit(words("q", 300), 2, start, adapter="a")
    without.submit(words("q", 300), 2, start)
    again = with_adapter.step(start)
    assert again.lora_loads == 0
    assert again.duration == pytest.approx(without.step(start).duration)


def test_abort_and_preemption_release_the_slot():
    eng = engine(max_loras=1)
    running = eng.submit(words("a", 40), 100, 0.0, adapter="a")
    now = eng.step(0.0).end
    waiting = eng.submit(words("b", 40), 2, now, adapter="b")
    now = eng.step(now).end
    assert waiting.status is Status.WAITING
    eng.abort(running)
    assert eng.adapter_users() == {"a": 0}
    assert eng.step(now).lora_loads == 1
    assert waiting.status is Status.RUNNING and eng.resident_adapters() == ["b"]
    assert eng.counters.lora_evictions == 1

    # Two sequences whose outputs outgrow the cache together: one is preempted.
    eng = engine(kv_capacity_tokens=16 * 40)
    seqs = [eng.submit(words(name, 200), 200, 0.0, adapter=name) for name in ("a", "b")]
    now = 0.0
    while not eng.counters.preemptions:
        now = eng.step(now).end
    victims = [seq for seq in seqs if seq.status is Status.WAITING]
    assert len(victims) == 1
    assert eng.adapter_users()[victims[0].adapter] == 0
    drain(eng)
    assert [seq.num_generated for seq in seqs] == [200, 200]
    assert eng.adapter_users() == {"a": 0, "b": 0}


class AdapterRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str | None]] = []

    def blocks_stored(self, hashes, parent, tokens, adapter=None) -> None:
        self.calls.append((len(hashes), adapter))

    def block_removed(self, block_hash) -> None:
        pass

    def all_cleared(self) -> None:
        pass


class BaseOnlyRecorder(AdapterRecorder):
    def blocks_stored(self, hashes, parent, tokens) -> None:  # knows nothing of adapters
        self.calls.append((len(hashes), None))


def test_the_cache_listener_hears_the_adapter_only_when_there_is_one():
    eng = engine()
    recorder = AdapterRecorder()
    eng.set_cache_listener(recorder)
    serve(eng, words("p", 33), "a")
    serve(eng, words("p", 33), None)
    assert recorder.calls == [(2, "a"), (2, None)]
    eng = engine()
    eng.set_cache_listener(BaseOnlyRecorder())
    serve(eng, words("p", 33), None)  # a listener of the old shape still works


def test_registry_numbers_adapters_in_registration_order():
    registry = LoraRegistry(BASE, [LoraModule("a", "/a"), LoraModule("b", "/b")])
    assert [(adapter.name, adapter.lora_id) for adapter in registry] == [("a", 1), ("b", 2)]
    assert registry.register("c", "/c").lora_id == 3
    registry.unregister("c")
    assert registry.register("d", "/d").lora_id == 4  # a number is never given twice
    assert registry.lora_id("c") == 3 and registry.lora_id("nope") is None
    with pytest.raises(ValueError, match="already been loaded"):
        registry.register("a", "/elsewhere")
    with pytest.raises(ValueError, match="base model"):
        registry.register(BASE, "/x")
    with pytest.raises(KeyError):
        registry.unregister("c")
    assert registry.adapter_for(None) is None
    assert registry.adapter_for("") is None
    assert registry.adapter_for(BASE) is None
    assert registry.adapter_for("a") == "a"
    assert registry.adapter_for(f"{BASE}:b") == "b"
    for unknown in ("nope", f"{BASE}:nope", "other:a"):
        with pytest.raises(LookupError):
            registry.adapter_for(unknown)


# -- the command line --------------------------------------------------------------------


def test_lora_flags_build_the_config(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    config = config_from_args(parse(["replica", "--port", "0"]))
    assert not config.enable_lora and config.lora_modules == ()
    assert config.engine_config().max_loras == 0
    module_json = '{"name": "b", "path": "/p/b", "base_model_name": "m"}'
    args = parse(
        ["replica", "--port", "0", "--enable-lora", "--lora-modules", "a=/p/a", module_json,
         "--max-loras", "3", "--lora-load-ms", "5"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.enable_lora and not config.allow_runtime_lora_updating
    assert config.lora_modules == (LoraModule("a", "/p/a"), LoraModule("b", "/p/b", "m"))
    engine_config = config.engine_config()
    assert (engine_config.max_loras, engine_config.lora_load_s) == (3, 0.005)
    assert parse_lora_module("x=/path=with=equals") == LoraModule("x", "/path=with=equals")
    flag = parse(["replica", "--port", "0", "--enable-lora", "--allow-runtime-lora-updating"])
    assert config_from_args(flag).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert config_from_args(parse(["replica", "--port", "0"])).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not config_from_args(parse(["replica", "--port", "0"])).allow_runtime_lora_updating


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/p/a"], "--enable-lora"),
        (["--enable-lora", "--lora-modules", "no-path"], "NAME=PATH"),
        (["--enable-lora", "--lora-modules", "=/p"], "name is empty"),
        (["--enable-lora", "--lora-modules", "a="], "path is empty"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "path is empty"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/p", "x": 1}'], "unknown"),
        (["--enable-lora", "--lora-modules", "[1]"], "JSON must be an object"),
        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "twice"),
        (["--enable-lora", "--lora-modules", f"{BASE}=/p"], "served model"),
        (["--enable-lora", "--max-loras", "0"], "max_loras"),
        (["--enable-lora", "--lora-load-ms", "-1"], "lora_load_ms"),
        (["--enable-lora", "--lora-register-ms", "-1"], "lora_register_ms"),
    ],
)
def test_bad_lora_flags_exit_with_status_2(capsys, argv, message):
    assert main(parse(["replica", "--port", "0", *argv])) == 2
    assert message in capsys.readouterr().err


# -- over HTTP ---------------------------------------------------------------------------


MODULES = (LoraModule("a", "/adapters/a"), LoraModule("b", "/adapters/b", "some-base"))


def lora_config(**overrides) -> ReplicaConfig:
    settings = {"time_scale": FAST, "enable_lora": True, "lora_modules": MODULES}
    return ReplicaConfig(**(settings | overrides))


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict | str]:
    async with http.post(url, json=body) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


async def engine_stats(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/admin/stats") as response:
        return (await response.json())["engine"]


async def test_models_list_the_adapters_under_their_parent(http):
    async with running_replica(lora_config()) as server:
        async with http.get(server.url + "/v1/models") as response:
            cards = (await response.json())["data"]
    base, a, b = cards
    assert (base["id"], base["parent"], base["root"]) == (BASE, None, BASE)
    assert base["max_model_len"] == server.engine.max_sequence_tokens
    created = a.pop("created")
    assert isinstance(created, int) and abs(created - server.started_at) <= 1
    assert a == {
        "id": "a",
        "object": "model",
        "owned_by": "kvlb",
        "root": "/adapters/a",
        "parent": BASE,
        "max_model_len": None,
    }
    assert (b["id"], b["root"], b["parent"]) == ("b", "/adapters/b", "some-base")


async def test_requests_name_their_adapter_as_vllm_and_sglang_do(http):
    async with running_replica(lora_config(max_loras=2)) as server:
        sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            completion = await sdk.chat.completions.create(
                model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        finally:
            await sdk.close()
        assert completion.choices[0].message.content == output_text(3)
        assert completion.model == "a"
        assert (await engine_stats(http, server.url))["resident_adapters"] == ["a"]

        status, answer = await post(
            http,
            server.url + "/v1/completions",
            {"model": f"{BASE}:b", "prompt": "x y", "max_tokens": 2},
        )
        assert status == 200 and answer["model"] == f"{BASE}:b"
        assert (await engine_stats(http, server.url))["resident_adapters"] == ["a", "b"]

        body = {"text": "one two", "lora_path": "a", "sampling_params": {"max_new_tokens": 2}}
        status, answer = await post(http, server.url + "/generate", body)
        assert status == 200 and answer["text"] == output_text(2)
        stats = await engine_stats(http, server.url)
        assert stats["resident_adapters"] == ["b", "a"]
        assert (stats["lora_loads"], stats["lora_evictions"]) == (2, 0)

        for model in (BASE, None):  # the base model, by name or by default
            body = {"prompt": "x y", "max_tokens": 1} | ({"model": model} if model else {})
            status, _ = await post(http, server.url + "/v1/completions", body)
            assert status == 200
        assert (await engine_stats(http, server.url))["lora_loads"] == 2

        body = {"text": "one", "lora_path": "nope"}
        status, answer = await post(http, server.url + "/generate", body)
        assert status == 400 and answer["error"]["param"] == "lora_path"
        status, answer = await post(
            http, server.url + "/generate", {"text": "one", "lora_path": ["a"]}
        )
        assert status == 400 and answer["error"]["param"] == "lora_path"


async def test_unknown_model_is_404_only_with_lora(http):
    async with running_replica(lora_config()) as server:
        for route, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/generate", {"text": "hi"}),
        ):
            status, answer = await post(http, server.url + route, {"model": "nope"} | body)
            assert status == 404
            assert answer == {
                "error": {
                    "message": "The model `nope` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
        assert server.engine.counters.prefix_queries_tokens == 0  # nothing reached the engine
    async with running_replica(ReplicaConfig(time_scale=FAST)) as server:
        status, answer = await post(
            http, server.url + "/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 1}
        )
        assert status == 200 and answer["model"] == "a"
        assert (await engine_stats(http, server.url))["resident_adapters"] == []


@pytest.mark.parametrize("prefix", ["/v1", ""], ids=["vllm", "sglang"])
async def test_adapters_load_and_unload_at_run_time(http, prefix):
    async with running_replica(lora_config(allow_runtime_lora_updating=True)) as server:
        load, unload = (
            server.url + prefix + "/load_lora_adapter",
            server.url + prefix + "/unload_lora_adapter",
        )
        status, text = await post(http, load, {"lora_name": "c", "lora_path": "/adapters/c"})
        assert (status, text) == (200, "Success: LoRA adapter 'c' added successfully.")
        assert server.engine.resident_adapters() == []  # registered, not in a slot yet
        async with http.get(server.url + "/v1/models") as response:
            cards = (await response.json())["data"]
        assert [(card["id"], card["root"]) for card in cards[1:]] == [
            ("a", "/adapters/a"), ("b", "/adapters/b"), ("c", "/adapters/c")
        ]  # fmt: skip
        status, _ = await post(
            http, server.url + "/v1/completions", {"model": "c", "prompt": "hi", "max_tokens": 1}
        )
        assert status == 200

        for body in (
            {"lora_name": "c", "lora_path": "/again"},
            {"lora_name": "d"},
            {"lora_path": "/d"},
        ):
            status, answer = await post(http, load, body)
            assert status == 400 and answer["error"]["type"] == "InvalidUserInput", body
        status, answer = await post(http, load, {"lora_name": "a", "lora_path": "/x"})
        assert answer["error"]["message"] == "The lora adapter 'a' has already been loaded."

        status, text = await post(http, unload, {"lora_name": "c"})
        assert (status, text) == (200, "Success: LoRA adapter 'c' removed successfully.")
        assert server.engine.resident_adapters() == []  # its idle slot freed
        status, answer = await post(http, unload, {"lora_name": "c"})
        assert status == 404 and answer["error"]["type"] == "NotFoundError"
        status, answer = await post(http, unload, {})
        assert status == 400
        status, answer = await post(
            http, server.url + "/v1/completions", {"model": "c", "prompt": "hi", "max_tokens": 1}
        )
        assert status == 404 and answer["error"]["message"] == "The model `c` does not exist."


async def test_load_routes_are_absent_without_runtime_updating(http):
    for config in (lora_config(), ReplicaConfig(time_scale=FAST, allow_runtime_lora_updating=True)):
        async with running_replica(config) as server:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                         "/load_lora_adapter", "/unload_lora_adapter"):  # fmt: skip
                async with http.post(
                    server.url + path, json={"lora_name": "c", "lora_path": "/c"}
                ) as response:
                    assert response.status == 404, path


async def test_cache_is_keyed_by_adapter_and_loads_are_counted(http):
    async with running_replica(lora_config(max_loras=1)) as server:
        prompt = " ".join(words("sys", 1024))
        cached = []
        for model in ("a", "a", "b", "a"):
            status, answer = await post(
                http,
                server.url + "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": 2},
            )
            assert status == 200
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 1008, 0, 1008]  # 1,023 tokens may be found, in whole blocks
        stats = await engine_stats(http, server.url)
        # One slot: "a" loaded, "b" evicted it, "a" evicted "b".
        assert (stats["lora_loads"], stats["lora_evictions"]) == (3, 2)
        assert stats["resident_adapters"] == ["a"]
        async with http.get(server.url + "/get_server_info") as response:
            assert (await response.json())["max_loras"] == 1


async def test_metrics_report_lora_requests_info(http):
    async with running_replica(lora_config(max_loras=2)) as server:
        async with http.get(server.url + "/metrics") as response:
            families = {
                family.name: family
                for family in text_string_to_metric_families(await response.text())
            }
        (sample,) = families["vllm:lora_requests_info"].samples
        assert sample.labels == {
            "max_lora": "2",
            "waiting_lora_adapters": "",
            "running_lora_adapters": "",
        }
        assert sample.value > 0  # the scrape's time, as vLLM sets it
        # While requests run and wait, the names of their adapters. The engine is stepped
        # here, not by the server's loop, which only runs for requests it was given.
        eng = server.engine
        running = [eng.submit(words(name, 10), 100, 0.0, adapter=name) for name in ("b", "a")]
        eng.step(0.0)
        waiting = eng.submit(words("c", 10), 10, eng.busy_until, adapter="c")
        try:
            async with http.get(server.url + "/metrics") as response:
                families = {
                    f.name: f for f in text_string_to_metric_families(await response.text())
                }
            (sample,) = families["vllm:lora_requests_info"].samples
            assert sample.labels["running_lora_adapters"] == "b,a"
            assert sample.labels["waiting_lora_adapters"] == "c"
        finally:
            for seq in (*running, waiting):
                eng.abort(seq)
    async with running_replica(ReplicaConfig(time_scale=FAST)) as server:
        async with http.get(server.url + "/metrics") as response:
            assert "vllm:lora_requests_info" not in await response.text()


# -- KV events ---------------------------------------------------------------------------


async def test_stored_events_name_the_adapter(http):
    async with replica_with_events(enable_lora=True, lora_modules=MODULES) as (server, sub):
        prompt = " ".join(words("p", 32))
        ids = token_ids(prompt.split())
        hashes = {}
        for model in ("b", None):
            body = {"prompt": prompt, "max_tokens": 1} | ({"model": model} if model else {})
            status, _ = await post(http, server.url + "/v1/completions", body)
            assert status == 200
            (event,) = (await sub.message()).events
            hashes[model] = event["block_hashes"]
            expected = stored(hashes[model], None, ids)
            if model is not None:
                expected |= {"lora_id": 2, "lora_name": "b"}
            assert event == expected
        assert hashes["b"] == block_hashes(prompt.split(), 16, parent=adapter_root("b"))
        assert hashes[None] == block_hashes(prompt.split(), 16)
        await sub.assert_quiet()


async def test_stored_events_in_arrays_put_the_name_after_the_medium(http):
    async with replica_with_events(encoding="array", enable_lora=True, lora_modules=MODULES) as (
        server,
        sub,
    ):
        prompt = " ".join(words("p", 16))
        for model, tail in (("a", [1, "GPU", "a"]), (BASE, [None, "GPU"])):
            status, _ = await post(
                http,
                server.url + "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": 1},
            )
            assert status == 200
            _, _, payload = await sub.socket.recv_multipart()
            _, (event,), _ = msgpack.unpackb(payload, raw=False)
            assert event[0] == "BlockStored" and event[2:5] == [None, token_ids(prompt.split()), 16]
            assert event[5:] == tail


async def test_loads_past_max_loaded_loras_are_refused_as_sglang_refuses_them(http):
    config = lora_config(allow_runtime_lora_updating=True, max_loaded_loras=3)
    async with running_replica(config) as server:
        async with http.get(server.url + "/get_server_info") as response:
            assert (await response.json())["max_loaded_loras"] == 3
        load, unload = server.url + "/load_lora_adapter", server.url + "/unload_lora_adapter"
        assert (await post(http, load, {"lora_name": "c", "lora_path": "/adapters/c"}))[0] == 200
        message = (
            "Cannot load LoRA adapter d at path /adapters/d. Maximum number of loaded LoRA "
            "adapters is 3. Please unload some LoRA adapters before loading new ones."
        )
        status, answer = await post(http, load, {"lora_name": "d", "lora_path": "/adapters/d"})
        assert (status, answer) == (
            400, {"success": False, "error_message": message, "loaded_adapters": None}
        )  # fmt: skip
        status, answer = await post(
            http, server.url + "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "/adapters/d"}
        )
        assert status == 400 and answer["error"]["message"] == message
        assert (await post(http, unload, {"lora_name": "a"}))[0] == 200
        assert (await post(http, load, {"lora_name": "d", "lora_path": "/adapters/d"}))[0] == 200
        async with http.get(server.url + "/v1/models") as response:
            cards = (await response.json())["data"]
        assert [card["id"] for card in cards[1:]] == ["b", "c", "d"]


def test_max_loaded_loras_holds_the_slots_and_the_startup_adapters():
    with pytest.raises(ValueError, match="at least max_loras"):
        lora_config(max_loras=4, max_loaded_loras=3)
    with pytest.raises(ValueError, match="should not exceed max_loaded_loras"):
        lora_config(max_loaded_loras=1)  # two adapters at start


async def test_a_load_reads_the_adapter_before_it_serves_and_loads_run_one_at_a_time(http):
    # 400 model ms at time scale 4: 100 ms of real time per load, two loads one after the other.
    config = lora_config(allow_runtime_lora_updating=True, time_scale=4.0, lora_register_ms=400.0)
    async with running_replica(config) as server:
        load = server.url + "/v1/load_lora_adapter"
        body = {"model": "c", "prompt": "hello", "max_tokens": 1}
        loop = asyncio.get_running_loop()
        started = loop.time()
        loads = [asyncio.ensure_future(post(http, load, {"lora_name": name, "lora_path": f"/adapters/{name}"}))
                 for name in ("c", "d")]
        await asyncio.sleep(0.03)
        # Still reading: not served yet.
        assert (await post(http, server.url + "/v1/completions", body))[0] == 404
        assert [status for status, _ in await asyncio.gather(*loads)] == [200, 200]
        assert loop.time() - started >= 0.19
        assert (await post(http, server.url + "/v1/completions", body))[0] == 200
        # Loading one it holds is refused, as vLLM refuses it.
        assert (await post(http, load, {"lora_name": "c", "lora_path": "/adapters/c"}))[0] == 400
