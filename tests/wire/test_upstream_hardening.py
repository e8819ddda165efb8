"""The replica client refuses heads it cannot trust and never reuses a connection whose framing
is in doubt: what a replica writes in its head reaches clients, so a lenient parse would let a
broken or hostile replica inject header lines or split one answer into two."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from balancer.wire.client import MAX_HEAD_BYTES, MAX_INTERIM_RESPONSES, UpstreamError, UpstreamPool
from tests.wire.test_upstream_client import fetch, raw_server, request_length, serving

GOOD = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@asynccontextmanager
async def catching(errors: list[dict[str, Any]]) -> AsyncIterator[None]:
    """Collect what reaches the loop's exception handler: a bad answer must come back to the
    caller as UpstreamError, not escape data_received and only be logged."""
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        yield
    finally:
        loop.set_exception_handler(old)


async def bad_then_good(bad: bytes) -> None:
    """`bad` is refused, and the next request goes on a fresh connection, not the one that
    carried the bad answer."""
    async with raw_server(lambda n: [bad] if n == 1 else [GOOD]) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        with pytest.raises(UpstreamError):
            await fetch(pool, url)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        assert stats["connections"] == 2
        pool.close()


@pytest.mark.parametrize("bad", [
    # A bare LF ends a line for lenient parsers downstream: the Set-Cookie would be the replica's.
    b"HTTP/1.1 200 OK\r\nX-A: a\nSet-Cookie: session=evil\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-A: a\rSet-Cookie: session=evil\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-A: a\x01b\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-A: a\x7fb\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-A: ok\n\r\nContent-Length: 2\r\n\r\nok",  # LF hidden by strip()
    b"HTTP/1.1 200 OK\nSet-Cookie: session=evil\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-A : a\r\nContent-Length: 2\r\n\r\nok",  # space before the colon
    b"HTTP/1.1 200 OK\r\nX(A): a\r\nContent-Length: 2\r\n\r\nok",  # not a token
    b"HTTP/1.1 200 OK\r\n: a\r\nContent-Length: 2\r\n\r\nok",  # empty name
    b"HTTP/1.1 200 OK\r\nX-\xe9: a\r\nContent-Length: 2\r\n\r\nok",  # obs-text is for values only
    b"HTTP/1.1 100 Continue\r\nX-A: a\nX-B: b\r\n\r\n" + GOOD,  # interim heads are checked too
], ids=["lf-injection", "cr-injection", "nul", "ctl", "del", "lf-at-end", "lf-in-status-line",
        "space-before-colon", "non-token-name", "empty-name", "obs-text-name", "lf-in-interim"])
async def test_bad_header_lines_are_refused_and_the_connection_dropped(bad: bytes) -> None:
    await bad_then_good(bad)


@pytest.mark.parametrize("status_line", [
    b"HTTP/1.1 000 Zero", b"HTTP/1.1 099 Low", b"HTTP/1.1 600 High", b"HTTP/1.1 20 OK",
    b"HTTP/1.1 2000 OK", b"HTTP/1.1 " + b"2" * 20 + b" OK", b"HTTP/1.1x 200 OK",
    b"HTTP/1.1 200 O\x00K", b"HTTP/1.1 200 O\x1bK",
])
async def test_bad_status_lines_are_refused(status_line: bytes) -> None:
    await bad_then_good(status_line + b"\r\nContent-Length: 2\r\n\r\nok")


async def test_valid_edges_of_the_grammar_pass() -> None:
    # Reasons may be empty, missing, or carry tabs and obs-text; values may carry obs-text and
    # a Content-Length may be a list of one repeated value (RFC 9110 §8.6).
    heads = [b"HTTP/1.1 200\r\n", b"HTTP/1.1 599 \r\n", b"HTTP/1.1 200 O\tk \xe9\r\n"]
    answers = [head + b"X-A: \xe9 \t v\t\r\nContent-Length: 2, 2\r\n\r\nok" for head in heads]
    async with raw_server(lambda n: [answers[(n - 1) % 3]]) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        got = [await fetch(pool, url) for _ in heads]
        assert [(s, b) for s, b, _ in got] == [(200, b"ok"), (599, b"ok"), (200, b"ok")]
        assert got[0][2]["X-A"] == "\xe9 \t v"  # inner whitespace kept, the ends trimmed
        assert stats["connections"] == 1
        pool.close()


async def test_lf_only_head_fails_at_once() -> None:
    # Not at the first-byte timeout: no CRLF CRLF is ever coming.
    lf_only = b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok"
    async with raw_server(lambda n: [lf_only]) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        with pytest.raises(UpstreamError, match="bare LF"):
            await asyncio.wait_for(fetch(pool, url), 1.0)
        pool.close()


async def test_head_over_the_limit_is_refused_even_when_it_arrives_whole() -> None:
    filler = b"X-Fill: " + b"a" * 1000 + b"\r\n"
    small = b"HTTP/1.1 200 OK\r\n" + filler * 60 + b"Content-Length: 2\r\n\r\nok"
    big = b"HTTP/1.1 200 OK\r\n" + filler * 100 + b"Content-Length: 2\r\n\r\nok"
    assert len(small) < MAX_HEAD_BYTES < len(big)
    async with raw_server(lambda n: [small] if n == 1 else [big]) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        with pytest.raises(UpstreamError, match="head over"):
            await fetch(pool, url)
        pool.close()


async def test_interim_heads_count_toward_the_head_limit() -> None:
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: <" + b"a" * 9000 + b">\r\n\r\n"
    answer = interim * 8 + GOOD
    assert len(interim) < MAX_HEAD_BYTES < len(answer) and 8 < MAX_INTERIM_RESPONSES
    await bad_then_good(answer)


async def test_interim_responses_are_capped() -> None:
    ok = CONTINUE * MAX_INTERIM_RESPONSES + GOOD
    too_many = CONTINUE * (MAX_INTERIM_RESPONSES + 1) + GOOD
    async with raw_server(lambda n: [ok] if n == 1 else [too_many]) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        with pytest.raises(UpstreamError, match="interim"):
            await fetch(pool, url)
        pool.close()


async def test_thousands_of_interim_responses_in_one_read_fail_cleanly() -> None:
    errors: list[dict[str, Any]] = []
    async with catching(errors), raw_server(lambda n: [CONTINUE * 5000 + GOOD]) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        with pytest.raises(UpstreamError, match="interim"):
            await fetch(pool, url)
        pool.close()
        await asyncio.sleep(0.05)
    assert errors == []  # no RecursionError escaping into the loop


async def test_switching_protocols_unasked_is_refused() -> None:
    await bad_then_good(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                        b"Connection: Upgrade\r\n\r\n" + GOOD)


async def test_transfer_encoding_with_content_length_is_read_chunked_then_closed() -> None:
    answer = (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5\r\nhello\r\n0\r\n\r\n")
    async with raw_server(lambda n: [answer]) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        for _ in range(2):
            resp = await pool.request(url, "GET", "/", [], b"", 5.0)
            assert resp.content_length is None
            assert await resp.read(100) == b"hello"
            resp.close()
        assert stats["connections"] == 2
        pool.close()


@pytest.mark.parametrize("coding", [b"gzip", b"xchunked", b"chunked, gzip", b"chunked;x=1"])
async def test_a_final_coding_other_than_chunked_is_refused(coding: bytes) -> None:
    # It could reach the client only under a Transfer-Encoding the client never asked for.
    await bad_then_good(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\nContent-Length: 5\r\n\r\n"
                        b"5\r\nhello\r\n0\r\n\r\n")


async def test_chunked_twice_is_refused() -> None:
    await bad_then_good(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")


async def test_no_body_status_ignores_transfer_encoding() -> None:
    # RFC 9112 §6.3: a 204 ends at its head, whatever the framing headers claim.
    answer = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with raw_server(lambda n: [answer]) as (url, _):
        pool = UpstreamPool(connect_timeout_s=2)
        status, body, _ = await asyncio.wait_for(fetch(pool, url), 2.0)
        assert (status, body) == (204, b"")
        pool.close()


async def test_conflicting_content_lengths_are_refused() -> None:
    await bad_then_good(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!")


async def test_unsolicited_bytes_on_an_idle_connection_drop_it_quietly() -> None:
    errors: list[dict[str, Any]] = []
    async with catching(errors), raw_server(lambda n: [GOOD, b"HTTP/1.1 200 OK\r\n"],
                                            gap_s=0.05) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        await asyncio.sleep(0.2)  # the stray bytes reach the connection while it is idle
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        assert stats["connections"] == 2
        pool.close()
    assert errors == []


@asynccontextmanager
async def hold_server(release: asyncio.Event) -> AsyncIterator[tuple[str, dict]]:
    """Answers `/hold` with its head and half the body, the rest once `release` is set, and
    `/` at once; counts connections and the ones the client closed."""
    stats: dict[str, Any] = {"connections": 0, "closed_by_client": 0, "eof": asyncio.Event()}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(request_length(head))
                if head.startswith(b"GET /hold "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
                    await release.wait()
                    writer.write(b"cd")
                else:
                    writer.write(GOOD)
                await writer.drain()
        except asyncio.IncompleteReadError:
            stats["closed_by_client"] += 1
            stats["eof"].set()

    async with serving(handle) as url:
        yield url, stats


async def test_forget_closes_idle_connections_and_drops_the_pool() -> None:
    async with hold_server(asyncio.Event()) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        pool.forget("http://127.0.0.1:1")  # never seen: nothing to do
        assert url in pool._pools
        pool.forget(url)
        assert url not in pool._pools
        await asyncio.wait_for(stats["eof"].wait(), 1.0)
        assert stats["closed_by_client"] == 1
        # Should the replica come back, its URL gets a fresh pool.
        assert (await fetch(pool, url))[:2] == (200, b"ok")
        assert stats["connections"] == 2 and url in pool._pools
        pool.close()


async def test_forget_closes_a_busy_connection_when_its_request_ends() -> None:
    release = asyncio.Event()
    async with hold_server(release) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        resp = await pool.request(url, "GET", "/hold", [], b"", 5.0)
        pool.forget(url)
        release.set()
        assert await resp.read(10) == b"abcd"
        resp.close()  # fully read: without forget this would go back to the pool
        await asyncio.wait_for(stats["eof"].wait(), 1.0)
        assert url not in pool._pools
        pool.close()


async def test_connection_options_are_tokens_not_substrings() -> None:
    answer = b"HTTP/1.1 200 OK\r\nConnection: x-no-close\r\nContent-Length: 2\r\n\r\nok"
    async with raw_server(lambda n: [answer]) as (url, stats):
        pool = UpstreamPool(connect_timeout_s=2)
        for _ in range(2):
            assert (await fetch(pool, url))[:2] == (200, b"ok")
        assert stats["connections"] == 1  # kept alive: "x-no-close" is not "close"
        pool.close()
