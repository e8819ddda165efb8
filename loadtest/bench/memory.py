"""Memory benchmark: kvlb's resident memory under what should not make it grow.

Starts, on 127.0.0.1, an upstream that answers every request at once with a small chat
completion (bench_proxy's), and kvlb in front of it as its own process, one kvlb per part,
and reads kvlb's VmRSS from /proc against its own start:

  uploads   `--uploads` aborted uploads of the largest body kvlb accepts: headers with
            Content-Length = limits.max_body_bytes, all of the body but `--short-by` bytes,
            then the socket closed; `--upload-concurrency` at a time. Measured right after
            and again `--settle-s` later. Goal: back within 32 MiB of the start.
  prompts   `--requests` non-streamed chat completions with distinct ~4,000-character
            prompts under policy cache_aware, `--concurrency` at a time, sampled every
            `--sample-every`, with the prefix index's size from kvlb's /metrics. Goal: under
            150 MB, and the index within routing.index_max_entries.

    python -m loadtest.bench.memory [--parts uploads prompts] [--uploads 100] [--requests 100000]
        [--concurrency 64] [--index-max-entries N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import yaml

from balancer.config import Limits, RoutingSettings
from balancer.protocol import (
    METRIC_PREFIX_INDEX_BYTES,
    METRIC_PREFIX_INDEX_ENTRIES,
    METRIC_PREFIX_INDEX_FAMILY,
)
from balancer.serving.metrics import INDEX_BYTES_PER_ENTRY
from loadtest.compare.livefleet import kvlb_config
from loadtest.procs import free_port, start_process, stop_process, wait_for_http

MIB = 1 << 20
MODEL = "bench"  # what bench_proxy's upstream lists at /v1/models
UPLOAD_GOAL_BYTES = 32 * MIB
PROMPTS_GOAL_BYTES = 150 * 10**6
PROMPT_CHARS = 4000


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class Kvlb:
    """kvlb serve from a config file, in front of one upstream."""

    def __init__(self, upstream_url: str, policy: str, routing: dict, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"kvlb-{policy}-{self.port}.yaml"
        path.write_text(yaml.safe_dump(kvlb_config(self.port, [upstream_url], policy, model=MODEL, routing=routing)))
        self.proc = start_process([sys.executable, "-m", "balancer", "serve", "--config", str(path)])

    async def __aenter__(self) -> Kvlb:
        await wait_for_http(self.url + "/ready", timeout_s=30)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stop_process(self.proc)

    @property
    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    async def metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(METRIC_PREFIX_INDEX_FAMILY) and " " in line:
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


async def warm_up(url: str, http: aiohttp.ClientSession, n: int = 200) -> None:
    """A few ordinary requests first, so the start counts what serving costs anyway."""
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
    for _ in range(n):
        async with http.post(url + "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"}) as resp:
            await resp.read()


# uploads -----------------------------------------------------------------------------------


async def aborted_upload(port: int, size: int, send: int) -> int:
    """Announce `size` body bytes, send `send` of them, close; returns the bytes kvlb took
    before it cut the connection (`send` when it never did)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % size)
    piece = memoryview(b"x" * MIB)
    sent = 0
    try:
        while sent < send:
            n = min(MIB, send - sent)
            writer.write(piece[:n])
            await writer.drain()
            sent += n
    except (ConnectionError, OSError):
        pass  # kvlb refused the body (an early 413 or 503) and closed
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
    return sent


async def part_uploads(args: argparse.Namespace, upstream_url: str, tmp: Path) -> None:
    size = args.body_bytes or Limits().max_body_bytes
    send = max(0, size - args.short_by)
    async with Kvlb(upstream_url, "least_load", {}, tmp) as kvlb, aiohttp.ClientSession() as http:
        await warm_up(kvlb.url, http)
        start = kvlb.rss
        print(f"\n(a) {args.uploads} aborted uploads: Content-Length {size:,} (limits.max_body_bytes), "
              f"{send:,} bytes sent, then closed; {args.upload_concurrency} at a time")
        remaining = args.uploads
        taken: list[int] = []
        began = time.perf_counter()

        async def uploader() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                taken.append(await aborted_upload(kvlb.port, size, send))

        await asyncio.gather(*(uploader() for _ in range(args.upload_concurrency)))
        elapsed = time.perf_counter() - began
        await wait_for_http(kvlb.url + "/health")  # kvlb has read past the closes
        right_after = kvlb.rss
        await asyncio.sleep(args.settle_s)
        await wait_for_http(kvlb.url + "/health")
        settled = kvlb.rss
        peak = rss_bytes(kvlb.proc.pid, "VmHWM")
        cut = sum(1 for t in taken if t < send)
        print(f"sent {sum(taken) / 1e9:.2f} GB in {elapsed:.1f} s; kvlb cut {cut} of {len(taken)} uploads short")
        print(f"{'':<26} {'VmRSS':>12} {'vs start':>12}")
        print(f"{'start':<26} {mb(start):>12}")
        print(f"{'right after':<26} {mb(right_after):>12} {mb(right_after - start):>12}")
        print(f"{f'{args.settle_s:g} s later':<26} {mb(settled):>12} {mb(settled - start):>12}")
        print(f"{'peak (VmHWM)':<26} {mb(peak):>12} {mb(peak - start):>12}")
        verdict = "met" if settled - start <= UPLOAD_GOAL_BYTES else "NOT met"
        print(f"goal: within {UPLOAD_GOAL_BYTES // MIB} MiB of the start after the uploads: {verdict}")


