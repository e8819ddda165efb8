"""Streaming relay benchmark: what a router spends per relayed SSE chunk.

Starts, all on 127.0.0.1: an upstream that answers a streamed chat completion with CHUNKS
small `chat.completion.chunk` events INTERVAL apart (chunked transfer encoding, then
`data: [DONE]`), kvlb in front of it (`kvlb serve`, policy least_load unless `--policy`
says; the default `predictive` also reads each chunk for the answer's usage), and SGLang's router
(`sglang-router` from PyPI) in front of it when a Python that has it is given. Then, for each
of direct / kvlb / sglang, runs `--concurrency` streams at once until `--streams` have run,
checks every byte of every answer, and prints streams/s, time to first chunk and end to end
latency beside direct, and the router's CPU (user + system, from /proc) per relayed chunk
and per stream. The runs of the routers alternate, so a busy neighbour on shared CPUs
weighs on all of them; compare their ratios, not absolute times across days.

    python -m loadtest.bench.stream [--streams 256] [--concurrency 32] [--repeat 2]
        [--sglang-python .venv-sglang-router/bin/python] [--client-quickack] [--profile-kvlb COMMAND]

--profile-kvlb attaches a profiler to kvlb for the runs; loadtest/bench/profile_stacks.py sums
py-spy's output by function and by part of the relay path.

sglang-router is never a dependency of kvlb: install it into a side environment
(`python3.11 -m venv .venv-sglang-router && .venv-sglang-router/bin/pip install sglang-router`), or the sglang row
is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import orjson
import yaml

from balancer.wire.chunked import ChunkedDecoder
from loadtest.bench.proxy import MODELS_RESPONSE, RESPONSE, next_request
from loadtest.bench.proxy import pct as _pct
from loadtest.procs import (
    CLOCK_TICKS,
    free_port,
    read_cpu_seconds,
    start_process,
    stop_process,
    wait_for_http,
)

CHUNKS = 256
INTERVAL_S = 0.002
DEFAULT_SGLANG_PYTHON = ".venv-sglang-router/bin/python"


def event(i: int, last: bool) -> bytes:
    finish = b'"stop"' if last else b"null"
    return (b'data: {"id":"c1","object":"chat.completion.chunk","created":0,'
            b'"model":"bench","choices":[{"index":0,"delta":{"content":" %03d"},'
            b'"finish_reason":' % (i % 1000) + finish + b"}]}\n\n")


DONE = b"data: [DONE]\n\n"


def events(n: int) -> list[bytes]:
    return [event(i, i == n - 1) for i in range(n)]


def frame(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


# upstream ----------------------------------------------------------------------------------

STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
HEALTH_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
# SGLang's router asks its workers about themselves (/server_info, /model_info) when it
# registers them.
INFO = b'{"model_path":"bench","tokenizer_path":"bench","is_generation":true,"served_model_name":"bench"}'
INFO_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(INFO)).encode() + b"\r\n\r\n" + INFO)


class StreamingUpstream(asyncio.Protocol):
    """Keep-alive HTTP/1.1: a streamed chat request gets `chunks` events, one write each,
    at deadlines fixed from the stream's start (a late tick catches up rather than
    stretching the stream); anything else gets a fixed answer at once."""

    frames: list[bytes] = []
    interval_s = INTERVAL_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        self.buffer = b""
        self.streaming = False
        self.closed = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        # A request sent while a stream is running waits for the stream's end.
        while not self.streaming and (request := next_request(self.buffer)) is not None:
            head, body, self.buffer = request
            line = head[:head.find(b"\r\n")] if b"\r\n" in head else head
            if line.startswith(b"post") and b"/chat/completions" in line:
                request = orjson.loads(body)
                if request.get("stream"):
                    # SGLang's router passes max_tokens on as max_completion_tokens.
                    asked = request.get("max_tokens") or request.get("max_completion_tokens")
                    n = min(int(asked or len(self.frames)), len(self.frames))
                    self.start_stream(n)
                    continue
                self.transport.write(RESPONSE)
            elif b"/v1/models" in line:
                self.transport.write(MODELS_RESPONSE)
            elif b"info" in line:
                self.transport.write(INFO_RESPONSE)
            else:
                self.transport.write(HEALTH_RESPONSE)

    def start_stream(self, n: int) -> None:
        self.streaming = True
        self.stream_n, self.stream_start = n, self.loop.time()
        if n == 1:
            self.transport.write(STREAM_HEAD)
            self.send(0)
            return
        self.transport.write(STREAM_HEAD + self.frames[0])
        self.loop.call_at(self.stream_start + self.interval_s, self.send, 1)

    def send(self, i: int) -> None:
        if self.closed:
            return
        if i < self.stream_n - 1:
            self.transport.write(self.frames[i])
            # One timer at a time, each setting the next: timers due in the same tick of a
            # busy loop could otherwise fire out of order.
            self.loop.call_at(self.stream_start + (i + 1) * self.interval_s, self.send, i + 1)
            return
        # The last event, then [DONE] as its own chunk, as engines write them.
        self.transport.writelines((frame_with_finish(i), DONE_FRAME, b"0\r\n\r\n"))
        self.streaming = False
        if self.buffer:
            self.data_received(b"")


DONE_FRAME = frame(DONE)
_FINISH_FRAMES: dict[int, bytes] = {}


def frame_with_finish(i: int) -> bytes:
    cached = _FINISH_FRAMES.get(i)
    if cached is None:
        cached = _FINISH_FRAMES[i] = frame(event(i, True))
    return cached


async def run_upstream(port: int, chunks: int, interval_s: float) -> None:
    StreamingUpstream.frames = [frame(event(i, False)) for i in range(chunks)]
    StreamingUpstream.interval_s = interval_s
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StreamingUpstream, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# client ------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamResult:
    ttft_s: float
    total_s: float
    events: int  # SSE events received (the n chunks and [DONE])
    reads: int  # socket reads that carried body bytes: fewer than events when a router coalesces
    ok: bool


class StreamClient(asyncio.Protocol):
    """One keep-alive connection, one streamed request at a time. The body is de-chunked,
    kept, and compared byte for byte with what the upstream sent."""

    quickack = False

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[StreamResult] | None = None
        self.mode = ""
        self.parts: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sock = transport.get_extra_info("socket")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.mode == "close" and self.parts:
                self._finish()
            else:
                self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def request(self, data: bytes, expected: bytes) -> asyncio.Future[StreamResult]:
        assert self.transport is not None
        self.expected = expected
        self.head = b""
        self.mode = ""  # "chunked", "length", "close" once the head is read
        self.remaining = 0
        self.decoder = ChunkedDecoder()
        self.parts = []
        self.reads = 0
        self.first_at = 0.0
        self.keep_alive = True
        self.waiter = self.loop.create_future()
        self.started = time.perf_counter()
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            return
        if not self.mode:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end].lower(), self.head[end + 4:]
            if not head.startswith(b"http/1.") or head.count(b" ") < 1:
                # Bytes left over from the previous answer: a framing error of the router's.
                self.waiter.set_exception(RuntimeError(f"not an HTTP/1.x head: {head[:80]!r}"))
                self.closed = True
                assert self.transport is not None
                self.transport.close()
                return
            status = head.split(b" ", 2)[1]
            if status != b"200":
                self.waiter.set_exception(RuntimeError(f"HTTP {status.decode()}: {data[:200]!r}"))
                self.closed = True  # the rest of that answer would confuse the next one
                assert self.transport is not None
                self.transport.close()
                return
            self.keep_alive = b"connection: close" not in head
            if b"transfer-encoding: chunked" in head:
                self.mode = "chunked"
            elif b"content-length:" in head:
                at = head.find(b"content-length:") + 15
                eol = head.find(b"\r\n", at)
                self.mode, self.remaining = "length", int(head[at:eol if eol > 0 else None])
            else:
                self.mode, self.keep_alive = "close", False
            if not data:
                return
        now = time.perf_counter()
        if not self.first_at:
            self.first_at = now
        self.reads += 1
        if self.quickack:
            # Linux turns quick ACKs off again after a while: set it after every read.
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        if self.mode == "chunked":
            pieces, _ = self.decoder.feed(data)
            self.parts += pieces
            if self.decoder.done:
                self._finish()
        else:
            self.parts.append(data)
            if self.mode == "length":
                self.remaining -= len(data)
                if self.remaining <= 0:
                    self._finish()

    def _finish(self) -> None:
        body = b"".join(self.parts)
        now = time.perf_counter()
        result = StreamResult(self.first_at - self.started, now - self.started, body.count(b"\n\n"),
                              self.reads, body == self.expected)
        if not self.keep_alive and self.transport is not None:
            self.transport.close()
            self.closed = True
        assert self.waiter is not None
        self.waiter.set_result(result)


def stream_request(host_port: str, chunks: int) -> bytes:
    body = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say hello."}],
                         "max_tokens": chunks, "temperature": 0, "stream": True})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n" % (host_port.encode(), len(body)) + body)


async def run_streams(port: int, concurrency: int, total: int, chunks: int,
                      errors: list[str] | None = None) -> tuple[float, list[StreamResult]]:
    """Closed loop: `concurrency` connections run `total` streams; (wall time, results).
    Streams that failed outright are added to `errors`."""
    errors = [] if errors is None else errors
    loop = asyncio.get_running_loop()
    data = stream_request(f"127.0.0.1:{port}", chunks)
    expected = b"".join(events(chunks)) + DONE
    results: list[StreamResult] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        client: StreamClient | None = None
        try:
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                try:
                    if client is None or client.closed:
                        _, client = await loop.create_connection(StreamClient, "127.0.0.1", port)
                    results.append(await client.request(data, expected))
                except (ConnectionError, OSError, RuntimeError) as exc:
                    # A broken stream is a result, counted as incomplete, not the end of the run.
                    errors.append(repr(exc))
                    elapsed = time.perf_counter() - started
                    results.append(StreamResult(elapsed, elapsed, 0, 0, False))
                    if client is not None and client.transport is not None:
                        client.transport.close()
                    client = None
        finally:
            if client is not None and client.transport is not None:
                client.transport.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, results


# processes ---------------------------------------------------------------------------------


def session_cpu(leader: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every live process in `leader`'s session: start_process
    makes each router a session leader, and a router may run helpers of its own."""
    user = system = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader:  # field 6 of stat, the session id
            user += int(fields[11])
            system += int(fields[12])
    return user / CLOCK_TICKS, system / CLOCK_TICKS


