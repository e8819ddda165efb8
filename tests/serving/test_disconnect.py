"""A client that goes away takes its upstream request with it."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import aiohttp

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, endless_stream_app, hanging_app


async def wait_for(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_disconnect_before_first_byte_cancels_upstream() -> None:
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(hanging_app(seen)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        replica = running.balancer.fleet.replicas[0]
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(http.post(running.url + "/v1/completions", json={"model": "m", "prompt": "p"}))
            await wait_for(lambda: seen.requests == 1 and replica.in_flight == 1)
            task.cancel()
            gone_at = time.monotonic()
            await asyncio.gather(task, return_exceptions=True)
        await wait_for(lambda: bool(seen.disconnected_at))
        assert seen.disconnected_at[0] - gone_at < 0.5  # target 0.1 s; slack for a loaded machine
        await wait_for(lambda: replica.in_flight == 0)


async def test_disconnect_mid_stream_cancels_upstream() -> None:
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(endless_stream_app(seen)))
        running = await stack.enter_async_context(run_balancer(make_settings([url])))
        replica = running.balancer.fleet.replicas[0]
        http = aiohttp.ClientSession()
        resp = await http.post(running.url + "/v1/chat/completions",
                               json={"model": "m", "messages": [], "stream": True})
        for _ in range(3):
            await resp.content.readline()
        assert replica.in_flight == 1
        resp.close()
        await http.close()
        gone_at = time.monotonic()
        await wait_for(lambda: bool(seen.disconnected_at))
        assert seen.disconnected_at[0] - gone_at < 0.5  # target 0.1 s; slack for a loaded machine
        await wait_for(lambda: replica.in_flight == 0)
        assert running.balancer.in_flight == 0


async def test_a_client_that_stops_reading_is_cut_off_not_waited_for_forever() -> None:
    seen = Seen()
    async with AsyncExitStack() as stack:
        # An upstream that streams fast and forever: the client's socket buffers fill up.
        url = await stack.enter_async_context(serve_app(endless_stream_app(seen, gap_s=0.0005)))
        settings = make_settings([url], timeouts={"stream_idle_s": 0.5, "total_s": 1.5, "first_byte_s": 1.0})
        running = await stack.enter_async_context(run_balancer(settings))
        port = int(running.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        body = b'{"model": "m", "prompt": "p", "stream": true}'
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the answer started; now never read again
        await wait_for(lambda: running.balancer.in_flight == 0, timeout=5.0)
        writer.close()
        await wait_for(lambda: bool(seen.disconnected_at))  # the upstream request was closed too
