"""Request bodies: what an upload can make kvlb hold, and for how long."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    MiB,
    RawConn,
    bytes_in_transit,
    connected_socket,
    parse_answer,
    request_bytes,
    scrape,
    sim_replicas,
    under_attack,
    wait_until,
)

UPLOADS = 8
MAX_BODY = 32 * MiB  # limits.max_body_bytes' default


def chunks(count: int, size: int = MiB) -> Iterator[bytes]:
    piece = b"%x\r\n%b\r\n" % (size, b" " * size)
    for _ in range(count):
        yield piece


async def upload(port: int, head: bytes, pieces: Iterator[bytes], then_close: bool) -> tuple[bytes | None, bool]:
    """Send `head` and `pieces` on a raw socket; returns what kvlb answered (None: nothing)
    and whether kvlb cut the upload off before it was all sent. With `then_close` the client
    closes as soon as kvlb has read everything, without waiting for an answer."""
    loop = asyncio.get_running_loop()
    sock = await connected_socket(port)
    client_port = sock.getsockname()[1]
    cut = False
    try:
        try:
            await loop.sock_sendall(sock, head)
            for piece in pieces:
                await loop.sock_sendall(sock, piece)
        except OSError:
            cut = True
        if then_close:
            # Everything sent has reached kvlb's memory, not just the kernel's buffers.
            await wait_until(lambda: bytes_in_transit(port, client_port) == 0, 10, "kvlb reads the upload")
            return None, cut
        return await _read_to_close(loop, sock), cut
    finally:
        sock.close()


async def _read_to_close(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes | None:
    # Plain recv: an answer the kernel holds is read even when a reset follows it.
    out = bytearray()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(5):
            while data := await loop.sock_recv(sock, 65536):
                out += data
    return bytes(out) or None


async def test_uploads_aborted_just_before_the_limit_free_their_memory(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim)})
    head = request_bytes("POST", CHAT, headers=[JSON, ("Content-Length", str(MAX_BODY))], length=False)
    async with under_attack(k, GoodClient(k.port)) as watch:
        body = b" " * (31 * MiB)
        await asyncio.gather(*(upload(k.port, head, iter([body]), then_close=True) for _ in range(UPLOADS)))
        watch.sample()


async def test_chunked_uploads_past_the_limit_get_413_and_free_their_memory(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim)})
    head = request_bytes("POST", CHAT, headers=[JSON, ("Transfer-Encoding", "chunked")], length=False)
    async with under_attack(k, GoodClient(k.port)) as watch:
        results = await asyncio.gather(
            *(upload(k.port, head, chunks(MAX_BODY // MiB + 8), then_close=False) for _ in range(UPLOADS)))
        watch.sample()
        for answer, cut in results:
            # kvlb closes with the client's bytes unread, so the kernel may reset the
            # connection before its 413 arrives; when it does arrive, it is a 413.
            assert cut or answer is not None, "kvlb took a chunked body past limits.max_body_bytes"
            if answer:
                assert (await parse_answer(answer)).status == 413, answer[:300]
        # Declared over the limit and sent anyway: refused on the head, never read.
        over = request_bytes("POST", CHAT, headers=[JSON, ("Content-Length", str(MAX_BODY + MiB))], length=False)
        results = await asyncio.gather(
            *(upload(k.port, over, chunks(MAX_BODY // MiB + 1), then_close=False) for _ in range(UPLOADS)))
        watch.sample()
        assert all(cut for _, cut in results), "kvlb read a body whose declared length is over the limit"


async def test_uploads_with_broken_chunked_framing_get_400_and_free_their_memory(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim)})
    head = request_bytes("POST", CHAT, headers=[JSON, ("Transfer-Encoding", "chunked")], length=False)

    def broken() -> Iterator[bytes]:
        yield from chunks(31)
        yield b"zz\r\n"

    async with under_attack(k, GoodClient(k.port)) as watch:
        results = await asyncio.gather(*(upload(k.port, head, broken(), then_close=False) for _ in range(UPLOADS)))
        watch.sample()
        for answer, _ in results:
            assert answer is not None, "kvlb did not answer a broken chunk size"
            assert (await parse_answer(answer)).status == 400, answer[:300]


async def test_request_bodies_beyond_the_buffer_budget_are_refused_before_they_are_sent(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim), "limits": {"max_buffered_bytes": 8 * MiB}})
    head = request_bytes("POST", CHAT, headers=[JSON, ("Content-Length", str(3 * MiB))], length=False)
    async with under_attack(k, GoodClient(k.port)):
        slow = [await RawConn.open(k.port) for _ in range(2)]
        stop = asyncio.Event()

        async def drip() -> None:
            # Whitespace is valid JSON: these bodies stay well-formed, just slow.
            for conn in slow:
                await conn.send(head + b'{"model": "sim-model", "messages": [')
            while not stop.is_set():
                for conn in slow:
                    await conn.send(b" " * 64)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        dripping = asyncio.create_task(drip())
        try:
            await asyncio.sleep(0.3)
            third = await RawConn.open(k.port)
            await third.send(head)
            answer = await third.answer_within(2.0, "a 3 MiB upload beside two others under an 8 MiB budget")
            third.close()
            assert answer.status == 503, answer
            assert answer.header("retry-after"), answer.head
            assert answer.error()["code"] == "buffer_budget_exceeded", answer
        finally:
            stop.set()
            await dripping
            for conn in slow:
                conn.close()
        # Closed uploads give their share of the budget back.
        await asyncio.sleep(0.2)
        again = await RawConn.open(k.port)
        answer = await again.request("POST", "/v1/nothing-here", b" " * (3 * MiB), [JSON])
        again.close()
        assert answer.status != 503, answer
        assert (await scrape(k.port)).value("kvlb_client_refusals_total", reason="buffer_budget_exceeded") == 1