@dataclass
class Router:
    name: str
    port: int
    proc: subprocess.Popen | None  # None: the upstream itself
    runs: list[dict] = field(default_factory=list)


async def start_router(name: str, argv: list[str], port: int, ready_path: str, env: dict[str, str]) -> Router:
    try:
        proc = start_process(argv, env, quiet=True)
    except OSError as exc:
        raise RuntimeError(f"{name} ({shlex.join(argv)}) could not start: {exc}") from None
    try:
        await wait_for_http(f"http://127.0.0.1:{port}{ready_path}", timeout_s=60)
    except TimeoutError:
        code = proc.poll()
        stop_process(proc)
        state = f"exited with status {code}" if code is not None else "did not answer"
        raise RuntimeError(f"{name} ({shlex.join(argv)}) {state}") from None
    return Router(name, port, proc)


def sglang_python(arg: str | None) -> str | None:
    path = arg or os.environ.get("KVLB_SGLANG_PYTHON")
    if path:
        return path
    return DEFAULT_SGLANG_PYTHON if os.path.exists(DEFAULT_SGLANG_PYTHON) else None


def own_cpu() -> float:
    return read_cpu_seconds(os.getpid())


async def measure(router: Router, upstream: subprocess.Popen, args: argparse.Namespace) -> None:
    # Warm both sides' connection pools with short streams before anything is timed.
    await run_streams(router.port, args.concurrency, args.concurrency * 2, 4)
    leader = router.proc.pid if router.proc is not None else upstream.pid
    cpu_before, upstream_before, client_before = session_cpu(leader), session_cpu(upstream.pid), own_cpu()
    errors: list[str] = []
    wall, results = await run_streams(router.port, args.concurrency, args.streams, args.chunks, errors)
    if errors:
        print(f"{router.name}: {len(errors)} stream(s) failed, first: {errors[0]}")
    cpu_after, upstream_after, client_after = session_cpu(leader), session_cpu(upstream.pid), own_cpu()
    good = [r for r in results if r.ok and r.events == args.chunks + 1]
    router.runs.append({
        "wall": wall, "streams": len(results), "good": len(good),
        "events": sum(r.events for r in results), "reads": sum(r.reads for r in results),
        "ttft": [r.ttft_s for r in good], "total": [r.total_s for r in good],
        "user": cpu_after[0] - cpu_before[0], "system": cpu_after[1] - cpu_before[1],
        "upstream": sum(upstream_after) - sum(upstream_before), "client": client_after - client_before,
    })


