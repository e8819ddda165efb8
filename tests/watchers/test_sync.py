"""Several kvlb instances routing as one through a real Redis server (balancer/watchers/sync.py)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from loadtest.client.spread import run_spread
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.compare.livefleet import LiveFleet
from loadtest.procs import free_port, stop_process, wait_for_http
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import ReplicaProcess, running_replica
from tests.conftest import make_settings, run_balancer

MODEL = "sim-model"


@contextlib.asynccontextmanager
async def replicas(count: int, time_scale: float = 10.0) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(running_replica(ReplicaConfig(model=MODEL, time_scale=time_scale)))
            for _ in range(count)
        ]
        yield [server.url for server in servers]


def settings(urls: list[str], sync: dict[str, object], policy: str = "cache_aware"):
    return make_settings(
        [{"url": url, "name": f"replica-{i}", "model": MODEL} for i, url in enumerate(urls)],
        policy={"name": policy}, sync=sync, routing={"route_header": True},
    )


@contextlib.asynccontextmanager
async def two_instances(count: int, sync: dict[str, object], policy: str = "cache_aware", time_scale: float = 10.0):
    """Two kvlb instances sharing `sync` state in front of `count` simulated replicas."""
    async with replicas(count, time_scale) as urls, \
            run_balancer(settings(urls, sync, policy)) as a, \
            run_balancer(settings(urls, sync, policy)) as b:
        yield a, b


async def complete(http: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int = 2) -> tuple[int, str | None]:
    status, replica, _ = await complete_explained(http, base, prompt, max_tokens)
    return status, replica


async def complete_explained(
    http: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int = 2
) -> tuple[int, str | None, str | None]:
    """Also the decision's terms (x-kvlb-route), to say why when a test fails."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    async with http.post(base + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvlb-replica"), resp.headers.get("x-kvlb-route")


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_an_instance_routes_where_another_sent_the_prefix(redis_server):
    async with two_instances(4, redis_server.sync_settings()) as (a, b), aiohttp.ClientSession() as http:
        await until(lambda: a.balancer.sync.stats.peers == 1 and b.balancer.sync.stats.peers == 1)
        for n in range(6):
            prompt = f"conversation {n} " + "shared words " * 800
            status, first = await complete(http, a.url, prompt)
            assert status == 200
            # B's index learns that A's replica holds the prompt...
            await until(lambda p=prompt, r=first: b.balancer.tracker.predict(p).cached.get(r, 0) > 0)
            # ...and, a batch later, that A's request there is done: until then B counts its
            # prefill as still queued on that replica.
            await until(lambda: all(r.remote_in_flight == 0 for r in b.balancer.fleet.replicas))
            # Spread over four replicas, yet each follow-up through B finds A's choice.
            status, second, why = await complete_explained(http, b.url, prompt + " and a follow-up")
            assert status == 200 and second == first, (first, why, [
                (r.name, r.in_flight, r.prefill_tokens_queued, r.decoding) for r in b.balancer.fleet.replicas
            ])
        assert a.balancer.sync.stats.published >= 6 and b.balancer.sync.stats.errors == 0


async def test_load_on_a_replica_counts_whichever_instance_routed_it(redis_server):
    fast = redis_server.sync_settings(load_interval_s=0.05, load_ttl_s=0.5)
    async with two_instances(2, fast, "least_load", time_scale=1.0) as (a, b), aiohttp.ClientSession() as http:
        # Two long answers through A: B sees them on the replicas they went to.
        slow = [asyncio.create_task(complete(http, a.url, "x y z", max_tokens=200)) for _ in range(2)]
        await until(lambda: sum(r.remote_in_flight for r in b.balancer.fleet.replicas) == 2)
        assert all(r.in_flight == r.remote_in_flight for r in b.balancer.fleet.replicas)
        # So B's least_load spreads its own requests as if it had routed A's too.
        assert [r.in_flight for r in b.balancer.fleet.replicas] == [1, 1]
        # An instance that stops refreshing its snapshot (it died) drops out within the TTL.
        for task in a.balancer.sync._tasks:
            task.cancel()
        await until(lambda: sum(r.in_flight for r in b.balancer.fleet.replicas) == 0, timeout_s=3)
        assert b.balancer.sync.stats.peers == 0
        for task in slow:
            task.cancel()


