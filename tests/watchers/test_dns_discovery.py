"""Replica sets from DNS: replicas join and leave as a name's addresses change."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
from aiohttp import web

from balancer.app import start_balancer
from balancer.watchers.dns import member_settings
from loadtest.compare.stub_replica import make_stub_app
from loadtest.procs import free_port
from tests.conftest import TEST_PORT_RANGE, make_settings


@asynccontextmanager
async def stub_at(address: str, port: int, name: str):
    runner = web.AppRunner(make_stub_app(name), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, address, port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def test_replicas_join_and_leave_with_the_dns_answer() -> None:
    port = free_port()  # one port, several loopback addresses: as pods behind a headless service
    answers = {"llm.test": ["127.0.0.2"]}

    async def resolver(host: str, _port: int) -> list[str]:
        if answers.get(host) is None:
            raise OSError("NXDOMAIN")
        return answers[host]

    async with AsyncExitStack() as stack:
        for i, address in enumerate(("127.0.0.2", "127.0.0.3")):
            await stack.enter_async_context(stub_at(address, port, f"pod{i}"))
        settings = make_settings([], replica_sets=[{"host": "llm.test", "port": port, "labels": {"region": "r1"}}],
                                 policy={"name": "round_robin"})
        running = await start_balancer(settings, port=random.randrange(*TEST_PORT_RANGE), resolver=resolver)
        stack.push_async_callback(running.close, 0.5)
        url = f"http://127.0.0.1:{running.port}"

        async def served(n: int = 4) -> set[str]:
            names = set()
            async with aiohttp.ClientSession() as http:
                for _ in range(n):
                    async with http.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "x"}) as r:
                        assert r.status == 200
                        names.add(r.headers["x-kvlb-replica"])
            return names

        assert await served() == {f"llm.test/127.0.0.2:{port}"}
        fleet = running.balancer.fleet
        assert fleet.by_name[f"llm.test/127.0.0.2:{port}"].labels["region"] == "r1"
        answers["llm.test"] = ["127.0.0.2", "127.0.0.3"]
        await running.balancer.dns.refresh_once()
        assert await served() == {f"llm.test/127.0.0.2:{port}", f"llm.test/127.0.0.3:{port}"}
        answers["llm.test"] = None  # DNS fails: nothing changes
        await running.balancer.dns.refresh_once()
        assert len(fleet.replicas) == 2
        answers["llm.test"] = ["127.0.0.3"]
        await running.balancer.dns.refresh_once()
        assert await served() == {f"llm.test/127.0.0.3:{port}"}


def test_ipv6_members_get_bracketed_urls() -> None:
    (replica_set,) = make_settings([], replica_sets=[{"host": "h", "port": 80}]).replica_sets
    member = member_settings(replica_set, "fd00::5")
    assert member.url == "http://[fd00::5]:80" and member.name == "h/[fd00::5]:80"


async def test_members_of_a_replica_set_feed_precise_mode_from_their_event_port() -> None:
    from loadtest.replica.config import ReplicaConfig
    from loadtest.replica.launch import running_replica

    events_port = free_port()

    async def resolver(host: str, _port: int) -> list[str]:
        return ["127.0.0.1"]

    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(running_replica(ReplicaConfig(
            model="sim", time_scale=200, kv_events_endpoint=f"tcp://*:{events_port}")))
        settings = make_settings(
            [], replica_sets=[{"host": "llm.test", "port": replica.port, "kv_events_port": events_port}],
            policy={"name": "cache_aware"}, kv_events={"enabled": True},
        )
        running = await start_balancer(settings, port=random.randrange(*TEST_PORT_RANGE), resolver=resolver)
        stack.push_async_callback(running.close, 0.5)
        (member,) = running.balancer.fleet.replicas
        assert member.settings.kv_events_endpoint == f"tcp://127.0.0.1:{events_port}"
        stats = running.balancer.tracker.events.stats
        async with aiohttp.ClientSession() as http:
            for n in range(100):  # new prompts until the subscription has reached the publisher
                body = {"model": "sim", "prompt": " ".join(f"w{n}x{i}" for i in range(64)), "max_tokens": 2}
                async with http.post(f"http://127.0.0.1:{running.port}/v1/completions", json=body) as r:
                    assert r.status == 200
                if stats.stored_blocks:
                    break
        assert stats.stored_blocks > 0 and member.name in stats.connected
