"""The open-loop load client and `kvlb loadtest`, through real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AsyncExitStack

import pytest
from aiohttp import web

from loadtest.client.runner import TargetError, detect_time_scale, run_load
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.procs import free_port
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import ReplicaProcess, running_replica
from tests.conftest import make_settings, run_balancer, serve_app

SPEC = (
    "shared-prefix,groups=2,prompts_per_group=4,system_tokens=200,question_tokens=20,"
    "output_tokens=16,rate=5"
)
REPLICA_ARGS = ["--time-scale", "10", "--model", "m"]


@pytest.fixture(scope="module")
def replica() -> Iterator[ReplicaProcess]:
    with ReplicaProcess(REPLICA_ARGS) as process:
        yield process


@pytest.fixture
def start_replica() -> Iterator:
    """Starts replicas with extra flags (faults); every one is stopped at the end."""
    started: list[ReplicaProcess] = []

    def start(*extra: str) -> ReplicaProcess:
        process = ReplicaProcess([*REPLICA_ARGS, *extra])
        started.append(process)
        return process.start()

    try:
        yield start
    finally:
        for process in started:
            process.stop()


def requests_at(arrivals: list[float], output_tokens: int = 16):
    """Workload requests with the given arrival times (model seconds)."""
    base = load_workload(SPEC).requests
    return [
        dataclasses.replace(base[i % len(base)], index=i, arrival_s=at, output_tokens=output_tokens)
        for i, at in enumerate(arrivals)
    ]


async def test_shared_prefix_run_against_a_replica(replica):
    scale, note = await detect_time_scale(replica.url)
    assert (scale, note) == (10.0, None)
    workload = load_workload(SPEC)
    started = time.perf_counter()
    records, meta = await run_load(replica.url, workload.requests, model="m", time_scale=scale)
    wall_s = time.perf_counter() - started

    assert meta["time_scale"] == 10.0 and meta["concurrency_cap_hits"] == 0
    assert meta["duration_s"] >= workload.requests[-1].arrival_s
    assert [r.index for r in records] == list(range(8))
    by_group = defaultdict(list)
    for r in records:
        assert r.ok, r
        assert (r.status, r.prompt_tokens, r.output_tokens) == (200, 220, 16)
        assert r.session == workload.requests[r.index].session
        assert 0 < r.ttft_s < r.e2e_s and r.tpot_s is not None
        assert len(r.itl_s) == 15
        assert r.send_s == pytest.approx(workload.requests[r.index].arrival_s, abs=0.1)
        by_group[r.session].append(r)
    for group in by_group.values():
        group.sort(key=lambda r: r.send_s)
        assert group[0].cached_tokens == 0
        assert all(r.cached_tokens >= 192 for r in group[1:]), group
    # Model time is real time times ten. (A replica that fell behind its schedule catches up,
    # so single latencies can beat the profile's floor: no check against that.)
    assert 5 * wall_s < meta["duration_s"] <= 10 * wall_s

    summary = summarize(records, meta["duration_s"], meta=meta)
    assert summary["errors"] == 0
    assert summary["cache_hit_ratio"] == pytest.approx(6 * 192 / (8 * 220), abs=0.05)


async def test_non_streaming_takes_ttft_as_e2e(replica):
    records, _ = await run_load(
        replica.url, requests_at([0.0, 0.1]), time_scale=10, stream=False, progress=False
    )
    for r in records:
        assert r.ok and r.output_tokens == 16 and r.prompt_tokens == 220
        assert r.ttft_s == r.e2e_s > 0 and r.tpot_s is None and r.itl_s == []


async def test_sends_follow_arrivals_when_earlier_requests_are_slow(start_replica):
    slow = start_replica("--fault-hang-s", "0.4")  # each answer starts 0.4 s late
    arrivals = [i * 0.05 for i in range(8)]
    records, meta = await run_load(slow.url, requests_at(arrivals, 4), time_scale=1.0)
    assert meta["concurrency_cap_hits"] == 0
    for r, at in zip(records, arrivals, strict=True):
        assert r.ok and r.ttft_s >= 0.4
        assert at <= r.send_s <= at + 0.03, (r.send_s, at)

    # With the safety valve at 2, requests wait for it and are counted.
    records, meta = await run_load(
        slow.url, requests_at(arrivals, 4), time_scale=1.0, max_concurrency=2, progress=False
    )
    assert meta["concurrency_cap_hits"] >= 5
    assert all(r.ok for r in records)
    assert records[-1].send_s >= 3 * 0.4


async def test_deadline_ends_a_request_that_never_answers(start_replica):
    stuck = start_replica("--fault-hang-s", "30")
    started = time.monotonic()
    records, _ = await run_load(stuck.url, requests_at([0.0, 0.0]), timeout_s=0.3, progress=False)
    assert time.monotonic() - started < 5
    assert [(r.status, r.error) for r in records] == [(0, "timeout after 0.3 s")] * 2


async def test_unreachable_target_fails_fast():
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TargetError, match="unreachable"):
        await run_load(url, requests_at([0.0]), progress=False)
    with pytest.raises(TargetError, match="unreachable"):
        await detect_time_scale(url)
    assert time.monotonic() - started < 5


async def test_error_answers_become_records_not_exceptions(start_replica):
    failing = start_replica("--fault-error-rate", "1.0")
    records, meta = await run_load(failing.url, requests_at([0.0, 0.01, 0.02]), progress=False)
    assert [(r.status, r.error) for r in records] == [
        (503, "injected fault: server unavailable")
    ] * 3  # fmt: skip
    summary = summarize(records, meta["duration_s"])
    assert summary["errors"] == 3
    assert summary["error_kinds"] == {"injected fault: server unavailable": 3}


async def test_streams_cut_midway_are_errors_with_their_first_token(start_replica):
    cutting = start_replica("--fault-cut-after-tokens", "3")
    records, _ = await run_load(cutting.url, requests_at([0.0, 0.01]), progress=False)
    for r in records:
        assert r.status == 200 and not r.ok
        assert r.error in ("connection lost", "stream ended before [DONE]")
        assert r.ttft_s is not None and r.tpot_s is None


async def test_a_target_that_dies_midway_still_ends_the_run(start_replica):
    dying = start_replica("--fault-exit-after-s", "0.5")
    arrivals = [i * 0.25 for i in range(8)]  # 0 .. 1.75 s, time scale 1
    records, meta = await run_load(dying.url, requests_at(arrivals, 2), timeout_s=5, progress=False)
    assert records[0].ok
    assert not records[-1].ok and records[-1].status == 0
    assert records[-1].error.startswith("connect error")
    summary = summarize(records, meta["duration_s"])
    assert 0 < summary["errors"] < 8


async def test_replica_header_through_kvlb():
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(
                running_replica(ReplicaConfig(model="m", time_scale=10))
            )
            for _ in range(2)
        ]
        settings = make_settings(
            [{"url": s.url, "name": f"r{i}"} for i, s in enumerate(servers)],
            policy={"name": "cache_aware"},
        )
        kvlb = await stack.enter_async_context(run_balancer(settings))
        records, meta = await run_load(kvlb.url, load_workload(SPEC).requests, time_scale=10)
    assert all(r.ok for r in records)
    assert {r.replica for r in records} <= {"r0", "r1"}
    assert meta["model"] == "m"
    summary = summarize(records, meta["duration_s"], replicas=["r0", "r1"])
    assert sum(summary["requests_per_replica"].values()) == 8


def loadtest_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "balancer", "loadtest", *args]


async def run_cli(*args: str) -> tuple[int, str, str]:
    # Asynchronous, so that servers on this test's event loop keep answering meanwhile.
    proc = await asyncio.create_subprocess_exec(
        *loadtest_argv(*args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode()


async def test_cli_end_to_end(replica, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = await run_cli(
        "--target", replica.url, "--workload", SPEC, "--out", str(out), "--model", "m",
        "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    assert "TTFT p50" in stdout and "cache hit ratio" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 8 and summary["errors"] == 0
    assert summary["time_scale"] == 10.0 and summary["workload"] == SPEC
    assert summary["target"] == replica.url and summary["model"] == "m"
    assert summary["seed"] == 0 and summary["concurrency_cap_hits"] == 0
    assert summary["cache_hit_ratio"] > 0.5
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 8 and json.loads(lines[0])["index"] == 0


async def test_cli_against_a_target_that_refuses_everything(tmp_path):
    async def refuse(request: web.Request) -> web.Response:
        body = {"error": {"message": "no replica can serve", "type": "overloaded", "code": 503}}
        return web.json_response(body, status=503)

    app = web.Application()
    app.router.add_get("/v1/models", refuse)
    app.router.add_post("/v1/completions", refuse)
    async with serve_app(app) as url:
        code, stdout, stderr = await run_cli(
            "--target", url, "--workload", SPEC, "--out", str(tmp_path), "--no-progress"
        )
    assert code == 1
    assert "get_server_info gave no time scale (HTTP 404)" in stderr
    assert "every request failed (8x no replica can serve)" in stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["errors"] == 8 and summary["time_scale"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "shared-prefix,groups=zero"], "bad workload"),
        (["--workload", "no-such-kind"], "unknown kind"),
        (["--workload", SPEC, "--target", "127.0.0.1:8000"], "--target must be"),
    ],
)
async def test_cli_rejects_bad_input_without_a_traceback(tmp_path, args, message):
    target = ["--target", f"http://127.0.0.1:{free_port()}"]
    code, stdout, stderr = await run_cli(*target, "--out", str(tmp_path), *args)
    assert code == 2
    assert message in stderr and "Traceback" not in stderr
    assert not (tmp_path / "summary.json").exists()


async def test_cli_unreachable_target(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    code, _, stderr = await run_cli("--target", url, "--workload", SPEC, "--out", str(tmp_path))
    assert code == 1
    assert f"target {url} is unreachable" in stderr and "Traceback" not in stderr
