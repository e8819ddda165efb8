"""Replica failures, with real processes: kvlb and simulated GPU replicas as child processes.

- A replica killed (SIGKILL) in the middle of a load: requests that had not started
  answering fail over to the survivors and succeed; streams it had started end with an SSE
  `data: {"error": ...}` event, never looking complete.
- A replica that hangs before its first byte is bypassed once `timeouts.first_byte_s` passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import yaml

from loadtest.procs import free_port, start_process, stop_process, wait_for_http
from loadtest.replica.launch import ReplicaProcess

REPLICA_ARGS = ["--time-scale", "20", "--model", "m"]
# Slow enough that streams on the victim are still mid-way when it is killed: a stream
# lasts about a second, so the replica cannot have sent it all before a busy test client
# has read its first quarter.
SLOW_REPLICA = ["--time-scale", "5"]
REQUESTS = 200
CONCURRENCY = 20
MAX_TOKENS = 512
# The kill comes once this many requests have finished and streams are running on the victim.
KILL_AFTER_DONE = 70


@contextlib.contextmanager
def replicas(*extra_args: Sequence[str]) -> Iterator[list[ReplicaProcess]]:
    """One simulated replica per argument list, started side by side, always stopped."""
    procs = [ReplicaProcess([*REPLICA_ARGS, *extra]) for extra in extra_args]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(ReplicaProcess.start, procs))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@contextlib.asynccontextmanager
async def kvlb(args: Sequence[str], config: Path | None = None) -> AsyncIterator[tuple[str, subprocess.Popen]]:
    """`kvlb serve` as a child process on a free port; yields its URL once /ready says 200.

    With `config` (instead of --replica arguments), the port is written into the file."""
    for _ in range(3):  # a port found free may be taken before kvlb binds it
        port = free_port()
        argv = [sys.executable, "-m", "balancer", "serve", *args]
        if config is None:
            argv += ["--port", str(port)]
        else:
            argv += ["--config", str(config)]
            data = yaml.safe_load(config.read_text())
            data.setdefault("listen", {})["port"] = port
            config.write_text(yaml.safe_dump(data))
        # Not quiet: kvlb's log lands in pytest's captured output, shown on failure.
        proc = start_process(argv, quiet=False)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    await wait_for_http(url + "/ready", timeout_s=0.5)
                    break
                except TimeoutError:
                    continue
            else:
                if proc.poll() is not None:
                    continue  # exited at start (port taken): try another port
                raise TimeoutError("kvlb did not become ready within 20 s")
            yield url, proc
            assert proc.poll() is None, f"kvlb exited with status {proc.returncode}"
            return
        finally:
            stop_process(proc)
    raise RuntimeError("kvlb exited at start 3 times (its stderr is in the captured output)")


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample over the series whose labels include `labels`."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def chat_body(i: int, stream: bool) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"request number {i}: tell me about load balancing"}],
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }


# --- a replica killed under load ---------------------------------------------------------------


@dataclass
class Result:
    i: int
    stream: bool
    status: int = 0
    replica: str | None = None  # x-kvlb-replica: who answered
    events: list[bytes] = field(default_factory=list)
    done: bool = False  # saw data: [DONE] (streams) or a whole JSON completion
    error_event: dict | None = None
    exception: str | None = None
    finished: bool = False

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if b'"choices":[{' in e)


async def run_one(http: aiohttp.ClientSession, url: str, result: Result) -> None:
    try:
        async with http.post(url + "/v1/chat/completions", json=chat_body(result.i, result.stream)) as resp:
            result.status = resp.status
            result.replica = resp.headers.get("x-kvlb-replica")
            if not result.stream or resp.status != 200:
                body = await resp.read()
                if resp.status == 200:
                    completion = orjson.loads(body)
                    result.done = completion["choices"][0]["finish_reason"] is not None
                return
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    result.done = True
                    continue
                result.events.append(data)
                payload = orjson.loads(data)
                if "error" in payload:
                    result.error_event = payload
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.exception = repr(exc)
    finally:
        result.finished = True


async def test_killed_replica_fails_over_and_breaks_its_streams_visibly() -> None:
    with replicas(SLOW_REPLICA, SLOW_REPLICA, SLOW_REPLICA) as fleet:
        victim = fleet[0]
        victim_name = victim.url.removeprefix("http://")
        args = [a for r in fleet for a in ("--replica", r.url)] + ["--policy", "least_load"]
        async with kvlb(args) as (url, _proc):
            timeout = aiohttp.ClientTimeout(total=30)
            connector = aiohttp.TCPConnector(limit=CONCURRENCY)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
                results = [Result(i, stream=i % 2 == 0) for i in range(REQUESTS)]
                gate = asyncio.Semaphore(CONCURRENCY)

                async def limited(result: Result) -> None:
                    async with gate:
                        await run_one(http, url, result)

                started = time.monotonic()
                tasks = [asyncio.create_task(limited(r)) for r in results]
                killed_at = None
                try:
                    # Kill mid-way, while streams are running on the victim.
                    deadline = time.monotonic() + 20
                    while killed_at is None:
                        done = sum(r.finished for r in results)
                        streaming_on_victim = [
                            r for r in results
                            if r.stream and r.replica == victim_name and not r.finished
                            and 0 < len(r.events) < MAX_TOKENS // 4
                        ]
                        if done >= KILL_AFTER_DONE and len(streaming_on_victim) >= 2:
                            os.kill(victim.pid, signal.SIGKILL)
                            killed_at = time.monotonic()
                            finished_before_kill = done
                        assert time.monotonic() < deadline, \
                            f"no moment to kill: {done} done, {len(streaming_on_victim)} streaming on the victim"
                        assert done < REQUESTS, "the load ended before the kill; make requests longer"
                        await asyncio.sleep(0.002)
                    await asyncio.wait_for(asyncio.gather(*tasks), 30)
                finally:
                    for task in tasks:
                        task.cancel()
                elapsed = time.monotonic() - started
                assert victim.process is not None and victim.process.wait(5) == -signal.SIGKILL

                broken = [r for r in results if r.stream and r.replica == victim_name and r.error_event]
                others = [r for r in results if r not in broken]
                # Streams the victim had started: an error event at the end, never [DONE].
                for r in broken:
                    assert not r.done, f"request {r.i}: a broken stream also ended with [DONE]"
                    assert orjson.loads(r.events[-1]) == r.error_event, f"request {r.i}: events after the error"
                    error = r.error_event["error"]
                    assert isinstance(error["message"], str) and error["message"] and "code" in error, error
                    assert r.exception is None, f"request {r.i}: {r.exception}"
                # Everything else, including what was on its way to the victim: complete and 200.
                failures = [r for r in others if r.status != 200 or not r.done or r.exception or r.error_event]
                assert not failures, f"{len(failures)} client-visible failures: {failures[:3]}"
                for r in others:
                    if r.stream:
                        assert r.tokens == MAX_TOKENS, f"request {r.i}: {r.tokens} of {MAX_TOKENS} tokens"
                assert len(broken) >= 1, "no stream was running on the victim when it died"
                assert len(broken) + len(others) == REQUESTS
                # The dead replica left the rotation: requests sent to it moved on (connect
                # errors), or its broken streams ejected it before any was; and kvlb counts
                # nothing in flight any more.
                moved_on = await metric(http, url, "kvlb_upstream_attempts_total",
                                        replica=victim_name, outcome="connect_error")
                ejected = await metric(http, url, "kvlb_replica_ejections_total", replica=victim_name)
                assert moved_on >= 1 or ejected >= 1, (moved_on, ejected)
                assert await metric(http, url, "kvlb_upstream_attempts_total",
                                    replica=victim_name, outcome="broken_stream") == len(broken)
                assert await metric(http, url, "kvlb_in_flight_requests") == 0
                print(f"{REQUESTS} requests in {elapsed:.1f} s; killed after {finished_before_kill} "
                      f"finished; {len(broken)} streams broken visibly, {len(others)} succeeded")
                assert elapsed < 30


# --- a replica that hangs --------------------------------------------------------------------

FIRST_BYTE_S = 0.5


async def test_hanging_replica_is_bypassed_after_the_first_byte_timeout(tmp_path: Path) -> None:
    with replicas(["--fault-hang-s", "60"], []) as (hung, good):
        config = tmp_path / "balancer.yaml"
        config.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": 8000},
            "replicas": [{"url": hung.url, "name": "hung"}, {"url": good.url, "name": "good"}],
            # Round robin ranks the hung replica first for every other request.
            "policy": {"name": "round_robin"},
            "timeouts": {"first_byte_s": FIRST_BYTE_S, "total_s": 20},
            "health": {"interval_s": 0.5},
        }))
        async with kvlb([], config) as (url, _proc):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
                # The replica hangs generation only: it stays healthy and in the rankings.
                async with http.get(hung.url + "/admin/fault") as resp:
                    assert (await resp.json())["hang_s"] == 60
                latencies = []
                for i in range(6):
                    stream = i % 2 == 1
                    started = time.monotonic()
                    async with http.post(url + "/v1/chat/completions", json=chat_body(i, stream)) as resp:
                        body = await resp.read()
                        assert resp.status == 200, body
                        assert resp.headers["x-kvlb-replica"] == "good"
                    latencies.append(time.monotonic() - started)
                    if stream:
                        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
                        assert b'"error"' not in body
                    else:
                        assert orjson.loads(body)["choices"][0]["message"]["content"]
                timeouts = await metric(http, url, "kvlb_upstream_attempts_total", replica="hung", outcome="timeout")
                slow = [t for t in latencies if t >= FIRST_BYTE_S]
                # Requests that tried the hung replica first waited out first_byte_s there (and
                # no longer), then the good replica answered them.
                assert timeouts >= 1, latencies
                assert len(slow) >= timeouts, (latencies, timeouts)
                assert max(latencies) < FIRST_BYTE_S + 2.5, latencies
                assert await metric(http, url, "kvlb_upstream_attempts_total", replica="hung", outcome="ok") == 0