def pct(values: list[float], q: float) -> float:
    return _pct(values, q) if values else float("nan")  # nan: no stream completed


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def report(routers: list[Router], args: argparse.Namespace) -> None:
    direct = routers[0]

    def merged(router: Router, key: str) -> list[float]:
        return [x for run in router.runs for x in run[key]]

    def per_chunk(router: Router) -> list[float]:
        return [(r["user"] + r["system"]) / r["events"] for r in router.runs]

    def total_per_chunk(router: Router, key: str) -> float:
        return sum(r[key] for r in router.runs) / sum(r["events"] for r in router.runs)

    print(f"{'':<15} {'streams/s':>9} {'complete':>9} {'chunks':>7} {'per read':>8} "
          f"{'TTFT p50':>9} {'vs direct':>9} {'e2e p50':>8} {'e2e p99':>8} {'vs direct':>9} "
          f"{'CPU/chunk':>9} {'user+sys':>10} {'CPU/stream':>10} {'client/chunk':>12} {'all/chunk':>9}")
    d_ttft, d_p50 = pct(merged(direct, "ttft"), .5), pct(merged(direct, "total"), .5)
    for router in routers:
        runs = router.runs
        ttft, total = merged(router, "ttft"), merged(router, "total")
        streams = sum(r["streams"] for r in runs)
        chunk_events = sum(r["events"] for r in runs)
        rate = median([r["streams"] / r["wall"] for r in runs])
        everything = total_per_chunk(router, "client") + total_per_chunk(router, "upstream")
        if router.proc is not None:
            everything += total_per_chunk(router, "user") + total_per_chunk(router, "system")
        print(f"{router.name:<15} {rate:>9.1f} {sum(r['good'] for r in runs):>4}/{streams:<4} {chunk_events:>7} "
              f"{chunk_events / max(1, sum(r['reads'] for r in runs)):>8.2f} "
              f"{pct(ttft, .5) * 1e3:>7.2f}ms {(pct(ttft, .5) - d_ttft) * 1e3:>+7.2f}ms "
              f"{pct(total, .5) * 1e3:>6.1f}ms {pct(total, .99) * 1e3:>6.1f}ms "
              f"{(pct(total, .5) - d_p50) * 1e3:>+7.2f}ms "
              f"{median(per_chunk(router)) * 1e6:>6.1f} µs "
              f"{total_per_chunk(router, 'user') * 1e6:>4.1f}+{total_per_chunk(router, 'system') * 1e6:<4.1f}µs "
              f"{sum(r['user'] + r['system'] for r in runs) / streams * 1e3:>7.2f} ms "
              f"{total_per_chunk(router, 'client') * 1e6:>9.1f} µs {everything * 1e6:>6.1f} µs")
    if args.repeat > 1:
        print("CPU/chunk of each run: " + "; ".join(
            f"{r.name} " + " ".join(f"{x * 1e6:.1f}" for x in per_chunk(r)) for r in routers) + " µs")
    by_name = {r.name: r for r in routers}
    if "sglang" in by_name:
        for name in ("kvlb", "kvlb-nagle"):
            if name in by_name:
                ratio = median(per_chunk(by_name[name])) / median(per_chunk(by_name["sglang"]))
                print(f"{name}/sglang CPU per relayed chunk: {ratio:.2f}  (goal: <= 1.00)")
    if "kvlb-no-answers" in by_name and "kvlb" in by_name:
        ratio = median(per_chunk(by_name["kvlb"])) / median(per_chunk(by_name["kvlb-no-answers"]))
        print(f"kvlb/kvlb-no-answers CPU per relayed chunk: {ratio:.2f} (reading answers into the index)")
    print("kvlb-nagle: kvlb with listen.tcp_nodelay false, Nagle on towards clients as in sglang-router;")
    print("kvlb-no-answers: kvlb with routing.index_answer_chars 0, answers not read into the prefix index;")
    print("complete: streams whose every event and [DONE] arrived, checked byte for byte; chunks: SSE "
          "events received;")
    print("per read: events per socket read at the client, above 1 where a router coalesced them "
          "(sglang-router leaves Nagle on towards clients: on a kept-alive connection its small writes")
    print("wait for the client's delayed ACK, ~40 ms, which shows in its TTFT);")
    print("CPU/chunk: user + system of the router's processes while the streams ran, per chunk "
          "(direct: the upstream's); all/chunk: upstream + router + this client together.")


