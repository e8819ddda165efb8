"""Replicas that answer badly: cut or stalled bodies, and response heads that are not valid
HTTP/1.1. The client gets kvlb's own 502 or 504, never the replica's bytes, and the
replica's fault counts against it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    Kvlb,
    chat_body,
    post,
    replica,
    scrape,
    sim_replicas,
    start_kvlb,
    under_attack,
)
from tests.abuse.upstreams import (
    RawUpstream,
    UpstreamRequest,
    completion,
)

EJECT_AFTER = 3
CUT_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n0123456789"


async def truncated(_request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(CUT_HEAD)
    await writer.drain()
    writer.close()


async def stalled(_request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(CUT_HEAD)
    await writer.drain()
    await asyncio.sleep(3600)


def raw_answer(data: bytes):  # noqa: ANN201
    async def handle(_request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        writer.close()

    return handle


def with_head(status_line: bytes, *headers: bytes) -> bytes:
    body = completion("bad")
    lines = [status_line, b"Content-Type: application/json", *headers, b"Content-Length: %d" % len(body)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


BAD_HEADS = {
    "bare LF smuggling a Set-Cookie": with_head(b"HTTP/1.1 200 OK", b"X-Note: a\nSet-Cookie: evil=1"),
    "NUL in a header value": with_head(b"HTTP/1.1 200 OK", b"X-Note: a\x00evil"),
    "status 000": with_head(b"HTTP/1.1 000 OK"),
    "20-digit status": with_head(b"HTTP/1.1 12345678901234567890 OK"),
    "100 KB head": with_head(b"HTTP/1.1 200 OK", b"X-Pad: " + b"evil" * 25_000),
    "5000 interim answers": b"HTTP/1.1 100 Continue\r\n\r\n" * 5000 + with_head(b"HTTP/1.1 200 OK", b"X-Note: evil"),
}


@pytest.fixture(scope="module")
def bad(sim: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvlb]:
    """A replica per misbehaviour, each serving a model of its own, and the simulated
    replicas for the good client."""
    handlers = {"truncated": truncated, "stalled": stalled}
    handlers.update({f"head-{i}": raw_answer(data) for i, data in enumerate(BAD_HEADS.values())})
    servers: list[RawUpstream] = []
    try:
        replicas = []
        for name, handler in handlers.items():
            server = RawUpstream(handler, models=(name,)).start()
            servers.append(server)
            replicas.append(replica(server.url, name, name))
        k = start_kvlb(tmp_path_factory.mktemp("bad"), {
            "replicas": [*replicas, *sim_replicas(sim)],
            "timeouts": {"stream_idle_s": 1, "first_byte_s": 2},
            "health": {"eject_after_failures": EJECT_AFTER},
        })
        try:
            yield k
        finally:
            k.stop()
    finally:
        for server in servers:
            server.stop()


async def test_a_truncated_body_is_a_502_and_a_fault_of_the_replica(bad) -> None:
    async with under_attack(bad, GoodClient(bad.port)):
        answers = [await post(bad.port, CHAT, chat_body("truncated"), [JSON]) for _ in range(EJECT_AFTER)]
        for answer in answers:
            assert answer.status == 502, answer
            assert answer.error()["code"] == "upstream_failed", answer
        metrics = await scrape(bad.port)
        attempts = metrics.by("kvlb_upstream_attempts_total", "outcome")
        assert metrics.value("kvlb_upstream_attempts_total", replica="truncated", outcome="broken_body") == EJECT_AFTER, (
            attempts)
        assert metrics.value("kvlb_replica_ejections_total", replica="truncated") >= 1
        assert metrics.value("kvlb_replica_breaker_state", replica="truncated") == 1


async def test_a_body_that_stalls_is_a_504_naming_stream_idle_s(bad) -> None:
    async with under_attack(bad, GoodClient(bad.port)):
        answer = await post(bad.port, CHAT, chat_body("stalled"), [JSON], timeout_s=5)
        assert answer.status == 504, answer
        assert "stream_idle_s" in answer.error()["message"], answer


@pytest.mark.parametrize("head", list(BAD_HEADS))
async def test_an_invalid_response_head_is_a_502_and_never_reaches_the_client(bad, head) -> None:
    name = f"head-{list(BAD_HEADS).index(head)}"
    logged = len(bad.log())
    async with under_attack(bad, GoodClient(bad.port)):
        answer = await post(bad.port, CHAT, chat_body(name), [JSON], timeout_s=5)
        leaked = [mark for mark in (b"evil", b"Set-Cookie", b"\x00") if mark in answer.head]
        assert not leaked, f"the replica's head reached the client ({leaked}): {answer.head[:300]!r}"
        assert answer.status == 502, answer
        assert answer.error()["code"] == "upstream_failed", answer
    # A 502 that came out of a crash in the parser is luck, not a defence.
    log = bad.log()[logged:]
    crashed = "Traceback" in log
    assert not crashed, f"kvlb logged a traceback: ...{log[-1200:]}"
