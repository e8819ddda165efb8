"""What sharing routing state through Redis costs, and what `--workers` buys.

    python -m loadtest.bench.sync [--requests 3000]

All on 127.0.0.1: an upstream that answers at once (loadtest.bench.proxy), a private
redis-server on a free port (the one on 6379 when redis-server is not installed), and kvlb
instances as processes with `cache_aware` and a 2,000-token chat prompt (about 130 block
hashes per routing event). Prints:
1. kvlb's CPU per request and latency at concurrency 16, sync off and on (a second synced
   instance reads the events, as in production);
2. the lag from one instance's routing decision to the other's index (kvlb_sync_lag_seconds);
3. how many routing events per second one Redis takes in and hands out (one writer
   pipelining batches, one reader);
4. requests/s of `--workers 2` against `--workers 1` (sync on) at concurrency 64.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import orjson
import redis.asyncio as aioredis
import yaml

from balancer.protocol import METRIC_SYNC_FAMILY, METRIC_SYNC_LAG
from loadtest.bench.proxy import measure, pct
from loadtest.procs import free_port, read_cpu_seconds, start_process, stop_process, wait_for_http

PROMPT_WORDS = 2000
BODY = orjson.dumps({
    "model": "bench", "max_tokens": 8,
    "messages": [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(PROMPT_WORDS))}],
})


def start_redis() -> tuple[subprocess.Popen | None, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        return None, "redis://127.0.0.1:6379/0"
    port = free_port()
    proc = start_process([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    return proc, f"redis://127.0.0.1:{port}/0"


async def wait_redis(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        for _ in range(200):
            try:
                await client.ping()
                return
            except (OSError, aioredis.ConnectionError):
                await asyncio.sleep(0.05)
        raise RuntimeError(f"redis at {url} did not answer")
    finally:
        await client.aclose()


class Instances:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.tmp = tempfile.TemporaryDirectory(prefix="kvlb-bench-sync-")
        self.procs: list[subprocess.Popen] = []

    async def start(self, port: int, sync: dict | None, workers: int = 1, policy: str = "cache_aware") -> subprocess.Popen:
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "replicas": [{"url": self.upstream, "name": "upstream", "model": "bench"}],
            "policy": {"name": policy},
            "limits": {"max_in_flight": 100000},
        }
        if sync is not None:
            config["sync"] = sync
        path = Path(self.tmp.name) / f"kvlb-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "balancer", "serve", "--config", str(path), "--workers", str(workers)]
        proc = start_process(argv, dict(os.environ))
        self.procs.append(proc)
        await wait_for_http(f"http://127.0.0.1:{port}/ready")
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        self.procs = []


async def metric_lines(url: str, prefix: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)}


def lag_quantile(lines: dict[str, float], q: float) -> str:
    buckets = sorted(
        (float("inf") if "+Inf" in key else float(key.split('le="')[1].rstrip('"}')), count)
        for key, count in lines.items() if key.startswith(f"{METRIC_SYNC_LAG}_bucket")
    )
    total = buckets[-1][1] if buckets else 0
    for bound, count in buckets:
        if total and count >= q * total:
            return f"<= {bound * 1000:g} ms"
    return "-"


async def per_request(url: str, proc: subprocess.Popen, requests: int, concurrency: int) -> tuple[float, float, float]:
    before = read_cpu_seconds(proc.pid)
    wall, latencies = await measure(url + "/v1/chat/completions", concurrency, requests, BODY)
    cpu = (read_cpu_seconds(proc.pid) - before) / (requests + concurrency * 2)
    return requests / wall, pct(latencies, 0.5), cpu


async def redis_capacity(url: str, seconds: float = 3.0, per_entry: int = 50, pipeline: int = 20) -> tuple[float, float]:
    """Routing events/s one writer gets into a stream and one reader out of it, batched as
    kvlb batches them (`per_entry` events of 130 hashes in one stream entry)."""
    key = f"bench-{uuid.uuid4().hex[:6]}:routes"
    entry = {
        b"e": orjson.dumps([("replica-0", 0.0, 130)] * per_entry),
        b"h": os.urandom(8 * 130 * per_entry),
    }
    client = aioredis.Redis.from_url(url)
    written = 0
    end = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < end:
        pipe = client.pipeline(transaction=False)
        for _ in range(pipeline):
            pipe.xadd(key, entry, maxlen=10_000, approximate=True)
        await pipe.execute()
        written += pipeline
    write_rate = written * per_entry / (time.perf_counter() - started)
    read, last = 0, "0-0"
    started = time.perf_counter()
    while True:
        answer = await client.xread({key: last}, count=100)
        if not answer:
            break
        entries = answer[0][1]
        read += len(entries)
        last = entries[-1][0]
    read_rate = read * per_entry / (time.perf_counter() - started)
    await client.delete(key)
    await client.aclose()
    return write_rate, read_rate


async def bench(args: argparse.Namespace) -> None:
    upstream_port = free_port()
    upstream = start_process([sys.executable, "-m", "loadtest.bench.proxy", "--upstream-only", str(upstream_port)])
    redis_proc, redis_url = start_redis()
    instances = Instances(f"http://127.0.0.1:{upstream_port}")
    try:
        await wait_for_http(f"http://127.0.0.1:{upstream_port}/v1/models")
        await wait_redis(redis_url)
        sync = {"redis_url": redis_url, "key_prefix": f"bench-{uuid.uuid4().hex[:6]}"}
        print(f"kvlb, cache_aware, {PROMPT_WORDS}-word chat prompt, {args.requests} requests at concurrency 16, "
              f"{os.cpu_count()} CPUs\n")

        port = free_port()
        proc = await instances.start(port, None)
        off = await per_request(f"http://127.0.0.1:{port}", proc, args.requests, 16)
        instances.stop()

        port = free_port()
        proc = await instances.start(port, sync)
        alone = await per_request(f"http://127.0.0.1:{port}", proc, args.requests, 16)
        instances.stop()

        a_port, b_port = free_port(), free_port()
        a = await instances.start(a_port, sync)
        await instances.start(b_port, sync)
        on = await per_request(f"http://127.0.0.1:{a_port}", a, args.requests, 16)
        await asyncio.sleep(0.5)
        lines = await metric_lines(f"http://127.0.0.1:{b_port}", METRIC_SYNC_FAMILY)
        instances.stop()
        print(f"{'sync':<26} {'requests/s':>11} {'p50':>9} {'kvlb CPU/request':>17}")
        for name, (rps, p50, cpu) in (("off", off), ("on, no peer", alone), ("on, a peer reading events", on)):
            print(f"{name:<26} {rps:>11.0f} {p50 * 1000:>7.2f}ms {cpu * 1e6:>14.0f} µs")
        count = lines.get(f"{METRIC_SYNC_LAG}_count", 0.0)
        mean = lines.get(f"{METRIC_SYNC_LAG}_sum", 0.0) / count if count else 0.0
        print(f"\nsync cost per request: {(alone[2] - off[2]) * 1e6:+.0f} µs of CPU and {(alone[1] - off[1]) * 1000:+.2f} ms "
              f"of p50 alone; {(on[2] - off[2]) * 1e6:+.0f} µs and {(on[1] - off[1]) * 1000:+.2f} ms with a peer on the same cores")
        print(f"lag, decision to the peer's index: {int(count)} events, mean {mean * 1000:.1f} ms, "
              f"p50 {lag_quantile(lines, 0.5)}, p99 {lag_quantile(lines, 0.99)}")

        write_rate, read_rate = await redis_capacity(redis_url)
        print(f"\none Redis, events of 130 hashes batched 50 to an entry: {write_rate:,.0f} events/s written by one "
              f"writer, {read_rate:,.0f} events/s read back by one reader")

        # Two rounds, alternating, since the client shares the two cores with what it measures.
        rates: dict[int, list[float]] = {1: [], 2: []}
        for _round in range(2):
            for workers in (1, 2):
                port = free_port()
                await instances.start(port, sync, workers=workers)
                wall, _ = await measure(f"http://127.0.0.1:{port}/v1/chat/completions", 64, args.requests, BODY)
                rates[workers].append(args.requests / wall)
                instances.stop()
        print(f"\n{'workers':>8} {'requests/s at concurrency 64, two runs':>40}")
        for workers, values in rates.items():
            print(f"{workers:>8} {', '.join(f'{v:,.0f}' for v in values):>40}")
    finally:
        instances.stop()
        stop_process(upstream)
        if redis_proc is not None:
            stop_process(redis_proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    import uvloop

    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
