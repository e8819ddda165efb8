"""The replica client parses every HTTP/1.1 body framing a replica may use, however the bytes
are split on the wire, and keeps connections alive only when that is safe."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from balancer.wire.client import UpstreamError, UpstreamPool
from loadtest.procs import free_port
from tests.conftest import TEST_PORT_RANGE

assert TEST_PORT_RANGE


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handle: Handler) -> AsyncIterator[str]:
    """A server on 127.0.0.1 whose handlers all end before it goes: one still waiting when the
    test's loop closes would be cancelled, which Python 3.11 logs as an error."""
    tasks: set[asyncio.Task] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        writers.add(writer)
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(tracked, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:
            writer.close()  # the handler's next read sees the end and returns
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2.0)
        await server.wait_closed()


@asynccontextmanager
async def raw_server(answer: Callable[[int], list[bytes]], *, close_after: bool = False,
                     gap_s: float = 0.0) -> AsyncIterator[tuple[str, dict]]:
    """Reads one request at a time and writes `answer(n)` piece by piece, `gap_s` apart."""
    stats = {"connections": 0, "requests": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(request_length(head))
                stats["requests"] += 1
                for piece in answer(stats["requests"]):
                    writer.write(piece)
                    await writer.drain()
                    if gap_s:
                        await asyncio.sleep(gap_s)
                if close_after:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async with serving(handle) as url:
        yield url, stats


def request_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data), n)]


async def fetch(pool: UpstreamPool, url: str) -> tuple[int, bytes, dict]:
    resp = await pool.request(url, "POST", "/v1/x", [("Content-Type", "application/json")], b"{}", 5.0)
    try:
        body = await resp.read(1 << 20)
        return resp.status, body, dict(resp.headers)
    finally:
        resp.close()


CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
           b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n")
LENGTH = b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\nX-A: b\r\n\r\nhello world"


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
async def test_chunked_body_split_anywhere(piece: int) -> None:
    async with raw_server(lambda n: split_every(CHUNKED, piece)) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        for _ in range(3):
            status, body, headers = await fetch(pool, url)
            assert (status, body) == (200, b"hello, world")
            assert headers["Content-Type"] == "text/event-stream"
        assert stats["connections"] == 1  # kept alive across requests
        pool.close()


@pytest.mark.parametrize("piece", [1, 5, 1000])
async def test_content_length_body_and_interim_100(piece: int) -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + LENGTH
    async with raw_server(lambda n: split_every(answer, piece)) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        for _ in range(2):
            assert (await fetch(pool, url))[:2] == (201, b"hello world")
        assert stats["connections"] == 1
        pool.close()


async def test_body_until_close_and_connection_close_are_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nno length here"
    async with raw_server(lambda n: [answer], close_after=True) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        for _ in range(2):
            assert (await fetch(pool, url))[:2] == (200, b"no length here")
        assert stats["connections"] == 2
        pool.close()


async def test_stale_keepalive_connection_is_retried_once_on_a_fresh_one() -> None:
    # The server answers keep-alive but then closes: the pooled connection is dead on reuse.
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with raw_server(lambda n: [answer], close_after=True) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        await asyncio.sleep(0.05)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        assert stats["requests"] == 2
        pool.close()


async def test_body_cut_short_raises() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"
    async with raw_server(lambda n: [answer], close_after=True) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        with pytest.raises(UpstreamError):
            await fetch(pool, url)
        pool.close()


async def test_garbage_status_line_raises() -> None:
    async with raw_server(lambda n: [b"SMTP ready\r\n\r\n"], close_after=True) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        with pytest.raises(UpstreamError):
            await fetch(pool, url)
        pool.close()


async def test_connection_refused_raises_oserror() -> None:
    pool = UpstreamPool(connect_timeout_s=2)
    with pytest.raises(OSError):
        await fetch(pool, f"http://127.0.0.1:{free_port()}")
    pool.close()


async def test_request_bytes_on_the_wire() -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head + await reader.readexactly(4))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        writer.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    pool = UpstreamPool(connect_timeout_s=2)
    resp = await pool.request(f"http://127.0.0.1:{port}/prefix/", "POST", "/v1/a?b=1", [("X-K", "v")], b"body", 5.0)
    assert resp.status == 204 and await resp.read(10) == b""
    resp.close()
    pool.close()
    server.close()
    assert seen == [f"POST /prefix/v1/a?b=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-K: v\r\n"
                    f"Content-Length: 4\r\n\r\nbody".encode()]
