"""What the simulator itself costs: `python -m loadtest.replica.bench`.

Starts one replica process at `--time-scale 1`, keeps `--streams` concurrent streaming chat
requests going (2,048-token prompts, 128 output tokens, no shared prefixes) and reports:

- lag: how late each engine iteration's tokens left, against the model's schedule, and any
  model time the replica had to give up because it fell behind (slip). A replica that keeps
  up has sub-millisecond mean lag and zero slip.
- CPU: the replica process's user+system CPU time (from /proc) per request, beside the CPU
  that the bare wake-and-write pattern of the same run costs on this machine with no replica
  code at all (in nested virtual machines that floor alone can be most of the budget), and
  what that pattern costs on the replica's event loop (uvloop timers and transports), which
  any asyncio server pays before its own code runs.
- the latencies the client saw, beside the model's own numbers.

The budgets (lag and slip near zero, under 5 ms of CPU per request) are checked and the exit
status is 1 if one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import socket
import statistics
import sys
import time
from collections.abc import Iterator

import aiohttp
import orjson
import uvloop

from loadtest.replica.launch import ReplicaProcess
from loadtest.replica.profiles import get_profile

CPU_BUDGET_S = 0.005
MEAN_LAG_BUDGET_S = 0.002


async def _one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, expected_tokens: int
) -> tuple[float, float]:
    started = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                tokens += 1
                if first is None:
                    first = time.perf_counter()
    if tokens != expected_tokens or first is None:
        raise RuntimeError(f"expected {expected_tokens} token chunks, got {tokens}")
    return first - started, time.perf_counter() - started


def _prompt_body(request_number: int, prompt_tokens: int, output_tokens: int) -> bytes:
    # The template adds a role marker and the assistant marker: 2 tokens.
    words = " ".join(f"r{request_number}w{i}" for i in range(prompt_tokens - 2))
    return orjson.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": output_tokens,
            "stream": True,
        }
    )


async def _run_load(url: str, streams: int, requests: int, prompt: int, output: int, offset: int):
    bodies = [_prompt_body(offset + n, prompt, output) for n in range(requests)]
    queue = list(reversed(bodies))
    results: list[tuple[float, float]] = []
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            while queue:
                results.append(await _one_request(session, url, queue.pop(), output))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return results


@contextlib.contextmanager
def _sockets_read_elsewhere(streams: int, total_bytes: int) -> Iterator[list[socket.socket]]:
    """`streams` connected TCP sockets whose far ends another process reads, together, until
    `total_bytes` have arrived."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    reader = os.fork()
    if reader == 0:  # pragma: no cover - child
        try:
            connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
            poller = select.epoll()
            for connection in connections:
                poller.register(connection.fileno(), select.EPOLLIN)
            received = 0
            while received < total_bytes:
                for fd, _ in poller.poll(5.0):
                    received += len(os.read(fd, 1 << 16))
        finally:
            os._exit(0)
    peers = [listener.accept()[0] for _ in range(streams)]
    for peer in peers:
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield peers
    finally:
        os.waitpid(reader, 0)
        for peer in peers:
            peer.close()
        listener.close()


def io_floor_cpu_seconds(
    streams: int, period_s: float, chunk_bytes: int, rounds: int = 300
) -> float:
    """CPU per iteration of the bare I/O pattern the replica must perform: wake up every
    `period_s`, write one `chunk_bytes` chunk to each of `streams` sockets read by another
    process. In some virtual machines a timer wake or a write that wakes the reader costs tens
    of microseconds, which no replica code can avoid; this separates the machine's cost from
    the replica's own.
    """
    with _sockets_read_elsewhere(streams, streams * rounds * chunk_bytes) as peers:
        chunk = b"x" * chunk_bytes
        cpu_started = time.process_time()
        origin = time.monotonic()
        for round_number in range(rounds):
            for peer in peers:
                peer.sendall(chunk)
            time.sleep(max(0.0, origin + (round_number + 1) * period_s - time.monotonic()))
        cpu = time.process_time() - cpu_started
    return cpu / rounds


def event_loop_floor_cpu_seconds(
    streams: int, period_s: float, chunk_bytes: int, rounds: int = 300
) -> float:
    """The same pattern as `io_floor_cpu_seconds`, driven as the replica drives it: on uvloop,
    one loop timer per iteration, one transport write per stream. What any asyncio server on
    this loop pays for it before any HTTP or engine code runs (the timer alone is a libuv
    handle made and closed each iteration, and a second pass of the loop to close it)."""
    with _sockets_read_elsewhere(streams, streams * rounds * chunk_bytes) as peers:

        async def run() -> float:
            loop = asyncio.get_running_loop()
            transports = []
            for peer in peers:
                # The transport takes the file descriptor; the socket object stays ours.
                transport, _ = await loop.connect_accepted_socket(
                    asyncio.Protocol, socket.socket(fileno=os.dup(peer.fileno()))
                )
                transports.append(transport)
            chunk = b"x" * chunk_bytes
            finished = loop.create_future()
            origin = loop.time()
            count = 0

            def tick() -> None:
                nonlocal count
                for transport in transports:
                    transport.write(chunk)
                count += 1
                if count == rounds:
                    finished.set_result(None)
                else:
                    loop.call_at(origin + count * period_s, tick)

            cpu_started = time.process_time()
            loop.call_soon(tick)
            await finished
            cpu = time.process_time() - cpu_started
            for transport in transports:
                transport.close()
            await asyncio.sleep(0)  # let the loop close them
            return cpu

        cpu = uvloop.run(run())
    return cpu / rounds


