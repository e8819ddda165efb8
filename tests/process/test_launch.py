"""`kvlb launch`: the engines' command lines, the generated configuration, and a launcher run
end to end with simulated engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from balancer.config import parse_settings
from balancer.process.cli import main
from balancer.process.engine_args import LaunchError, LaunchSpec, build_launches
from balancer.process.launch import CONFIG_MARKER, settings_data
from loadtest.procs import stop_process, wait_for_http

KVLB = [sys.executable, "-m", "balancer"]


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- command lines ----------------------------------------------------------------------------


def test_vllm_on_gpus_gives_each_replica_its_own_devices_and_ports() -> None:
    launches = build_launches(
        LaunchSpec(engine="vllm", model="/models/qwen", replicas=2, gpus_per_replica=2,
                   python="py", engine_args=("--max-model-len", "4096"))
    )  # fmt: skip
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in launches] == ["0,1", "2,3"]
    assert [e.port for e in launches] == [30000, 30001]
    assert [e.events_port for e in launches] == [31000, 31001]
    assert [e.url for e in launches] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert [e.events_endpoint for e in launches] == ["tcp://127.0.0.1:31000", "tcp://127.0.0.1:31001"]
    argv = launches[1].argv
    assert argv[:3] == ("py", "-m", "vllm.entrypoints.openai.api_server")
    assert _flag(argv, "--model") == "/models/qwen"
    assert _flag(argv, "--port") == "30001"
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--block-size") == "16"
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert json.loads(_flag(argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": "tcp://*:31001", "topic": "kv-events",
    }  # fmt: skip
    assert argv[-2:] == ("--max-model-len", "4096")  # last, so they can override ours
    assert launches[0].env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launches[0].env


def test_vllm_on_cpu_binds_one_core_per_replica() -> None:
    launches = build_launches(LaunchSpec(engine="vllm", model="m", replicas=3, cpu=True, cpu_count=2))
    assert [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in launches] == ["0", "1", "0"]
    for launch in launches:
        assert "CUDA_VISIBLE_DEVICES" not in launch.env
        assert launch.env["VLLM_HOST_IP"] == "127.0.0.1"
        assert launch.env["HF_HUB_OFFLINE"] == "1"
        assert _flag(launch.argv, "--block-size") == "128"
        assert "--tensor-parallel-size" not in launch.argv


def test_sglang_uses_its_own_flag_names() -> None:
    launches = build_launches(
        LaunchSpec(engine="sglang", model="/m", replicas=2, gpus_per_replica=4, block_size=32,
                   base_port=21000, events_base_port=22000)
    )  # fmt: skip
    argv = launches[1].argv
    assert argv[1:3] == ("-m", "sglang.launch_server")
    assert _flag(argv, "--model-path") == "/m"
    assert _flag(argv, "--port") == "21001"
    assert _flag(argv, "--tp-size") == "4"
    assert _flag(argv, "--page-size") == "32"
    assert json.loads(_flag(argv, "--kv-events-config"))["endpoint"] == "tcp://*:22001"
    assert launches[1].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert launches[1].events_endpoint == "tcp://127.0.0.1:22001"


def test_simulated_replica_needs_no_model_and_wildcard_hosts_are_reached_on_loopback() -> None:
    (launch,) = build_launches(LaunchSpec(engine="replica", host="0.0.0.0", base_port=25000))
    assert launch.argv[1:4] == ("-m", "balancer", "replica")
    assert _flag(launch.argv, "--host") == "0.0.0.0"
    assert _flag(launch.argv, "--kv-events-endpoint") == "tcp://*:31000"
    assert "--model" not in launch.argv
    assert launch.url == "http://127.0.0.1:25000"
    assert launch.events_endpoint == "tcp://127.0.0.1:31000"
    (named,) = build_launches(LaunchSpec(engine="replica", model="sim", base_port=25000))
    assert _flag(named.argv, "--model") == "sim"


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (LaunchSpec(engine="sglang", model="m", cpu=True), "--cpu does not work with --engine sglang"),
        (LaunchSpec(engine="vllm", model="m", replicas=4, base_port=30998), "--base-port ports 30998-31001 overlap --events-base-port ports 31000-31003"),
        (LaunchSpec(engine="replica", kvlb_port=30001, replicas=2), "--base-port ports 30000-30001 overlap --port ports 30001"),
        (LaunchSpec(engine="replica", base_port=65535, replicas=2), "outside 1-65535"),
        (LaunchSpec(engine="vllm"), "--model is required with --engine vllm"),
        (LaunchSpec(engine="replica", replicas=0), "--replicas must be >= 1"),
        (LaunchSpec(engine="replica", gpus_per_replica=0), "--gpus-per-replica must be >= 1"),
        (LaunchSpec(engine="vllm", model="m", cpu=True, block_size=16), "multiple of 32"),
        (LaunchSpec(engine="replica", replicas=2, prefill=2), "--prefill must leave at least one decode replica"),
    ],
)  # fmt: skip
def test_impossible_launches_are_refused_with_the_reason(spec: LaunchSpec, problem: str) -> None:
    with pytest.raises(LaunchError) as caught:
        build_launches(spec)
    assert any(problem in p for p in caught.value.problems), caught.value.problems


# --- --print-commands -------------------------------------------------------------------------


def test_print_commands_prints_engines_and_a_valid_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    written = tmp_path / "kvlb.yaml"
    code = main(["launch", "--engine", "vllm", "--model", str(model), "--replicas", "2", "--cpu",
                 "--port", "9000", "--write-config", str(written), "--print-commands",
                 "--", "--dtype", "bfloat16"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    commands, config_text = out.split(CONFIG_MARKER)
    lines = [line for line in commands.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert f"VLLM_CPU_OMP_THREADS_BIND={i % (os.cpu_count() or 1)}" in line
        assert "-m vllm.entrypoints.openai.api_server" in line
        assert f"--port {30000 + i}" in line and line.endswith("--dtype bfloat16")
    data = yaml.safe_load(config_text.split("\n", 1)[1])
    settings = parse_settings(data)
    assert (settings.listen.host, settings.listen.port) == ("127.0.0.1", 9000)
    assert [r.url for r in settings.replicas] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert [r.kv_events_endpoint for r in settings.replicas] == ["tcp://127.0.0.1:31000", "tcp://127.0.0.1:31001"]
    assert settings.policy.name == "predictive"
    assert settings.kv_events.enabled and settings.kv_events.block_size == 128
    assert settings.kv_events.tokenizer == str(model)
    assert yaml.safe_load(written.read_text()) == data


def test_without_tokenizer_json_kvlb_is_left_to_ask_the_engines(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "--engine", "replica", "--model", "sim", "--replicas", "1", "--policy",
                 "least_load", "--print-commands"])  # fmt: skip
    config_text = capsys.readouterr().out.split(CONFIG_MARKER)[1].split("\n", 1)[1]
    assert code == 0
    settings = parse_settings(yaml.safe_load(config_text))
    assert settings.kv_events.tokenizer is None
    assert settings.policy.name == "least_load"


def test_usage_errors_exit_2_and_name_every_problem(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "--engine", "sglang", "--cpu", "--replicas", "1", "--print-commands"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--model is required" in err and "SGLang needs CUDA" in err


# --- running engines --------------------------------------------------------------------------


def _free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _ports(replicas: int) -> tuple[int, int, int]:
    """Engine base port, events base port and kvlb's port, all free, below 32768."""
    for _ in range(200):
        base, events, kvlb = (random.randrange(20000, 32000) for _ in range(3))
        wanted = [kvlb] + [base + i for i in range(replicas)] + [events + i for i in range(replicas)]
        if len(set(wanted)) == len(wanted) and all(_free(p) for p in wanted):
            if all(_free(events + i, "0.0.0.0") for i in range(replicas)):
                return base, events, kvlb
    raise RuntimeError("no free ports")


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _engine_pids(output: str) -> list[int]:
    return sorted({int(p) for p in re.findall(r"engine \d+ \(pid (\d+)\)", output)})


