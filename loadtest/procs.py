"""Child processes for demos and benchmarks: start, wait until serving, read CPU, stop for sure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import time

import aiohttp

from balancer.process.children import dies_with_parent

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A free port below the ephemeral range, so it cannot collide with outgoing connections."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def start_process(argv: list[str], env: dict[str, str] | None = None, quiet: bool = True) -> subprocess.Popen:
    # A session of its own, so stopping it also stops anything it started.
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL if quiet else None,
        stderr=subprocess.DEVNULL if quiet else None,
        start_new_session=True,
        preexec_fn=dies_with_parent(),  # a starter killed outright still takes it along
    )


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`: to its whole session when it leads one (as
    start_process makes it), else to the process alone."""
    if proc.poll() is not None:
        return

    def signal_it(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            # Not a group leader: signal the process itself.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    signal_it(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        proc.wait()


async def wait_for_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s")
            await asyncio.sleep(0.05)


def read_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process and of every live process below it, from /proc
    (Linux): a router may serve from threads, workers or a child it launched. 0.0 for a
    process already gone."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            total += read_cpu_seconds(current)
        except (FileNotFoundError, ProcessLookupError):
            continue
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    pending.extend(int(child) for child in f.read().split())
            except FileNotFoundError:
                continue
    return total