# prompts -----------------------------------------------------------------------------------


def prompt_source(seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]
    return " ".join(rng.choice(words) for _ in range(3000))


def prompt(i: int, source: str) -> str:
    # The number leads, so prompts differ from their first block: every block is new to the index.
    head = f"request {i:08d}: "
    at = (i * 7919) % (len(source) - PROMPT_CHARS)
    return head + source[at:at + PROMPT_CHARS - len(head)]


async def part_prompts(args: argparse.Namespace, upstream_url: str, tmp: Path) -> None:
    routing = {}
    if args.index_max_entries:
        routing["index_max_entries"] = args.index_max_entries
    budget = args.index_max_entries or RoutingSettings().index_max_entries
    source = prompt_source()
    async with Kvlb(upstream_url, "cache_aware", routing, tmp) as kvlb, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as http:
        await warm_up(kvlb.url, http)
        start = kvlb.rss
        print(f"\n(b) {args.requests:,} chat completions with distinct ~{PROMPT_CHARS:,}-character prompts, "
              f"policy cache_aware, {args.concurrency} at a time; index budget "
              f"routing.index_max_entries = {budget:,}")
        print(f"{'requests':>9} {'VmRSS':>11} {'vs start':>11} {'index entries':>14} {'index bytes':>12} "
              f"{'req/s':>7} {'errors':>7}")
        print(f"{0:>9} {mb(start):>11} {'':>11}")
        url = kvlb.url + "/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        next_i = 0
        errors = 0
        worst = 0
        done = 0
        marks = list(range(args.sample_every, args.requests, args.sample_every)) + [args.requests]
        entries = 0.0

        async def worker(stop_at: int) -> None:
            nonlocal next_i, errors, done
            while next_i < stop_at:
                i = next_i
                next_i += 1
                body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt(i, source)}],
                                     "max_tokens": 8})
                try:
                    async with http.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1
                done += 1

        for mark in marks:
            began = time.perf_counter()
            before = done
            await asyncio.gather(*(worker(mark) for _ in range(args.concurrency)))
            rate = (done - before) / (time.perf_counter() - began)
            rss = kvlb.rss
            worst = max(worst, rss)
            metrics = await kvlb.metrics(http)
            entries = metrics.get(METRIC_PREFIX_INDEX_ENTRIES, 0.0)
            print(f"{mark:>9,} {mb(rss):>11} {mb(rss - start):>11} {entries:>14,.0f} "
                  f"{mb(metrics.get(METRIC_PREFIX_INDEX_BYTES, 0.0)):>12} {rate:>7.0f} {errors:>7}")
        peak = rss_bytes(kvlb.proc.pid, "VmHWM")
        print(f"peak (VmHWM) {mb(peak)}, {mb(peak - start)} over the start; index bytes are kvlb's own "
              f"estimate, entries x {INDEX_BYTES_PER_ENTRY} B")
        under = "met" if worst < PROMPTS_GOAL_BYTES else "NOT met"
        bounded = "met" if entries <= budget else "NOT met"
        print(f"goal: VmRSS under {mb(PROMPTS_GOAL_BYTES)} throughout: {under}; "
              f"index within its budget ({entries:,.0f} <= {budget:,} entries): {bounded}")


async def bench(args: argparse.Namespace) -> None:
    upstream_port = free_port()
    upstream = start_process([sys.executable, "-m", "loadtest.bench.proxy", "--upstream-only", str(upstream_port)])
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    try:
        await wait_for_http(upstream_url + "/v1/models")
        print(f"kvlb resident memory (VmRSS), {os.cpu_count()} CPUs")
        with tempfile.TemporaryDirectory(prefix="kvlb-mem-") as tmp:
            if "uploads" in args.parts:
                await part_uploads(args, upstream_url, Path(tmp))
            if "prompts" in args.parts:
                await part_prompts(args, upstream_url, Path(tmp))
    finally:
        stop_process(upstream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("uploads", "prompts"), default=["uploads", "prompts"])
    parser.add_argument("--uploads", type=int, default=100)
    parser.add_argument("--upload-concurrency", type=int, default=4)
    parser.add_argument("--body-bytes", type=int, help="Content-Length of each upload (default limits.max_body_bytes)")
    parser.add_argument("--short-by", type=int, default=1024, help="body bytes never sent")
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--sample-every", type=int, default=10_000)
    parser.add_argument("--index-max-entries", type=int, help="routing.index_max_entries (default kvlb's)")
    args = parser.parse_args()
    import uvloop

    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
