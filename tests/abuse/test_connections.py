"""Connections: how many one client may hold open, and what becomes of a half-closed one."""

from __future__ import annotations

import asyncio

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    RawConn,
    chat_body,
    get,
    parse_answer,
    request_bytes,
    scrape,
    sim_replicas,
    under_attack,
)

CAP = 20


async def test_connections_over_max_connections_get_503_while_open_ones_keep_working(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim), "limits": {"max_connections": CAP}})
    good = GoodClient(k.port)
    async with under_attack(k, good):
        idle = [await RawConn.open(k.port) for _ in range(CAP)]
        try:
            # The good client holds one of the CAP slots, so one idle connection may be the
            # one refused; the rest stay open, unanswered, as idle connections do.
            ended = await asyncio.gather(*(conn.read_until_closed(0.3) for conn in idle))
            refused = [data for data in ended if data is not None]
            assert len(refused) <= 1, f"{len(refused)} of {CAP} connections under the cap were closed"
            extra = await RawConn.open(k.port)
            data = await extra.read_until_closed(3.0)
            extra.close()
            assert data is not None, f"connection {CAP + 2} was neither answered nor closed within 3 s"
            answer = await parse_answer(data)
            assert answer.status == 503, answer
            assert answer.header("retry-after"), answer.head
            assert answer.error()["code"] == "too_many_connections", answer
        finally:
            for conn in idle:
                conn.close()
        await asyncio.sleep(0.2)
        for _ in range(CAP + 5):
            assert (await get(k.port, "/health")).status == 200, "kvlb did not serve new connections again"
        # Operators see the refusals, by reason.
        refused = (await scrape(k.port)).value("kvlb_client_refusals_total", reason="too_many_connections")
        assert refused >= 1
    assert good.connections == 1, "the good client's keep-alive connection was closed on it"


async def test_a_client_that_half_closes_is_taken_as_gone_and_its_request_stops(kvlb, sim) -> None:
    # TCP cannot tell shutdown(SHUT_WR) from close() until a write fails, and a client that
    # left must free its replica at once: kvlb closes, as nginx does (499), and the request
    # leaves the replica's in-flight count without waiting for its answer.
    k = kvlb({"replicas": sim_replicas(sim)})
    async with under_attack(k, GoodClient(k.port)):
        before = (await scrape(k.port)).value("kvlb_client_disconnects_total")
        for stream in (False, True):
            conn = await RawConn.open(k.port)
            await conn.send(request_bytes("POST", CHAT, chat_body(stream=stream, max_tokens=20000), [JSON]))
            await asyncio.sleep(0.2)  # routed and on its replica
            conn.writer.write_eof()
            data = await conn.read_until_closed(2.0)
            conn.close()
            assert data is not None, "kvlb kept a half-closed connection open"
        deadline = asyncio.get_running_loop().time() + 3.0
        while (after := (await scrape(k.port)).value("kvlb_client_disconnects_total")) - before < 2:
            assert asyncio.get_running_loop().time() < deadline, \
                f"the half-closed clients' requests did not stop: {after - before:g} of 2"
            await asyncio.sleep(0.05)