async def test_the_context_a_peers_requests_hold_on_a_replica_prices_its_decode_batch_here(redis_server):
    fast = redis_server.sync_settings(load_interval_s=0.05, load_ttl_s=0.5)
    async with two_instances(1, fast, "predictive", time_scale=1.0) as (a, b), aiohttp.ClientSession() as http:
        slow = asyncio.create_task(complete(http, a.url, "a long prompt " * 200, max_tokens=300))
        theirs, mine = a.balancer.fleet.replicas[0], b.balancer.fleet.replicas[0]
        await until(lambda: theirs.context_tokens > 0 and mine.remote_context_tokens == theirs.context_tokens)
        assert mine.context_tokens == theirs.context_tokens  # B has routed nothing itself
        # Predictive prices the batch a request would join there alike on both instances:
        # its time per output token counts that context (4.39e-5 ms a token over 8.3 ms).
        itl = []
        for url, other in ((b.url, theirs), (a.url, mine)):
            _, _, route = await complete_explained(http, url, "short", max_tokens=1)
            assert route is not None
            itl.append(float(route.split("model_itl_ms=")[1].split()[0]))
            # That request reaches the other instance as load in a snapshot that may still be
            # on its way; until a later one replaces it, the other prices one sequence more.
            await asyncio.sleep(3 * fast["load_interval_s"])
            await until(lambda r=other: r.remote_in_flight == 0 and r.remote_decoding == 0)
        assert itl[0] == pytest.approx(itl[1]) and itl[0] > 8.3 + 0.02, itl
        slow.cancel()
        await until(lambda: mine.remote_context_tokens == 0, timeout_s=3)


async def test_a_request_ending_shows_at_peers_within_a_batch_not_a_snapshot(redis_server):
    # Snapshots every 2 s: only the load riding on stream entries can show changes sooner.
    slow_snapshots = redis_server.sync_settings(load_interval_s=2.0, load_ttl_s=6.0)
    async with two_instances(1, slow_snapshots, "least_load", time_scale=1.0) as (a, b), aiohttp.ClientSession() as http:
        replica = b.balancer.fleet.replicas[0]
        await until(lambda: b.balancer.sync.stats.peers == 1, timeout_s=5)
        await asyncio.sleep(2.1)  # just past a snapshot: the next is 2 s away
        request = asyncio.create_task(complete(http, a.url, "x y z", max_tokens=30))
        await until(lambda: replica.remote_in_flight == 1, timeout_s=0.5)
        await request
        await until(lambda: replica.remote_in_flight == 0, timeout_s=0.5)


async def test_no_redis_never_fails_a_request():
    dead = {"redis_url": f"redis://127.0.0.1:{free_port()}/0", "timeout_s": 0.2}
    async with replicas(2) as urls, run_balancer(settings(urls, dead)) as kvlb, aiohttp.ClientSession() as http:
        statuses = [(await complete(http, kvlb.url, f"prompt {i} " * 50))[0] for i in range(20)]
        assert statuses == [200] * 20
        await until(lambda: kvlb.balancer.sync.stats.errors > 0)
        async with http.get(kvlb.url + "/metrics") as resp:
            text = await resp.text()
        assert "kvlb_sync_connected 0.0" in text


