"""The client-facing HTTP/1.1 server, spoken to over raw sockets the way real clients
(and broken or hostile ones) speak."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson

from balancer.wire.server import HttpServer, Request, ServerLimits
from tests.conftest import TEST_PORT_RANGE


async def echo_handler(request: Request) -> None:
    if request.path == "/stream":
        stream = await request.start_stream(200, [("Content-Type", "text/event-stream")])
        for i in range(3):
            await stream.write(f"data: {i}\n\n".encode())
        await stream.end()
        return
    if request.path == "/slow":
        await asyncio.sleep(3600)
    body = orjson.dumps({"method": request.method, "target": request.target, "body": request.body.decode(),
                         "x": request.header("x-thing")})
    request.respond(200, [("Content-Type", "application/json")], body)


def error_body(status: int, message: str, code: str, _request: Request | None):
    return [("Content-Type", "application/json")], orjson.dumps({"error": {"message": message, "code": code}})


@asynccontextmanager
async def server(admit=None, handler=echo_handler, tcp_nodelay=True,
                 **limits) -> AsyncIterator[tuple[int, HttpServer]]:
    srv = HttpServer(handler, error_body, ServerLimits(**limits), admit=admit, tcp_nodelay=tcp_nodelay)
    for _ in range(50):
        try:
            port = await srv.listen("127.0.0.1", random.randrange(*TEST_PORT_RANGE))
            break
        except OSError:
            continue
    try:
        yield port, srv
    finally:
        await srv.close(grace_s=0.5)


async def exchange(port: int, data: bytes, *, read_until_close: bool = True, wait_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(), wait_s)
        await asyncio.sleep(0.2)
        return await asyncio.wait_for(reader.read(65536), wait_s)
    finally:
        writer.close()


def bodies(raw: bytes) -> list[dict]:
    """Every JSON body in a sequence of Content-Length responses."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        out.append(orjson.loads(rest[:length]))
        raw = rest[length:]
    return out


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with server() as (port, _):
        reqs = b"".join(
            f"POST /r{i} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(str(i))}\r\n\r\n{i}".encode() for i in range(5)
        ) + b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        raw = await exchange(port, reqs)
        got = bodies(raw)
        assert [b["target"] for b in got] == ["/r0", "/r1", "/r2", "/r3", "/r4", "/last"]
        assert [b["body"] for b in got[:5]] == ["0", "1", "2", "3", "4"]


async def test_chunked_request_body_with_extensions_and_trailers() -> None:
    async with server() as (port, _):
        raw = await exchange(port, b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                   b"4;ext=1\r\nabcd\r\n3\r\nefg\r\n0\r\nX-T: 1\r\n\r\n")
        assert bodies(raw)[0]["body"] == "abcdefg"


async def test_expect_continue_gets_100_before_the_body() -> None:
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert bodies(raw)[0]["body"] == "ok"


async def test_smuggling_shapes_are_refused_with_400() -> None:
    cases = [
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nX-Bad\x00: v\r\n\r\n",
        b"POST / HTTP/1.1\r\nX: a\rb\r\n\r\n",
        b"POST / HTTP/1.1\r\n Folded: v\r\n\r\n",
        b"GARBAGE\r\n\r\n",
        b"GET nothing HTTP/1.1\r\n\r\n",
    ]
    async with server() as (port, _):
        for case in cases:
            raw = await exchange(port, case)
            assert raw.startswith(b"HTTP/1.1 400 "), (case, raw[:80])
            assert b'"code":"bad_request"' in raw