@contextlib.contextmanager
def _launcher(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """`kvlb launch` in the background, its output in `log`; whatever happens, it and every
    engine it reported are gone afterwards."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(KVLB + ["launch", *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        stop_process(proc, grace_s=15.0)
        for pid in _engine_pids(log.read_text()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


async def _ready(kvlb: int, log: Path) -> str:
    """kvlb's URL once the launch serves, or the test fails with what the launcher said."""
    url = f"http://127.0.0.1:{kvlb}"
    try:
        await wait_for_http(url + "/ready", timeout_s=60)
    except TimeoutError:
        pytest.fail(f"kvlb never ready; launcher said:\n{log.read_text()}")
    return url


async def test_launch_serves_through_simulated_engines_and_stops_them_on_sigint(tmp_path: Path) -> None:
    base, events, kvlb = _ports(2)
    log = tmp_path / "launch.out"
    args = ["--engine", "replica", "--model", "sim-model", "--replicas", "2",
            "--base-port", str(base), "--events-base-port", str(events), "--port", str(kvlb),
            "--log-dir", str(tmp_path / "logs"), "--start-timeout-s", "60",
            "--", "--time-scale", "1000"]  # fmt: skip
    with _launcher(args, log) as proc:
        url = await _ready(kvlb, log)
        names = {f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"}
        served = set()
        async with aiohttp.ClientSession() as http:
            for i in range(6):
                body = {"model": "sim-model", "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"question {i}: why is the sky blue?"}]}
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["choices"]
                    served.add(resp.headers["x-kvlb-replica"])
        assert served <= names and served
        pids = _engine_pids(log.read_text())
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        assert (tmp_path / "logs" / "engine-0.log").exists()

        proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, 15)
        output = log.read_text()
        assert code == 0, output
        assert not any(_accepts(p) for p in (kvlb, base, base + 1)), output
        assert not any(_alive(p) for p in pids)


def test_disaggregated_launches_give_each_half_its_engine_flags_and_kvlb_its_roles() -> None:
    sglang = build_launches(LaunchSpec(engine="sglang", model="m", replicas=3, prefill=1))
    assert [launch.role for launch in sglang] == ["prefill", "decode", "decode"]
    assert _flag(sglang[0].argv, "--disaggregation-mode") == "prefill"
    assert _flag(sglang[0].argv, "--disaggregation-bootstrap-port") == str(sglang[0].bootstrap_port)
    assert _flag(sglang[1].argv, "--disaggregation-mode") == "decode" and sglang[1].bootstrap_port is None
    vllm = build_launches(LaunchSpec(engine="vllm", model="m", replicas=2, prefill=1))
    assert all("NixlConnector" in _flag(launch.argv, "--kv-transfer-config") for launch in vllm)
    assert len({launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for launch in vllm}) == 2
    spec = LaunchSpec(engine="replica", replicas=2, prefill=1)
    data = settings_data(spec, build_launches(spec), "predictive", None)
    assert [r.get("role") for r in data["replicas"]] == ["prefill", "decode"]
    assert data["replicas"][0]["bootstrap_port"] and data["disaggregation"] == {"protocol": "sglang"}
    parse_settings(data)  # a configuration kvlb accepts


async def test_launch_serves_a_disaggregated_fleet_of_simulated_engines(tmp_path: Path) -> None:
    base, events, kvlb = _ports(3)
    bootstrap = random.randrange(20000, 32000)
    log = tmp_path / "launch.out"
    args = ["--engine", "replica", "--model", "sim-model", "--replicas", "3", "--prefill", "1",
            "--base-port", str(base), "--events-base-port", str(events), "--port", str(kvlb),
            "--bootstrap-base-port", str(bootstrap), "--log-dir", str(tmp_path / "logs"),
            "--start-timeout-s", "60", "--", "--time-scale", "100"]  # fmt: skip
    with _launcher(args, log) as proc:
        url = await _ready(kvlb, log)
        decode = {f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}"}
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                body = {"model": "sim-model", "max_tokens": 4, "prompt": f"document {i}: " + "words " * 800}
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-kvlb-replica"] in decode
                    assert (await resp.json())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 15) == 0, log.read_text()


def _run_launcher(args: list[str], tmp_path: Path) -> tuple[int, str]:
    log = tmp_path / "launch.out"
    with _launcher(args, log) as proc:
        code = proc.wait(60)
    return code, log.read_text()


def test_an_engine_that_fails_to_start_stops_the_launch_with_its_log(tmp_path: Path) -> None:
    base, events, kvlb = _ports(2)
    code, output = _run_launcher(
        ["--engine", "replica", "--replicas", "2", "--base-port", str(base),
         "--events-base-port", str(events), "--port", str(kvlb), "--", "--no-such-flag"],
        tmp_path,
    )  # fmt: skip
    assert code == 1, output
    assert re.search(r"engine \d \(pid \d+\) exited with status 2 before it was healthy", output), output
    assert "unrecognized arguments: --no-such-flag" in output  # the engine's own words, from its log
    pids = _engine_pids(output)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    assert not any(_accepts(p) for p in (kvlb, base, base + 1))


def test_an_engine_never_healthy_is_given_up_at_the_deadline(tmp_path: Path) -> None:
    base, events, kvlb = _ports(1)
    started = time.monotonic()
    code, output = _run_launcher(
        ["--engine", "replica", "--replicas", "1", "--base-port", str(base),
         "--events-base-port", str(events), "--port", str(kvlb), "--start-timeout-s", "2",
         "--", "--fault-unhealthy"],
        tmp_path,
    )  # fmt: skip
    assert code == 1, output
    assert "did not answer /health within 2 s" in output
    assert "kvlb replica listening on" in output  # its log tail
    assert time.monotonic() - started < 30
    (pid,) = _engine_pids(output)
    assert not _alive(pid) and not _accepts(base)


def test_a_port_already_taken_is_refused_before_anything_starts(tmp_path: Path) -> None:
    base, events, kvlb = _ports(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base))
        taken.listen()
        code, output = _run_launcher(
            ["--engine", "replica", "--replicas", "1", "--base-port", str(base),
             "--events-base-port", str(events), "--port", str(kvlb)],
            tmp_path,
        )  # fmt: skip
    assert code == 2, output
    assert f"cannot use port {base} on 127.0.0.1" in output
    assert _engine_pids(output) == []


async def test_ctrl_c_while_engines_start_stops_them(tmp_path: Path) -> None:
    base, events, kvlb = _ports(1)
    log = tmp_path / "launch.out"
    args = ["--engine", "replica", "--replicas", "1", "--base-port", str(base),
            "--events-base-port", str(events), "--port", str(kvlb), "--", "--fault-unhealthy"]  # fmt: skip
    with _launcher(args, log) as proc:
        deadline = time.monotonic() + 30
        while not _engine_pids(log.read_text()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        (pid,) = _engine_pids(log.read_text())
        proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, 15)
        output = log.read_text()
    assert code == 128 + signal.SIGINT, output
    assert "interrupted while the engines started" in output
    assert not _alive(pid) and not _accepts(kvlb)
