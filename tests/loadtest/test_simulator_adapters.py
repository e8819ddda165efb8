"""LoRA adapters in the offline simulator: engines with adapter slots, requests naming
adapters, and routing that knows which replica holds which."""

from __future__ import annotations

from balancer.config import PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.simulator import Simulator

WORKLOAD = "lora,adapters=16,zipf=1.0,system_tokens=1000,requests=800,rate=10,seed=3"


def run(params: dict) -> tuple[Simulator, dict, int]:
    sim = Simulator(uniform_fleet(4, max_loras=2, lora_load_ms=500), PolicySettings("predictive", params, 0))
    result = sim.run(load_workload(WORKLOAD).requests)
    return sim, summarize(result.records, result.duration_s), result.adapter_loads


def test_knowing_the_slots_loads_fewer_adapters_and_answers_sooner():
    _, blind, blind_loads = run({"adapter_weight": 0})
    sim, aware, aware_loads = run({})
    assert blind["errors"] == aware["errors"] == 0
    assert aware_loads * 1.3 < blind_loads, (aware_loads, blind_loads)
    assert aware["ttft_s"]["p50"] < blind["ttft_s"]["p50"] / 2
    # kvlb's account of each replica's slots follows what the engines did.
    predicted = sum(r.adapter_slots.loads for r in sim.fleet.replicas)
    assert abs(predicted - aware_loads) <= 0.1 * aware_loads, (predicted, aware_loads)
    # Which ones it holds at the end, mostly: the engine refreshes an adapter's place in its
    # order at every iteration it runs in, kvlb when it routes a request there.
    agree = sum(len(set(r.adapter_slots.resident()) & set(sim.nodes[r.name].engine.resident_adapters()))
                for r in sim.fleet.replicas)
    assert agree >= 0.75 * sum(len(sim.nodes[r.name].engine.resident_adapters()) for r in sim.fleet.replicas)


def test_every_request_names_its_adapter_and_only_adapter_replicas_serve_it():
    workload = load_workload(WORKLOAD)
    assert {r.payload()["model"] for r in workload.requests} <= {f"adapter-{i}" for i in range(16)}
    sim = Simulator(uniform_fleet(2), PolicySettings("predictive", {}, 0))  # no slots: no adapters
    result = sim.run(workload.requests[:5])
    assert all(r.status == 404 for r in result.records), [r.status for r in result.records]


def test_two_base_models_each_serve_their_own_adapters():
    from loadtest.simulator.fleetspec import parse_fleet

    fleet = parse_fleet({"groups": [
        {"count": 2, "model": "big", "profile": "llama-3.1-70b-h100-tp4", "max_loras": 2, "lora_load_ms": 200},
        {"count": 2, "model": "small", "max_loras": 2, "lora_load_ms": 200},
    ]})
    workload = load_workload("lora,model=big,prefix=big-,adapters=4,requests=60,rate=4;"
                             "lora,model=small,prefix=small-,adapters=4,requests=60,rate=4")
    sim = Simulator(fleet, PolicySettings("predictive", {}, 0))
    result = sim.run(workload.requests)
    assert [r.status for r in result.records] == [200] * 120
    served_by = {r.name: r.declared_model for r in sim.fleet.replicas}
    adapter_of = {r.index: r.adapter for r in workload.requests}
    for record in result.records:
        assert adapter_of[record.index].startswith(served_by[record.replica] + "-"), record
    # Each adapter is listed under its own base model only.
    assert sim.fleet.base_of("big-0") == "big" and sim.fleet.base_of("small-3") == "small"