async def bench(args: argparse.Namespace) -> None:
    env = dict(os.environ)
    upstream_port = free_port()
    upstream = start_process(
        [sys.executable, "-m", "loadtest.bench.stream", "--upstream-only", str(upstream_port),
         "--chunks", str(args.chunks), "--interval-ms", str(args.interval_ms)], env)
    routers: list[Router] = [Router("direct", upstream_port, None)]  # its CPU is the upstream's
    note = ""
    try:
        await wait_for_http(f"http://127.0.0.1:{upstream_port}/v1/models")
        kvlb_port = free_port()
        routers.append(await start_router(
            "kvlb", [sys.executable, "-m", "balancer", "serve", "--replica", f"http://127.0.0.1:{upstream_port}",
                     "--port", str(kvlb_port), "--policy", args.policy], kvlb_port, "/ready", env))
        # The same kvlb with Nagle left on towards clients, as SGLang's router has it: the kernel
        # then coalesces chunks, which is most of what separates the two in CPU per chunk.
        routers.append(await start_configured_kvlb("kvlb-nagle", upstream_port, args.policy,
                                                   {"listen": {"tcp_nodelay": False}}, env))
        if args.policy != "least_load":
            # A cache-aware policy reads each streamed answer's text into its prefix index;
            # the same kvlb without that shows what the reading costs.
            routers.append(await start_configured_kvlb("kvlb-no-answers", upstream_port, args.policy,
                                                       {"routing": {"index_answer_chars": 0}}, env))
        python = sglang_python(args.sglang_python)
        if python is None:
            note = ("sglang: skipped, no sglang-router (give --sglang-python or KVLB_SGLANG_PYTHON, or "
                    "install it: python3.11 -m venv .venv-sglang-router && .venv-sglang-router/bin/pip install sglang-router)")
        else:
            sgl_port = free_port()
            # Offline: it must not look for a tokenizer or model card on the network.
            sgl_env = dict(env, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
            argv = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(sgl_port),
                    "--worker-urls", f"http://127.0.0.1:{upstream_port}", "--policy", args.sglang_policy,
                    "--log-level", "warn", *shlex.split(args.sglang_args)]
            try:
                routers.append(await start_router("sglang", argv, sgl_port, "/health", sgl_env))
            except RuntimeError as exc:
                note = f"sglang: skipped, {exc}"
        profiler = profiler_start(args.profile_kvlb, routers[1]) if args.profile_kvlb else None
        print(f"streaming relay, {args.streams} streams per run ({args.concurrency} at once), {args.chunks} "
              f"chunks of ~{len(event(0, False))} bytes each {args.interval_ms:g} ms apart, then [DONE]; "
              f"{args.repeat} run(s) each, {os.cpu_count()} CPUs")
        if note:
            print(note)
        if profiler is not None:
            print(f"profiling kvlb with {args.profile_kvlb!r}: the profiler shares the CPUs and slows kvlb, "
                  "so these figures are not comparable to an unprofiled run")
        for _ in range(args.repeat):
            # Interleaved, so a noisy neighbour on the shared cores hits every router alike.
            for router in routers:
                await measure(router, upstream, args)
        if profiler is not None:
            profiler_stop(profiler)
        report(routers, args)
    finally:
        for router in routers[1:]:
            if router.proc is not None:
                stop_process(router.proc)
        stop_process(upstream)