async def test_redis_going_away_midway_loses_nothing_and_sync_returns(redis_server):
    if not redis_server.private:
        pytest.skip("needs a private redis-server to stop and restart")
    sync = redis_server.sync_settings(timeout_s=0.2)
    async with two_instances(3, sync) as (a, b), aiohttp.ClientSession() as http:
        await until(lambda: b.balancer.sync.stats.peers == 1)
        sent = 0

        async def traffic(seconds: float) -> list[int]:
            nonlocal sent
            statuses = []
            end = asyncio.get_running_loop().time() + seconds
            while asyncio.get_running_loop().time() < end:
                target = (a, b)[sent % 2]
                statuses.append((await complete(http, target.url, f"request {sent} " * 100))[0])
                sent += 1
            return statuses

        before = await traffic(0.5)
        redis_server.stop()
        during = await traffic(1.5)
        assert not a.balancer.sync.stats.connected and not b.balancer.sync.stats.connected
        redis_server.start()
        await until(lambda: a.balancer.sync.stats.connected and b.balancer.sync.stats.connected, timeout_s=10)
        after = await traffic(0.5)
        assert before + during + after == [200] * sent
        # Routing events flow again: a new prefix through A is known to B.
        prompt = "after the outage " * 400
        status, first = await complete(http, a.url, prompt)
        await until(lambda: b.balancer.tracker.predict(prompt).cached.get(first, 0) > 0)
        await until(lambda: all(r.remote_in_flight == 0 for r in b.balancer.fleet.replicas))
        assert (await complete(http, b.url, prompt + "more"))[1] == first


MULTI_TURN = "multi-turn,sessions=30,turns=4,system_tokens=2000,user_tokens=100,output_tokens=32,think_s=3,rate=3"


async def hit_ratio(fleet: LiveFleet, instances: int, sync: dict[str, object] | None) -> float:
    await fleet.start_replicas()
    targets = [await fleet.start_kvlb("cache_aware", sync=sync, replace=False) for _ in range(instances)]
    try:
        workload = load_workload(MULTI_TURN)
        records, _ = await run_spread(targets, workload.requests, model=MODEL, time_scale=fleet.time_scale, progress=False)
    finally:
        fleet.stop_router()
    summary = summarize(records, 1.0)
    assert summary["errors"] == 0
    return summary["cache_hit_ratio"]


async def test_three_instances_with_sync_route_as_well_as_one(redis_server):
    async with LiveFleet(4, time_scale=10) as fleet:
        single = await hit_ratio(fleet, 1, None)
        synced = await hit_ratio(fleet, 3, redis_server.sync_settings())
        apart = await hit_ratio(fleet, 3, None)
    # Each session's turns reach all three instances in turn; apart, two of three turns are
    # routed by an instance that never saw the conversation.
    print(f"cache-hit ratio: one instance {single:.3f}, three synced {synced:.3f}, three apart {apart:.3f}")
    assert synced >= single * 0.9, (single, synced, apart)
    assert apart < synced - 0.15, (single, synced, apart)


async def test_workers_share_one_port_and_their_state(redis_server):
    async with LiveFleet(2, time_scale=10) as fleet:
        await fleet.start_replicas()
        url = await fleet.start_kvlb("cache_aware", sync=redis_server.sync_settings(), workers=2)
        prompt = "a long shared document " * 600
        served = set()
        for i in range(12):
            # A new connection each time, so the kernel spreads them over both workers.
            async with aiohttp.ClientSession() as http:
                status, replica = await complete(http, url, prompt + f" question {i}")
            assert status == 200
            served.add(replica)
            # The first request's prefill shows in the other worker's view for up to a load
            # interval after it is done; past that, the cached document decides.
            await asyncio.sleep(0.3 if i == 0 else 0.05)
        assert len(served) == 1  # both workers sent the shared document to the same replica
        peers = set()
        for _ in range(12):
            async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
                text = await resp.text()
            peers.update(line for line in text.splitlines() if line.startswith("kvlb_sync_peers"))
        assert peers == {"kvlb_sync_peers 1.0"}


def test_workers_stop_together_on_sigterm(tmp_path):
    port = free_port()
    config = tmp_path / "kvlb.yaml"
    config.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\nreplicas: [{{url: 'http://127.0.0.1:9'}}]\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "balancer", "serve", "--config", str(config), "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        asyncio.run(wait_for_http(f"http://127.0.0.1:{port}/health"))
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        proc.terminate()
        assert proc.wait(timeout=15) == 0
        assert subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).returncode == 1
    finally:
        stop_process(proc)


