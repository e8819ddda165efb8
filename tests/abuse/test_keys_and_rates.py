"""API keys and rate limits: a request without the right to be served costs kvlb nothing,
not its body, not a `100 Continue`, not an admission slot."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    Kvlb,
    MiB,
    RawConn,
    bearer,
    chat_body,
    get,
    post,
    replica,
    request_bytes,
    sim_replicas,
    start_kvlb,
    under_attack,
    wait_until,
)
from tests.abuse.upstreams import (
    UpstreamRequest,
    chat_handler,
)

GOOD_KEY, ATTACKER_KEY, MODELS_KEY = "good-key", "attacker-key", "models-key"
RATE = 5  # requests a second per key, burst as many


@pytest.fixture(scope="module")
def keyed(sim: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvlb]:
    k = start_kvlb(tmp_path_factory.mktemp("keyed"), {
        "replicas": sim_replicas(sim),
        "auth": {"api_keys": [GOOD_KEY, ATTACKER_KEY, MODELS_KEY], "rate_limit_per_s": RATE,
                 "rate_limit_burst": RATE},
    })
    try:
        yield k
    finally:
        k.stop()


def good_client(k: Kvlb) -> GoodClient:
    return GoodClient(k.port, api_key=GOOD_KEY, gap_s=1.5 / RATE)  # under its key's rate


def huge_upload_head(*headers: tuple[str, str]) -> bytes:
    """A 32 MiB upload that waits for `100 Continue` before sending a byte of its body."""
    return request_bytes("POST", CHAT, headers=[JSON, ("Expect", "100-continue"),
                                                ("Content-Length", str(32 * MiB)), *headers], length=False)


async def refused_on_the_head(k: Kvlb, head: bytes, what: str) -> tuple[int, dict]:
    conn = await RawConn.open(k.port)
    try:
        await conn.send(head)
        answer = await conn.answer_within(2.0, what)
    finally:
        conn.close()
    assert not answer.interim, f"{what}: kvlb sent {answer.interim[0]!r} before refusing, inviting the body"
    return answer.status, answer.error()


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-key"], ids=["no key", "wrong key"])
async def test_an_upload_without_a_valid_key_is_refused_before_100_continue(keyed, authorization) -> None:
    headers = [("Authorization", authorization)] if authorization else []
    async with under_attack(keyed, good_client(keyed)):
        status, _ = await refused_on_the_head(keyed, huge_upload_head(*headers), "a 32 MiB upload without a valid key")
        assert status == 401


async def test_an_upload_over_its_keys_rate_is_refused_before_100_continue(keyed) -> None:
    async with under_attack(keyed, good_client(keyed)):
        conn = await RawConn.open(keyed.port)
        statuses = Counter()
        for _ in range(2 * RATE):
            answer = await conn.request("POST", CHAT, b"{}", [JSON, bearer(ATTACKER_KEY)])
            statuses[answer.status] += 1
            if answer.closes:
                conn.close()
                conn = await RawConn.open(keyed.port)
        conn.close()
        assert statuses[429], f"{2 * RATE} quick requests on one key were never rate limited: {statuses}"
        status, error = await refused_on_the_head(
            keyed, huge_upload_head(bearer(ATTACKER_KEY)), "a 32 MiB upload on a key over its rate")
        assert status == 429, error


async def test_listing_models_on_a_rate_limited_key_recovers_as_its_bucket_refills(keyed) -> None:
    async with under_attack(keyed, good_client(keyed)):
        statuses = []
        for _ in range(10):
            statuses.append((await get(keyed.port, "/v1/models", [bearer(MODELS_KEY)])).status)
            await asyncio.sleep(0.5)  # 2 a second, under the key's 5
        assert statuses == [200] * 10, f"GET /v1/models every 0.5 s on a {RATE}/s key: {statuses}"


def slow_chat(delay_s: float):  # noqa: ANN201
    answer = chat_handler()

    async def handle(request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay_s)
        await answer(request, writer)

    return handle


async def test_requests_without_a_valid_key_take_no_admission_slots(kvlb, upstream) -> None:
    slow = upstream(slow_chat(1.0))
    k = kvlb({"replicas": [replica(slow.url, "slow", "raw-model")], "auth": {"api_keys": [GOOD_KEY]},
              "limits": {"max_in_flight": 2, "max_queued": 2}})
    body = chat_body("raw-model")
    keyed = [JSON, bearer(GOOD_KEY)]
    # The keyed requests are the well-behaved client here: with two slots and two places in
    # the queue, another client beside them would take a place of its own.
    async with under_attack(k, None):
        first = [asyncio.create_task(post(k.port, CHAT, body, keyed)) for _ in range(2)]
        await wait_until(lambda: slow.active == 2, 5, "two keyed requests reach the slow replica")

        async def keyless(i: int) -> tuple[int, float]:
            began = time.monotonic()
            headers = [JSON] if i % 2 else [JSON, bearer("not-a-key")]
            answer = await post(k.port, CHAT, body, headers)
            return answer.status, time.monotonic() - began

        refused = [asyncio.create_task(keyless(i)) for i in range(50)]
        later = [asyncio.create_task(post(k.port, CHAT, body, keyed)) for _ in range(2)]
        results = await asyncio.gather(*refused)
        statuses = Counter(status for status, _ in results)
        slowest = max(elapsed for _, elapsed in results)
        assert statuses == {401: 50}, f"50 keyless requests beside a full replica got {dict(statuses)}"
        assert slowest < 0.9, f"the slowest keyless request waited {slowest:.2f} s for its 401"
        served = [answer.status for answer in await asyncio.gather(*first, *later)]
        assert served == [200] * 4, f"keyed requests sent beside them got {served}"
