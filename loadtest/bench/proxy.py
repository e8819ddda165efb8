"""Proxy overhead benchmark: kvlb versus going straight to the upstream.

Starts, all on 127.0.0.1: an upstream that answers every request at once (a tiny raw HTTP
server, so its own cost stays out of the way), and kvlb in front of it as its own process.
Then, at each concurrency, sends the same small non-streaming chat request directly and
through kvlb, and prints requests/s, latency p50/p99 for both, the added latency, and kvlb's
own CPU time per request read from /proc.

    python -m loadtest.bench.proxy [--requests 3000] [--concurrency 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import aiohttp
import orjson

from loadtest.procs import free_port, read_cpu_seconds, start_process, stop_process, wait_for_http
from loadtest.replica.tokens import output_text

BODY = (b'{"model": "bench", "messages": [{"role": "user", "content": "Say hello."}], '
        b'"max_tokens": 8, "temperature": 0}')
ANSWER = (b'{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"bench","choices":'
          b'[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],'
          b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}')
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)
MODELS = b'{"object":"list","data":[{"id":"bench","object":"model","created":0,"owned_by":"bench"}]}'
MODELS_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                   + str(len(MODELS)).encode() + b"\r\n\r\n" + MODELS)


def next_request(buffer: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(lower-cased head, body, the rest) of the first whole request in `buffer`, or None
    while it is incomplete: just enough HTTP for the benchmarks' upstreams."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = buffer[:head_end].lower()
    length = 0
    at = head.find(b"content-length:")
    if at >= 0:
        eol = head.find(b"\r\n", at)
        length = int(head[at + 15:eol if eol > 0 else None])
    end = head_end + 4 + length
    if len(buffer) < end:
        return None
    return head, buffer[head_end + 4:end], buffer[end:]


class InstantUpstream(asyncio.Protocol):
    """Keep-alive HTTP/1.1 that answers any request with one fixed body, as fast as it can."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := next_request(self.buffer)) is not None:
            head, _, self.buffer = request
            self.transport.write(MODELS_RESPONSE if b"/v1/models" in head[:64] else RESPONSE)


async def run_upstream(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(InstantUpstream, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


async def measure(url: str, concurrency: int, total: int, body: bytes = BODY,
                  extra_headers: dict[str, str] | None = None) -> tuple[float, list[float]]:
    """Closed loop: `concurrency` workers send `total` requests; returns wall time and latencies."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    async with aiohttp.ClientSession(connector=connector) as http:
        remaining = total

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                async with http.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                latencies.append(time.perf_counter() - start)

        # Warm the connection pools on both sides before timing.
        for _ in range(concurrency * 2):
            async with http.post(url, data=body, headers=headers) as resp:
                await resp.read()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, latencies


def body_with_prompt(words: int) -> bytes:
    """BODY with a system prompt of `words` words: the simulated replica's own filler text."""
    if words <= 0:
        return BODY
    return orjson.dumps({"model": "bench", "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "system", "content": output_text(words)}, {"role": "user", "content": "Say hello."}]})


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(args: argparse.Namespace) -> None:
    upstream_port, kvlb_port = free_port(), free_port()
    env = dict(os.environ)
    upstream = start_process([sys.executable, "-m", "loadtest.bench.proxy", "--upstream-only", str(upstream_port)], env)
    kvlb = start_process(
        [sys.executable, "-m", "balancer", "serve", "--replica", f"http://127.0.0.1:{upstream_port}",
         "--port", str(kvlb_port), "--policy", args.policy], env)
    try:
        await wait_for_http(f"http://127.0.0.1:{upstream_port}/v1/models")
        await wait_for_http(f"http://127.0.0.1:{kvlb_port}/ready")
        direct = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        via = f"http://127.0.0.1:{kvlb_port}/v1/chat/completions"
        body = body_with_prompt(args.prompt_words)
        shape = f"with a {args.prompt_words}-word system prompt" if args.prompt_words > 0 else "small"
        print(f"kvlb proxy overhead, {args.requests} {shape} non-streaming chat requests per run, "
              f"policy {args.policy}, {os.cpu_count()} CPUs")
        print(f"{'conc':>5} {'direct rps':>11} {'kvlb rps':>9} {'direct p50':>11} {'kvlb p50':>9} "
              f"{'added p50':>10} {'direct p99':>11} {'kvlb p99':>9} {'kvlb CPU/req':>13} {'upstream CPU/req':>17}")
        for concurrency in args.concurrency:
            up_before = read_cpu_seconds(upstream.pid)
            d_wall, d_lat = await measure(direct, concurrency, args.requests, body)
            up_per_req = (read_cpu_seconds(upstream.pid) - up_before) / (args.requests + concurrency * 2)
            cpu_before = read_cpu_seconds(kvlb.pid)
            v_wall, v_lat = await measure(via, concurrency, args.requests, body)
            cpu_per_req = (read_cpu_seconds(kvlb.pid) - cpu_before) / (args.requests + concurrency * 2)
            print(f"{concurrency:>5} {args.requests / d_wall:>11.0f} {args.requests / v_wall:>9.0f} "
                  f"{pct(d_lat, .5) * 1e3:>9.3f}ms {pct(v_lat, .5) * 1e3:>7.3f}ms "
                  f"{(pct(v_lat, .5) - pct(d_lat, .5)) * 1e3:>8.3f}ms "
                  f"{pct(d_lat, .99) * 1e3:>9.3f}ms {pct(v_lat, .99) * 1e3:>7.3f}ms "
                  f"{cpu_per_req * 1e6:>10.0f} µs {up_per_req * 1e6:>14.0f} µs")
        print("floors: added p50 at concurrency 1 <= 0.500 ms; kvlb CPU <= 250 µs per request")
        print("upstream CPU/req: the instant upstream's own CPU per direct request (one read, one write):")
        print("what the simplest asyncio server costs on this machine; kvlb is a server and a client.")
    finally:
        stop_process(kvlb)
        stop_process(upstream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--policy", default="least_load")
    parser.add_argument("--prompt-words", type=int, default=0,
                        help="a system prompt of this many words before the question (the same every "
                             "request): what routing a long prompt adds, since a cache-aware policy "
                             "hashes and indexes it")
    parser.add_argument("--upstream-only", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import uvloop

    if args.upstream_only:
        uvloop.run(run_upstream(args.upstream_only))
        return
    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