async def test_unicode_digits_and_blank_lines_between_requests() -> None:
    async with server() as (port, _):
        raw = await exchange(port, "POST / HTTP/1.1\r\nContent-Length: ²\r\n\r\n".encode("latin-1"))
        assert raw.startswith(b"HTTP/1.1 400 ")
        raw = await exchange(port, b"\r\n\r\nGET /after-blank-lines HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert bodies(raw)[0]["target"] == "/after-blank-lines"


async def test_limits_answer_413_431_and_501() -> None:
    async with server(max_header_bytes=1024, max_body_bytes=10) as (port, _):
        raw = await exchange(port, b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 413 ")
        raw = await exchange(port, b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nb\r\n" + b"x" * 11 + b"\r\n0\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 413 ")
        raw = await exchange(port, b"POST / HTTP/1.1\r\nX-Big: " + b"h" * 2000 + b"\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 431 ")
        raw = await exchange(port, b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 501 ")


async def test_slow_client_gets_408_and_idle_connections_close() -> None:
    async with server(header_timeout_s=0.2, body_timeout_s=0.2, keepalive_timeout_s=0.3) as (port, _):
        raw = await exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        assert raw.startswith(b"HTTP/1.1 408 ")
        raw = await exchange(port, b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")  # body never finishes
        assert raw.startswith(b"HTTP/1.1 408 ")
        raw = await exchange(port, b"")  # says nothing at all
        assert raw == b""


async def test_http10_streaming_is_close_delimited_and_11_is_chunked() -> None:
    async with server() as (port, _):
        raw = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        assert b"Transfer-Encoding" not in raw and raw.endswith(b"data: 2\n\n")
        raw = await exchange(port, b"GET /stream HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in raw and raw.endswith(b"0\r\n\r\n")


async def test_client_disconnect_cancels_the_handler() -> None:
    async with server() as (port, srv):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        for _ in range(100):
            if any(c.handler_task is not None for c in srv.connections):
                break
            await asyncio.sleep(0.01)
        (conn,) = srv.connections
        task = conn.handler_task
        assert task is not None
        writer.close()
        await asyncio.wait_for(asyncio.shield(task), 2)  # hangs for an hour unless cancelled
        assert task.done()


async def test_a_client_dripping_its_headers_does_not_extend_the_deadline() -> None:
    async with server(header_timeout_s=0.3) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        writer.write(b"POST / HTTP/1.1\r\n")
        answer = b""
        for _ in range(40):  # a byte every 0.05 s: never idle, never finished
            try:
                answer = await asyncio.wait_for(reader.read(4096), 0.05)
                break  # the server answered; writing more would only hit a closed socket
            except TimeoutError:
                writer.write(b"X")
        elapsed = loop.time() - started
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert elapsed < 0.9  # the deadline counted from the first byte, not the last


async def test_connections_beyond_the_cap_get_503_with_retry_after() -> None:
    async with server(max_connections=2) as (port, srv):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        while len(srv.connections) < 2:
            await asyncio.sleep(0.01)
        raw = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in raw
        assert b'"too_many_connections"' in raw
        # The connections held before the cap was reached still work.
        reader, writer = held[0]
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"}"), 5)).startswith(b"HTTP/1.1 200 ")
        for _, w in held:
            w.close()
        while srv.connections:
            await asyncio.sleep(0.01)
        assert (await exchange(port, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_a_body_beyond_the_buffer_budget_is_refused_on_its_head() -> None:
    async with server(max_buffered_bytes=1000) as (port, srv):
        slow_reader, slow = await asyncio.open_connection("127.0.0.1", port)
        slow.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 800\r\n\r\n" + b"x" * 100)
        await slow.drain()
        while srv.buffered_bytes == 0:
            await asyncio.sleep(0.01)
        raw = await exchange(port, b"POST /b HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                   b"Content-Length: 300\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in raw
        assert b"100 Continue" not in raw and b'"buffer_budget_exceeded"' in raw
        small = await exchange(port, b"POST /c HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        assert small.startswith(b"HTTP/1.1 200 ")
        slow.close()  # an aborted upload gives its reservation back
        while srv.buffered_bytes:
            await asyncio.sleep(0.01)


async def test_a_chunked_body_counts_against_the_budget_as_it_arrives() -> None:
    async with server(max_buffered_bytes=1000) as (port, srv):
        raw = await exchange(port, b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   b"3e8\r\n" + b"x" * 1000 + b"\r\n1\r\nx\r\n0\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 503 ") and b'"buffer_budget_exceeded"' in raw
        assert srv.buffered_bytes == 0


async def test_a_request_refused_on_its_head_gets_no_100_continue_and_its_body_is_never_read() -> None:
    def admit(request: Request):
        if request.header("authorization") != "Bearer ok":
            return 401, [("Content-Type", "application/json")], b'{"error": {"code": "invalid_api_key"}}'
        return None

    async with server(admit=admit) as (port, srv):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 33554432\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 5)  # answered and closed without the body
        writer.close()
        assert raw.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in raw
        assert srv.buffered_bytes == 0
        # Without a body the connection stays usable: the next request on it is served.
        raw = await exchange(port, b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\nAuthorization: Bearer ok\r\n"
                                   b"Connection: close\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 401 ") and b"HTTP/1.1 200 " in raw


async def test_an_answer_the_client_never_reads_is_let_go_after_the_write_timeout() -> None:
    big = b"x" * (8 << 20)

    async def handler(request: Request) -> None:
        request.respond(200, [], big)

    async with server(handler=handler, write_timeout_s=0.3) as (port, srv):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            while not srv.connections:
                await asyncio.sleep(0.01)
            async with asyncio.timeout(5):
                while srv.connections:  # aborted rather than held open for the unread answer
                    await asyncio.sleep(0.05)
        finally:
            sock.close()


async def test_nagle_stays_off_towards_clients_unless_asked_for() -> None:
    for nodelay in (True, False):
        async with server(tcp_nodelay=nodelay) as (port, srv):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            while not srv.connections:
                await asyncio.sleep(0.01)
            (conn,) = srv.connections
            sock = conn.transport.get_extra_info("socket")
            assert bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)) is nodelay
            writer.close()
