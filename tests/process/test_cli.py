"""The `kvlb` command as a user runs it: real processes on 127.0.0.1, stopped by signal."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp

from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port, start_process, stop_process, wait_for_http
from tests.conftest import serve_app
from tests.upstreams import Seen, slow_sse_app

KVLB = [sys.executable, "-m", "balancer"]


async def test_serve_quick_start_forwards_and_stops_on_sigterm() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        b = await stack.enter_async_context(serve_app(make_stub_app("b")))
        port = free_port()
        proc = start_process(KVLB + ["serve", "--replica", a, "--replica", b, "--policy", "round_robin",
                                     "--port", str(port)], quiet=False)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_for_http(url + "/ready")
            served = set()
            async with aiohttp.ClientSession() as http:
                for _ in range(4):
                    async with http.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}) as resp:
                        assert resp.status == 200
                        served.add(resp.headers["x-kvlb-replica"])
            assert len(served) == 2
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
        finally:
            stop_process(proc)


async def test_serve_with_config_file(tmp_path: Path) -> None:
    async with serve_app(make_stub_app("only", model="m1")) as replica:
        port = free_port()
        config = tmp_path / "kvlb.yaml"
        config.write_text(f"listen: {{port: {port}}}\nreplicas:\n  - url: {replica}\n    name: only\n"
                          "logging: {format: json}\n")
        proc = start_process(KVLB + ["serve", "--config", str(config)], quiet=False)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_for_http(url + "/ready")
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/v1/models") as resp:
                    assert [m["id"] for m in (await resp.json())["data"]] == ["m1"]
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                    assert 'kvlb_in_flight_requests{replica="only"} 0.0' in text
        finally:
            stop_process(proc)


def test_serve_without_replicas_or_with_a_bad_config_explains(tmp_path: Path) -> None:
    run = subprocess.run(KVLB + ["serve"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "--replica" in run.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas:\n  - url: ftp://nope\ntimeouts: {connect_s: fast}\n")
    run = subprocess.run(KVLB + ["serve", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert "replicas[0].url" in run.stderr and "timeouts.connect_s" in run.stderr


def test_demo_runs_and_cleans_up() -> None:
    run = subprocess.run([sys.executable, "-m", "loadtest.demo"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # Its 16 requests are four prompts, each kept where it is cached: which replicas the
    # four land on follows the live timing, so at least two, not always all four.
    served = next(line for line in run.stdout.splitlines() if line.startswith("requests per replica:"))
    counts = [int(n) for n in re.findall(r"replica-\d=(\d+)", served)]
    assert len(counts) >= 2 and sum(counts) == 16, served
    assert "chat, streamed" in run.stdout and "completion, streamed" in run.stdout
    assert "stopped every process" in run.stdout


async def test_access_log_lines_name_route_status_and_replica(tmp_path: Path) -> None:
    async with serve_app(make_stub_app("only")) as replica:
        port = free_port()
        config = tmp_path / "kvlb.yaml"
        config.write_text(f"listen: {{port: {port}}}\nreplicas:\n  - url: {replica}\n    name: only\n"
                          "logging: {access_log: true, format: json}\n")
        log_file = tmp_path / "kvlb.log"
        with open(log_file, "w") as sink:
            proc = subprocess.Popen(KVLB + ["serve", "--config", str(config)], stderr=sink, stdout=sink,
                                    start_new_session=True)
            try:
                url = f"http://127.0.0.1:{port}"
                await wait_for_http(url + "/ready")
                async with aiohttp.ClientSession() as http:
                    async with http.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "x"},
                                         headers={"x-request-id": "trace-me"}) as resp:
                        assert resp.status == 200
            finally:
                stop_process(proc)
        lines = [json.loads(line) for line in log_file.read_text().splitlines() if line.startswith("{")]
        access = [entry for entry in lines if entry["logger"] == "kvlb.access"]
        assert len(access) == 1
        assert "POST /v1/completions 200 replica=only" in access[0]["message"]
        assert "id=trace-me" in access[0]["message"]
        # The same facts as keys of their own, for log pipelines.
        assert (access[0]["request_id"], access[0]["replica"], access[0]["status"]) == ("trace-me", "only", 200)
        assert access[0]["model"] == "stub-model" and access[0]["output_tokens"] == 8


async def test_sigterm_lets_streams_in_flight_finish_then_exits_0() -> None:
    seen = Seen()
    async with serve_app(slow_sse_app(seen, chunks=6, gap_s=0.15)) as replica:
        port = free_port()
        proc = start_process(KVLB + ["serve", "--replica", replica, "--port", str(port)], quiet=False)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_for_http(url + "/ready")
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions",
                                     json={"model": "m", "prompt": "p", "stream": True}) as resp:
                    first = await resp.content.readline()
                    assert first.startswith(b"data: {")
                    proc.send_signal(signal.SIGTERM)
                    rest = await resp.read()
                assert rest.count(b"data: {") == 5 and rest.endswith(b"data: [DONE]\n\n")
            assert proc.wait(10) == 0
        finally:
            stop_process(proc)


def test_stop_process_stops_a_child_without_its_own_session() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_process(proc, grace_s=2)
    assert proc.poll() is not None


async def test_sighup_applies_a_good_file_and_keeps_running_on_a_bad_one(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(serve_app(make_stub_app("a")))
        b = await stack.enter_async_context(serve_app(make_stub_app("b")))
        port = free_port()
        config = tmp_path / "kvlb.yaml"
        head = f"listen: {{port: {port}}}\npolicy: {{name: round_robin}}\nreplicas:\n"
        config.write_text(head + f"  - {{url: '{a}', name: a}}\n")
        proc = start_process(KVLB + ["serve", "--config", str(config)], quiet=False)
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_for_http(url + "/ready")

            async def served() -> set[str]:
                names = set()
                async with aiohttp.ClientSession() as http:
                    for _ in range(4):
                        async with http.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}) as r:
                            assert r.status == 200
                            names.add(r.headers["x-kvlb-replica"])
                return names

            assert await served() == {"a"}
            config.write_text(head + f"  - {{url: '{a}', name: a}}\n  - {{url: '{b}', name: b}}\n")
            proc.send_signal(signal.SIGHUP)
            for _ in range(50):
                if await served() == {"a", "b"}:
                    break
                await asyncio.sleep(0.1)
            assert await served() == {"a", "b"}
            config.write_text(head + "  - {url: 'not a url'}\n")
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.3)
            assert await served() == {"a", "b"}  # the bad file changed nothing
            assert proc.poll() is None
        finally:
            stop_process(proc)


def test_version_is_the_installed_packages() -> None:
    import importlib.metadata
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "balancer", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.strip() == f"kvlb {importlib.metadata.version('kvlb')}"