async def test_the_adapters_a_peer_sent_to_a_replica_fill_its_slots_here(redis_server):
    # Two replicas serving adapters, one slot each. A sends `sql` to one of them; B, which
    # has routed nothing, must know that replica holds `sql` and the other does not.
    args = ["--model", MODEL, "--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "1",
            "--time-scale", "20"]
    fast = redis_server.sync_settings(load_interval_s=0.05)
    with contextlib.ExitStack() as processes:
        urls = [processes.enter_context(ReplicaProcess(args)).url for _ in range(2)]
        config = make_settings([{"url": url, "name": f"replica-{i}", "max_loras": 1, "lora_load_ms": 500}
                                for i, url in enumerate(urls)],
                               policy={"name": "predictive", "seed": 0}, sync=fast, routing={"route_header": True})
        async with run_balancer(config) as a, run_balancer(config) as b, aiohttp.ClientSession() as http:
            await until(lambda: a.balancer.sync.stats.peers == 1 and b.balancer.sync.stats.peers == 1)

            async def send(base: str, adapter: str, prompt: str) -> tuple[str, str]:
                body = {"model": adapter, "prompt": prompt, "max_tokens": 2}
                async with http.post(base + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers["x-kvlb-replica"], resp.headers["x-kvlb-route"]

            holder, _ = await send(a.url, "sql", "the first question")
            other = next(r for r in b.balancer.fleet.replicas if r.name != holder)
            mine = b.balancer.fleet.by_name[holder]
            await until(lambda: mine.adapter_slots.holds("sql"))
            assert not other.adapter_slots.holds("sql") and mine.adapter_slots.loads == 0
            # B prices no load where A's request left `sql`, and sends its own there, with
            # another prompt: not drawn by a cached prefix.
            replica, route = await send(b.url, "sql", "a question of another kind altogether")
            chosen = dict(part.split("=", 1) for part in route.split(";")[0].split()[1:])
            assert replica == holder and float(chosen["adapter_ms"]) == 0, route


async def test_an_adapter_load_a_peers_request_waits_out_is_waited_out_here_too(redis_server):
    # Real time: the replica takes 1.5 s to load an adapter, and kvlb is told so.
    args = ["--model", MODEL, "--enable-lora", "--lora-modules", "sql=/a/sql", "--max-loras", "1",
            "--lora-load-ms", "1500", "--time-scale", "1"]
    fast = redis_server.sync_settings(load_interval_s=0.05, load_ttl_s=0.5)
    with contextlib.ExitStack() as processes:
        url = processes.enter_context(ReplicaProcess(args)).url
        config = make_settings([{"url": url, "name": "replica-0", "lora_load_ms": 1500}],
                               policy={"name": "predictive", "seed": 0}, sync=fast, routing={"route_header": True})
        async with run_balancer(config) as a, run_balancer(config) as b, aiohttp.ClientSession() as http:
            await until(lambda: a.balancer.sync.stats.peers == 1 and b.balancer.sync.stats.peers == 1)
            mine = b.balancer.fleet.replicas[0].adapter_slots
            body = {"model": "sql", "prompt": "a question", "max_tokens": 2}
            loading = asyncio.create_task(http.post(a.url + "/v1/completions", json=body))
            try:
                await until(lambda: mine.loading_ms == 1500)
                base = {"model": MODEL, "prompt": "another question", "max_tokens": 1}
                async with http.post(b.url + "/v1/completions", json=base) as resp:
                    assert resp.status == 200
                    chosen = dict(part.split("=", 1) for part in resp.headers["x-kvlb-route"].split()[1:])
                assert float(chosen["model_ttft_ms"]) >= 1500
                async with await loading as resp:
                    assert resp.status == 200
                await until(lambda: mine.loading_ms == 0, timeout_s=3)
            finally:
                loading.cancel()
