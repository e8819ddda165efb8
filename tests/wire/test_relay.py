"""Relaying a replica's body to the client: backpressure both ways, and who is at fault when
a stream stops (balancer/wire/relay.py)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import socket
import time
from contextlib import AsyncExitStack

import aiohttp
import orjson
from aiohttp import web

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, healthy, slow_sse_app

PIECE = 64 * 1024
PIECES = 512  # 32 MiB: far more than any buffer on the way, so only backpressure keeps up
REPLICA_SNDBUF = 256 * 1024


def big_body_app(sent: list[int], *, stall_after: int | None = None) -> web.Application:
    """Streams PIECES numbered pieces of unknown length; with `stall_after`, goes silent."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        # A fixed send buffer: the kernel would otherwise grow this stand-in replica's to
        # megabytes on a busy machine, and those bytes, counted as sent, are not kvlb's.
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, REPLICA_SNDBUF)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        for i in range(PIECES):
            if stall_after is not None and i == stall_after:
                await asyncio.sleep(3600)
            await resp.write(piece(i))
            sent[0] = i + 1
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_get("/health", healthy)
    return app


def piece(i: int) -> bytes:
    return (b"%08d" % i) * (PIECE // 8)


async def post(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = orjson.dumps({"model": "m", "prompt": "p"})
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    return reader, writer


async def test_a_slow_but_reading_client_gets_every_byte_and_the_replica_waits_for_it() -> None:
    sent = [0]
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(big_body_app(sent)))
        running = await stack.enter_async_context(run_balancer(make_settings([url], timeouts={"client_write_s": 5})))
        port = int(running.url.rsplit(":", 1)[1])
        reader, writer = await post(port, rcvbuf=16384)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        digest, received = hashlib.sha256(), 0
        await asyncio.sleep(0.5)  # not reading: the replica must be held back, not buffered
        assert sent[0] < PIECES // 4
        async with asyncio.timeout(60):
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                digest.update(data[:-2])
                received += size
        writer.close()
    expected = hashlib.sha256(b"".join(piece(i) for i in range(PIECES)))
    assert received == PIECE * PIECES and digest.digest() == expected.digest()


async def test_a_replica_silent_mid_body_breaks_the_stream_and_counts_against_it() -> None:
    sent = [0]
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(big_body_app(sent, stall_after=3)))
        settings = make_settings([{"url": url, "name": "r"}], timeouts={"stream_idle_s": 0.5})
        running = await stack.enter_async_context(run_balancer(settings))
        port = int(running.url.rsplit(":", 1)[1])
        reader, writer = await post(port)
        async with asyncio.timeout(10):
            raw = await reader.read()  # cut: the body never ends with its last chunk
        writer.close()
        assert raw.startswith(b"HTTP/1.1 200 ") and not raw.endswith(b"0\r\n\r\n")
        attempts = running.balancer.metrics.attempts
        assert attempts[("r", "broken_stream")] == 1


async def test_a_client_that_stops_reading_is_cut_and_the_replica_is_not_blamed() -> None:
    sent = [0]
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(big_body_app(sent)))
        settings = make_settings([{"url": url, "name": "r"}],
                                 timeouts={"client_write_s": 0.5, "stream_idle_s": 0.2})
        running = await stack.enter_async_context(run_balancer(settings))
        port = int(running.url.rsplit(":", 1)[1])
        reader, writer = await post(port, rcvbuf=16384)
        await reader.readuntil(b"\r\n\r\n")
        metrics = running.balancer.metrics
        async with asyncio.timeout(10):
            while not metrics.client_stalls:
                await asyncio.sleep(0.05)
        writer.close()
        # Waiting on the client for longer than stream_idle_s was not the replica's silence.
        assert ("r", "broken_stream") not in metrics.attempts
        assert metrics.attempts[("r", "ok")] == 1
        assert running.balancer.fleet.by_name["r"].breaker.failures == 0


async def test_a_relayed_stream_leaves_nothing_for_the_cyclic_collector() -> None:
    """Each streamed request's state goes with its last reference. State caught in a
    reference cycle waits for the collector's full passes, which then walk every request of
    the last seconds at once and stall all streams for 100 ms and more."""
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(slow_sse_app(seen, chunks=8, gap_s=0)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage to look at
        try:
            for _ in range(20):
                async with http.post(running.url + "/v1/completions",
                                     json={"model": "m", "prompt": "a prompt", "stream": True}) as resp:
                    assert resp.status == 200
                    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            gc.collect()
            cyclic = sorted({type(o).__qualname__ for o in gc.garbage
                             if type(o).__module__.startswith(("balancer.", "policies."))})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert seen.requests == 20
    assert cyclic == []


async def test_a_streamed_answer_ends_for_the_client_when_the_replica_ends_it(monkeypatch) -> None:
    """The client's end-to-end time ends with the replica's last byte, not after whatever the
    proxy does once the relay is over (learning from the answer, indexing its text): the
    chunked stream's end goes out from the connection's own callback. Here that later work
    is made to hold the event loop for 0.5 s, and a client on a thread of its own must have
    its answer's end before it is over."""
    from balancer.wire import relay as relay_module

    held: list[float] = []
    original = relay_module.StreamRelay.run

    async def run_then_hold(self: relay_module.StreamRelay) -> None:
        await original(self)
        held.append(time.monotonic())
        time.sleep(0.5)  # blocks the loop, as slow bookkeeping would

    monkeypatch.setattr(relay_module.StreamRelay, "run", run_then_hold)
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(slow_sse_app(seen, chunks=3, gap_s=0)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        port = int(running.url.rsplit(":", 1)[1])

        def client() -> tuple[bytes, float]:
            body = orjson.dumps({"model": "m", "prompt": "p", "stream": True})
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
                data = b""
                while not data.endswith(b"0\r\n\r\n"):
                    more = sock.recv(65536)
                    assert more, f"connection closed after {data!r}"
                    data += more
                return data, time.monotonic()

        data, ended = await asyncio.to_thread(client)
    assert b"data: [DONE]" in data and seen.requests == 1
    assert held, "the relay never finished"
    assert ended < held[0] + 0.25, "the answer's end waited for the work after the relay"
