"""Outlier ejection: what one client can make kvlb believe about a replica.

A 500 may be the request's fault (a body the engine chokes on), so 500s eject a replica only
when several clients see them; a replica's own faults (no connection, no answer, 502, 503,
504) eject it whoever meets them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest

from loadtest.procs import free_port
from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    Kvlb,
    RawConn,
    bearer,
    chat_body,
    replica,
    scrape,
    sim_replicas,
    start_kvlb,
    under_attack,
)
from tests.abuse.upstreams import (
    RawUpstream,
    UpstreamRequest,
    chat_handler,
    error_json,
    hang,
    response_bytes,
    status_handler,
)

HEALTH = {
    "eject_after_failures": 3,
    "success_rate_window_s": 30,
    "success_rate_min_requests": 10,
    "success_rate_min_clients": 3,
    "success_rate_threshold": 0.5,
}


def poisoned():  # noqa: ANN201
    """500 for any body that mentions "poison", a normal answer for the rest."""
    answer = chat_handler()

    async def handle(request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
        if b"poison" in request.body:
            writer.write(response_bytes(500, error_json(500), reason="Internal Server Error"))
        else:
            await answer(request, writer)

    return handle


async def send_all(conns: list[tuple[RawConn, list[tuple[str, str]]]], body: bytes, rounds: int) -> Counter:
    """`rounds` requests from each client, taking turns."""
    statuses: Counter = Counter()
    for _ in range(rounds):
        for conn, headers in conns:
            statuses[(await conn.request("POST", CHAT, body, headers)).status] += 1
    return statuses


@pytest.mark.parametrize("identity", ["address", "key"])
async def test_one_client_provoking_500s_does_not_eject_the_replica(kvlb, upstream, identity) -> None:
    flaky = upstream(poisoned())
    auth = {"auth": {"api_keys": ["good-key", "attacker-key"]}} if identity == "key" else {}
    k = kvlb({"replicas": [replica(flaky.url, "flaky", "raw-model")], "health": HEALTH, **auth})
    good = GoodClient(k.port, model="raw-model", api_key="good-key" if auth else None)
    async with under_attack(k, good):
        # One client: its own address, or its own key (from the good client's address).
        attacker = await RawConn.open(k.port, source="127.0.0.2" if identity == "address" else "127.0.0.1")
        headers = [JSON, bearer("attacker-key")] if auth else [JSON]
        statuses = await send_all([(attacker, headers)], chat_body("raw-model", content="poison"), 50)
        attacker.close()
        metrics = await scrape(k.port)
        assert metrics.value("kvlb_replica_ejections_total", replica="flaky") == 0, (
            f"one client's 500s ejected the replica; that client got {dict(statuses)}")
        assert metrics.value("kvlb_replica_breaker_state", replica="flaky") == 0
        assert statuses == {500: 50}, dict(statuses)


@pytest.mark.parametrize("identity", ["addresses", "keys"])
async def test_500s_seen_by_several_clients_eject_the_replica(kvlb, upstream, sim, identity) -> None:
    broken = upstream(status_handler(500), models=("broken",))
    keys = ["key-a", "key-b", "key-c"]
    auth = {"auth": {"api_keys": [*keys, "good-key"]}} if identity == "keys" else {}
    k = kvlb({"replicas": [replica(broken.url, "broken", "broken"), *sim_replicas(sim)], "health": HEALTH, **auth})
    good = GoodClient(k.port, api_key="good-key" if auth else None)
    async with under_attack(k, good):
        if identity == "keys":
            clients = [(await RawConn.open(k.port), [JSON, bearer(key)]) for key in keys]
        else:
            clients = [(await RawConn.open(k.port, source=f"127.0.0.{i}"), [JSON]) for i in (2, 3, 4)]
        statuses = await send_all(clients, chat_body("broken"), 4)
        for conn, _ in clients:
            conn.close()
        metrics = await scrape(k.port)
        assert metrics.value("kvlb_replica_ejections_total", replica="broken") >= 1, (
            f"a replica answering 500 to three clients stayed in; they got {dict(statuses)}")


FAULTS = {
    "refused": None,
    "timeout": hang,
    "502": status_handler(502),
    "503": status_handler(503),
    "504": status_handler(504),
}


@pytest.fixture(scope="module")
def faulty(sim: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvlb]:
    """One replica per fault, each serving a model of its own."""
    servers: list[RawUpstream] = []
    try:
        replicas = []
        for kind, handler in FAULTS.items():
            if handler is None:
                url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            else:
                server = RawUpstream(handler, models=(f"fault-{kind}",))
                servers.append(server.start())
                url = server.url
            replicas.append(replica(url, f"fault-{kind}", f"fault-{kind}"))
        k = start_kvlb(tmp_path_factory.mktemp("faulty"), {
            "replicas": [*replicas, *sim_replicas(sim)],
            "timeouts": {"first_byte_s": 0.5},
            "health": HEALTH,
        })
        try:
            yield k
        finally:
            k.stop()
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize("kind", list(FAULTS))
async def test_a_replica_failing_on_its_own_is_ejected_whoever_meets_it(faulty, kind) -> None:
    async with under_attack(faulty, GoodClient(faulty.port)):
        conn = await RawConn.open(faulty.port)
        statuses = await send_all([(conn, [JSON])], chat_body(f"fault-{kind}"), HEALTH["eject_after_failures"])
        conn.close()
        metrics = await scrape(faulty.port)
        name = f"fault-{kind}"
        assert metrics.value("kvlb_replica_ejections_total", replica=name) >= 1, (
            f"{HEALTH['eject_after_failures']} faults in a row ({kind}) did not eject it: {dict(statuses)}")
        assert metrics.value("kvlb_replica_breaker_state", replica=name) == 1