async def _get_json(url: str, path: str, method: str = "GET"):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path) as response:
            response.raise_for_status()
            return await response.json(content_type=None) if method == "GET" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.replica.bench", description=__doc__)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    profile = get_profile(args.profile)

    with ReplicaProcess(["--profile", args.profile, "--time-scale", str(args.time_scale)]) as rep:
        # Warm up imports, code paths and connections before measuring.
        asyncio.run(_run_load(rep.url, args.streams, args.streams, 64, 8, offset=10**6))
        asyncio.run(_get_json(rep.url, "/admin/stats/reset", "POST"))
        cpu_before = rep.cpu_seconds()
        wall_started = time.perf_counter()
        results = asyncio.run(
            _run_load(
                rep.url, args.streams, args.requests, args.prompt_tokens, args.output_tokens, 0
            )
        )
        wall = time.perf_counter() - wall_started
        cpu = rep.cpu_seconds() - cpu_before
        stats = asyncio.run(_get_json(rep.url, "/admin/stats"))

    lag = stats["lag_seconds"]
    cpu_per_request = cpu / len(results)
    iterations = stats["iterations"]
    period = stats["busy_model_seconds"] / args.time_scale / max(iterations, 1)
    chunk_bytes = 250  # about one chat.completion.chunk with its HTTP chunk framing
    floor_cpu = io_floor_cpu_seconds(args.streams, period, chunk_bytes)
    floor_per_request = floor_cpu * iterations / len(results)
    loop_floor_cpu = event_loop_floor_cpu_seconds(args.streams, period, chunk_bytes)
    loop_floor_per_request = loop_floor_cpu * iterations / len(results)
    ttfts = sorted(r[0] for r in results)
    scale = args.time_scale
    print(
        f"replica bench: {args.streams} concurrent streams, {len(results)} requests of "
        f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
        f"profile {args.profile}, time scale {scale:g}"
    )
    print(
        f"  wall {wall:.2f} s; engine busy {stats['busy_model_seconds'] / scale:.2f} s "
        f"(real) over {stats['iterations']} iterations"
    )
    print(
        f"  iteration lag vs model schedule: mean {lag['mean'] * 1000:.3f} ms, "
        f"p50 {lag['p50'] * 1000:.3f} ms, p99 {lag['p99'] * 1000:.3f} ms, "
        f"max {lag['max'] * 1000:.3f} ms; slipped model time "
        f"{stats['slipped_model_seconds'] * 1000:.1f} ms"
    )
    print(
        f"  replica CPU {cpu:.3f} s = {cpu_per_request * 1000:.2f} ms per request "
        f"({cpu / wall * 100:.0f} % of one core)"
    )
    print(
        f"  machine floor: waking every {period * 1000:.1f} ms and writing {args.streams} "
        f"x {chunk_bytes} B to sockets, and nothing else, costs {floor_cpu * 1e6:.0f} us of CPU "
        f"per iteration here = {floor_per_request * 1000:.2f} ms per request; the replica's "
        f"own cost above that: {(cpu_per_request - floor_per_request) * 1000:.2f} ms per request"
    )
    print(
        f"  event-loop floor: the same on uvloop (a loop timer per iteration, transport "
        f"writes), still without HTTP or engine: {loop_floor_cpu * 1e6:.0f} us per iteration "
        f"= {loop_floor_per_request * 1000:.2f} ms per request; the replica above that: "
        f"{(cpu_per_request - loop_floor_per_request) * 1000:.2f} ms per request"
    )
    inter_token = statistics.mean((r[1] - r[0]) / (args.output_tokens - 1) for r in results)
    decode_step_ms = profile.decode_step_ms(args.streams, args.streams * (args.prompt_tokens + 64))
    print(
        f"  client: TTFT p50 {statistics.median(ttfts) * 1000:.1f} ms, p99 "
        f"{ttfts[int(0.99 * (len(ttfts) - 1))] * 1000:.1f} ms; mean time between tokens "
        f"{inter_token * 1000:.2f} ms (model decode step at batch {args.streams}: "
        f"{decode_step_ms / scale:.2f} ms; iterations that also prefill take longer)"
    )
    ok = (
        cpu_per_request < CPU_BUDGET_S
        and lag["mean"] < MEAN_LAG_BUDGET_S
        and stats["slipped_model_seconds"] == 0
    )
    print(
        f"  {'PASS' if ok else 'FAIL'}: CPU per request < {CPU_BUDGET_S * 1000:g} ms, "
        f"mean lag < {MEAN_LAG_BUDGET_S * 1000:g} ms, no slip"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
