"""The proxy and the offline simulator run one routing core: the same requests, sent one at a
time to the same fleet, go through the same steps with the same decisions, and leave the
same index and load behind after every step.

Live: kvlb on a test port in front of two simulated replicas (the engine model the simulator
runs), requests over HTTP. Offline: the simulator on a fleet of the same two replicas. Each
core is watched step by step; the two records must be equal.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import orjson

from balancer.config import PolicySettings, parse_settings
from balancer.routing.core import RoutingCore
from loadtest.client.workloads import WorkRequest, load_workload
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.simulator import MODEL, Simulator
from tests.conftest import make_settings, run_balancer

STEPS = ("candidates", "plan", "next_attempt", "first_byte", "learn", "learned_output", "answered_text",
         "failed", "held_off", "answered", "end_attempt")
FLOW_STEPS = ("arrive", "saturated", "placed", "done", "expire")
FLOW = {"enabled": True, "trust_headers": True, "default_class": "standard",
        "classes": [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"}]}
REPLICAS = 2
# Small caches, so the sequence also makes the engines evict and the index learn of it.
KV_CAPACITY = 1000
# Shared prefixes (the cache matters) and several rounds (the index is read back).
WORKLOAD = "multi-turn,sessions=4,turns=3,system_tokens=300,user_tokens=60,output_tokens=8,seed=3"


def shown(result: Any) -> Any:
    """A step's result, by name rather than by object."""
    if isinstance(result, list):  # candidates
        return [r.name for r in result]
    if hasattr(result, "ranking"):  # a journey
        return [choice.replica.name for choice in result.ranking]
    if hasattr(result, "url"):  # a replica
        return result.name
    if hasattr(result, "corrected"):  # a lesson
        return (result.predicted, result.actual, result.corrected)
    if isinstance(result, tuple) and result and result[0] in ("go", "wait"):  # flow control's arrive
        return (result[0], len(result[1]), len(result[2]))
    return result


def watch(core: RoutingCore) -> list[tuple[Any, ...]]:
    """Record every step the driver takes, with the state the core leaves after it."""
    steps: list[tuple[Any, ...]] = []
    prompts: list[Any] = []
    tracker = core.tracker
    assert tracker is not None

    flow = core.flow

    def state() -> tuple[Any, ...]:
        load = tuple((r.name, r.in_flight, r.prefill_tokens_queued, r.decoding) for r in core.fleet.replicas)
        index = tuple(tuple(sorted(tracker.predict(p).cached.items())) for p in prompts)
        admitted = flow.in_flight if flow is not None else core.admission.in_flight
        return load, index, admitted, len(core.output_lengths)

    def watched(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if name == "plan":
                prompts.append(args[2])
            result = step(*args, **kwargs)
            # A flow step's ticket: who, which class, and its price in tokens (not its
            # times, which are virtual offline and the loop's live).
            ticket = (args[0].tenant, args[0].klass, round(args[0].cost, 6)) if name in FLOW_STEPS else ()
            steps.append((name, shown(result), *state(), ticket))
            return result

        return run

    for name in STEPS:
        setattr(core, name, watched(name, getattr(core, name)))
    if flow is not None:
        for name in FLOW_STEPS:
            setattr(flow, name, watched(name, getattr(flow, name)))
    return steps


def offline(requests: list[WorkRequest], flow: bool = False) -> list[tuple[Any, ...]]:
    settings = parse_settings({"replicas": [{"url": "http://127.0.0.1:9"}], "flow_control": FLOW}) if flow else None
    sim = Simulator(uniform_fleet(REPLICAS, kv_capacity_tokens=KV_CAPACITY), PolicySettings(name="cache_aware", seed=7),
                    flow=settings)
    steps = watch(sim.core)
    for request in requests:
        # One at a time, as the live side sends them: each starts once the last has ended.
        sim.run([request])
    return steps


async def live(requests: list[WorkRequest], flow: bool = False) -> list[tuple[Any, ...]]:
    async with AsyncExitStack() as stack:
        urls = []
        for _ in range(REPLICAS):
            replica = await stack.enter_async_context(running_replica(
                ReplicaConfig(model=MODEL, kv_capacity_tokens=KV_CAPACITY, time_scale=50.0)
            ))
            urls.append(replica.url)
        settings = make_settings(
            [{"url": url, "name": f"replica-{i}", "model": MODEL} for i, url in enumerate(urls)],
            policy={"name": "cache_aware", "seed": 7}, **({"flow_control": FLOW} if flow else {}),
        )
        kvlb = await stack.enter_async_context(run_balancer(settings))
        core = kvlb.balancer.core
        steps = watch(core)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for request in requests:
            # The simulator prices a request by its body as orjson writes it: the same bytes here.
            headers = {"Content-Type": "application/json"}
            if request.tenant is not None:
                headers["x-kvlb-tenant"] = request.tenant
            if request.priority is not None:
                headers["x-kvlb-priority"] = request.priority
            body = orjson.dumps(request.payload(MODEL, stream=True))
            async with session.post(kvlb.url + request.route, data=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            for _ in range(200):  # the answer is out; the attempt ends just after
                if (core.flow.in_flight if core.flow is not None else core.admission.in_flight) == 0:
                    break
                await asyncio.sleep(0.01)
        return steps


async def test_the_proxy_and_the_simulator_take_the_same_steps_to_the_same_state() -> None:
    requests = load_workload(WORKLOAD).requests
    assert len(requests) == 12
    expected = offline(requests)
    seen = await live(requests)
    # The record shows a fleet at work: both replicas chosen, hits predicted, load counted.
    chosen = {step[1] for step in expected if step[0] == "next_attempt"}
    assert chosen == {"replica-0", "replica-1"}
    assert any(pair[1] > 0 for step in expected for prompt in step[3] for pair in prompt)
    assert any(load[2] > 0 for step in expected for load in step[2])
    assert any(step[0] == "answered_text" for step in expected)  # answers enter the index
    assert len(seen) == len(expected)
    for i, (live_step, offline_step) in enumerate(zip(seen, expected, strict=True)):
        assert live_step == offline_step, f"step {i} differs"


async def test_with_flow_control_both_drivers_take_its_steps_alike() -> None:
    """The same, with flow control on and each request naming a tenant and a class: both
    drivers price each request alike and take the same flow steps around the core's."""
    requests = [dataclasses.replace(r, tenant=f"tenant-{r.index % 2}",
                                    priority="critical" if r.index % 3 == 0 else "standard")
                for r in load_workload(WORKLOAD).requests]
    expected = offline(requests, flow=True)
    seen = await live(requests, flow=True)
    names = [step[0] for step in expected]
    assert names.count("arrive") == names.count("done") == len(requests)
    assert {step[-1][:2] for step in expected if step[0] == "arrive"} == {
        ("tenant-0", "critical"), ("tenant-1", "standard"), ("tenant-0", "standard"), ("tenant-1", "critical")}
    assert len(seen) == len(expected)
    for i, (live_step, offline_step) in enumerate(zip(seen, expected, strict=True)):
        assert live_step == offline_step, f"step {i} differs"