async def start_configured_kvlb(name: str, upstream_port: int, policy: str, sections: dict,
                                env: dict[str, str]) -> Router:
    port = free_port()
    config: dict = {"listen": {"host": "127.0.0.1", "port": port},
                    "replicas": [{"url": f"http://127.0.0.1:{upstream_port}"}], "policy": {"name": policy}}
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    config_file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    with config_file:
        yaml.safe_dump(config, config_file)
    try:
        return await start_router(name, [sys.executable, "-m", "balancer", "serve", "--config", config_file.name],
                                  port, "/ready", env)
    finally:
        os.unlink(config_file.name)


def profiler_start(command: str, kvlb: Router) -> subprocess.Popen:
    """A profiler attached to kvlb for all the runs (`{pid}` in `command` is kvlb's pid)."""
    assert kvlb.proc is not None
    profiler = subprocess.Popen(shlex.split(command.format(pid=kvlb.proc.pid)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(1.0)  # attached before the first stream
    return profiler


def profiler_stop(profiler: subprocess.Popen) -> None:
    profiler.send_signal(signal.SIGINT)  # py-spy and perf both write their output on SIGINT
    try:
        profiler.wait(60)
    except subprocess.TimeoutExpired:
        profiler.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256, help="streams per router per run")
    parser.add_argument("--concurrency", type=int, default=32, help="streams at once")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help="SSE chunks per stream, before [DONE]")
    parser.add_argument("--interval-ms", type=float, default=INTERVAL_S * 1e3)
    parser.add_argument("--repeat", type=int, default=2, help="runs per router, interleaved")
    parser.add_argument("--sglang-python", help=f"a Python with sglang-router (or KVLB_SGLANG_PYTHON; "
                                                f"default {DEFAULT_SGLANG_PYTHON} if it exists)")
    parser.add_argument("--client-quickack", action="store_true",
                        help="the client ACKs every read at once, so a router that leaves Nagle on "
                             "cannot batch its writes behind the client's delayed ACKs")
    parser.add_argument("--policy", default="least_load", help="kvlb's routing policy")
    parser.add_argument("--sglang-policy", default="round_robin", choices=("round_robin", "cache_aware"))
    parser.add_argument("--sglang-args", default="", help="more arguments for sglang_router.launch_router")
    parser.add_argument(
        "--profile-kvlb", metavar="COMMAND",
        help="a profiler to attach to kvlb during the runs, {pid} for its pid, stopped with SIGINT; e.g. "
             "'py-spy record --nonblocking --format raw -r 250 -p {pid} -o kvlb.stacks' or "
             "'perf record -g -p {pid} -o kvlb.perf'")
    parser.add_argument("--upstream-only", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import uvloop

    StreamClient.quickack = args.client_quickack
    if args.upstream_only:
        uvloop.run(run_upstream(args.upstream_only, args.chunks, args.interval_ms / 1e3))
        return
    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
