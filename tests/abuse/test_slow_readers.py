"""Clients that stop reading, or leave mid-answer: their own answers end, and nothing they
did is held against the replica that served them."""

from __future__ import annotations

import asyncio

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    RawConn,
    chat_body,
    connected_socket,
    replica,
    request_bytes,
    scrape,
    server_side_open,
    sim_replicas,
    under_attack,
    wait_until,
)
from tests.abuse.upstreams import (
    chat_handler,
)


async def test_clients_that_stop_reading_are_cut_off_without_ejecting_the_replicas(kvlb, upstream) -> None:
    # 16 KiB per event, as fast as kvlb takes them: a stalled client's buffers fill at once.
    big = [upstream(chat_handler(chunk_bytes=16384), models=("big",)) for _ in range(2)]
    k = kvlb({
        "replicas": [replica(server.url, f"big-{i}", "big") for i, server in enumerate(big)],
        # stream_idle_s above client_write_s: the replicas never pause, only the clients do.
        "timeouts": {"client_write_s": 1, "stream_idle_s": 3},
        "health": {"eject_after_failures": 3},
    })
    loop = asyncio.get_running_loop()
    async with under_attack(k, GoodClient(k.port, model="big")):
        stalled = [await connected_socket(k.port, rcvbuf=4096) for _ in range(10)]
        try:
            request = request_bytes("POST", CHAT, chat_body("big", max_tokens=1_000_000, stream=True), [JSON])
            for sock in stalled:
                await loop.sock_sendall(sock, request)
            ports = [sock.getsockname()[1] for sock in stalled]
            await wait_until(lambda: not any(server_side_open(k.port, p) for p in ports), 5,
                             "kvlb closes the connections of clients that stopped reading")
            # ...and lets go of their streams: at most the good client's is still being served.
            await wait_until(lambda: sum(server.active for server in big) <= 1, 3,
                             "the replicas' streams for stalled clients end")
        finally:
            for sock in stalled:
                sock.close()
        metrics = await scrape(k.port)
        ejections = metrics.by("kvlb_replica_ejections_total", "replica")
        breakers = metrics.by("kvlb_replica_breaker_state", "replica")
        attempts = {f"{lab['replica']}/{lab['outcome']}": v
                    for lab, v in metrics.series("kvlb_upstream_attempts_total")}
        assert set(ejections) == {"big-0", "big-1"}, ejections
        assert not any(ejections.values()) and not any(breakers.values()), (
            f"stalled clients ejected replicas: ejections {ejections}, breakers {breakers}, attempts {attempts}")


async def test_a_client_that_leaves_mid_stream_frees_its_replicas_in_flight_slot(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim)})
    good = GoodClient(k.port)
    async with under_attack(k, good):
        for _ in range(3):
            conn = await RawConn.open(k.port)
            await conn.send(request_bytes("POST", CHAT, chat_body(max_tokens=50_000, stream=True), [JSON]))
            await conn.reader.readuntil(b"\r\n\r\n")
            for _ in range(3):
                await conn.reader.readuntil(b"\n\n")  # a few tokens: the stream is under way
            conn.abort()
        async with good.paused():
            in_flight: dict[str, float] = {}

            async def freed() -> bool:
                in_flight.update((await scrape(k.port)).by("kvlb_in_flight_requests", "replica"))
                return not any(in_flight.values())

            for _ in range(40):
                if await freed():
                    break
                await asyncio.sleep(0.05)
            assert not any(in_flight.values()), f"streams whose clients left are still in flight: {in_flight}"
