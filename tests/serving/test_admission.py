"""Admission control: bursts wait in a bounded queue, sustained overload gets 429."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import aiohttp
import pytest

from balancer.config import ReplicaSettings
from balancer.errors import ClientError
from balancer.routing.admission import AdmissionQueue
from balancer.routing.fleet import Fleet
from balancer.serving.admission import Admission
from loadtest.compare.stub_replica import make_stub_app
from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, hanging_app

BODY = {"model": "stub-model", "prompt": "x"}


async def test_queue_is_fifo_bounded_and_has_a_deadline() -> None:
    admission = Admission(AdmissionQueue(max_in_flight=1, max_queued=2), queue_timeout_s=0.2)
    await admission.acquire()
    order: list[int] = []

    async def waiter(n: int) -> None:
        await admission.acquire()
        order.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in (1, 2)]
    await asyncio.sleep(0.01)
    with pytest.raises(ClientError) as full:
        await admission.acquire()  # a third waiter: the queue is full
    assert full.value.status == 429 and full.value.retry_after == 1
    admission.release()
    await asyncio.sleep(0.01)
    admission.release()
    await asyncio.gather(*tasks)
    assert order == [1, 2] and admission.in_flight == 1
    with pytest.raises(ClientError):
        await admission.acquire()  # waits 0.2 s for a slot that never comes
    admission.release()
    assert admission.in_flight == 0 and admission.queued == 0


async def test_a_waiter_that_leaves_does_not_leak_its_slot() -> None:
    admission = Admission(AdmissionQueue(max_in_flight=1, max_queued=4), queue_timeout_s=5)
    await admission.acquire()
    leaving = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    admission.release()
    assert admission.in_flight == 0 and admission.queued == 0


async def test_over_max_in_flight_requests_wait_then_get_429() -> None:
    hung = Seen()
    async with AsyncExitStack() as stack:
        slow = await stack.enter_async_context(serve_app(hanging_app(hung)))
        fast = await stack.enter_async_context(serve_app(make_stub_app("fast")))
        settings = make_settings(
            [{"url": slow, "name": "slow", "model": "slow-model"}, {"url": fast, "name": "fast"}],
            limits={"max_in_flight": 1, "max_queued": 1, "queue_timeout_s": 0.3},
        )
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:
            blocker = asyncio.create_task(
                http.post(running.url + "/v1/completions", json={"model": "slow-model", "prompt": "x"})
            )
            while hung.requests == 0:
                await asyncio.sleep(0.01)
            queued = asyncio.create_task(http.post(running.url + "/v1/completions", json=BODY))
            await asyncio.sleep(0.05)
            async with http.post(running.url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 429  # the queue (1) is full
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
            resp = await queued
            assert resp.status == 429  # waited its 0.3 s, no slot came
            # A slot frees: the next request is admitted at once.
            blocker.cancel()
            await asyncio.gather(blocker, return_exceptions=True)
            while running.balancer.in_flight:
                await asyncio.sleep(0.01)
            async with http.post(running.url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200


async def test_requests_wait_for_a_replica_slot_instead_of_failing() -> None:
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(make_stub_app("only", token_delay_s=0.05)))
        settings = make_settings([{"url": url, "name": "only", "max_concurrency": 1}])
        running = await stack.enter_async_context(run_balancer(settings))
        async with aiohttp.ClientSession() as http:

            async def one() -> int:
                body = dict(BODY, stream=True, max_tokens=3)
                async with http.post(running.url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            statuses = await asyncio.gather(*(one() for _ in range(5)))
        assert statuses == [200] * 5  # one at a time on the replica, none refused


async def test_requests_that_gave_up_waiting_for_a_capped_replica_leave_no_trace() -> None:
    fleet = Fleet([ReplicaSettings(url="http://127.0.0.1:9", max_concurrency=1)])
    for _ in range(100):
        with pytest.raises(TimeoutError):
            await fleet.wait_for_room(0.001)
    # Nothing finished meanwhile, yet the waiters that timed out are gone already.
    assert fleet._room_waiters == []
