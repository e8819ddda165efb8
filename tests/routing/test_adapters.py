"""kvlb's account of each replica's LoRA adapter slots, and the routing core keeping it."""

from __future__ import annotations

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.adapters import AdapterDemand, AdapterSlots, unload_choice, unloadable
from balancer.routing.admission import AdmissionQueue
from balancer.routing.core import CoreSettings, RoutingCore
from balancer.routing.fleet import Fleet
from balancer.routing.tracker import CacheTracker
from policies.base import RequestFeatures
from policies.registry import make_policy

ROUTE = "/v1/completions"
PROMPT = "you are the assistant of one product; answer in its own words " * 40


def test_slots_evict_the_least_recently_used_idle_adapter_as_the_engine_does():
    slots = AdapterSlots(2, 500.0)
    assert slots.victim() is None
    slots.started("a")
    slots.started("b")
    slots.ended("a")
    slots.ended("b")
    slots.started("a")  # a is the most recent now
    slots.ended("a")
    assert slots.victim() == "b"
    slots.started("c")
    assert slots.resident() == ["a", "c"] and slots.loads == 3
    # With a request still running on a, the idle one goes even though a is older.
    slots.started("a")
    slots.ended("c")
    assert slots.victim() == "c" and not slots.all_busy()
    slots.started("d")
    assert slots.resident() == ["a", "d"] and slots.all_busy()
    slots.forget()
    assert slots.resident() == [] and slots.victim() is None


def test_room_is_made_by_unloading_the_least_missed_adapter_kvlb_can_load_again():
    demand = AdapterDemand()
    slots = AdapterSlots(1, 500.0, demand)
    for adapter in ["hot"] * 20 + ["warm"] * 3 + ["cold", "rare"]:
        slots.started(adapter)
        slots.ended(adapter)
    holders = {"hot": 1, "warm": 1, "cold": 1, "rare": 3}.get
    everything = {"hot", "warm", "cold", "rare", "theirs"}

    def choice(registered: set[str], spared: set[str] = frozenset()) -> str | None:
        candidates = unloadable(registered, everything - {"theirs"}, spared, slots)
        return unload_choice(candidates, slots, lambda a: holders(a, 1))

    # rare has two other copies; cold none, but it is asked for as rarely, and not in a slot.
    assert choice({"hot", "warm", "cold", "rare"}) == "rare"
    assert choice({"hot", "warm", "cold"}) == "cold"
    assert choice({"hot", "warm"}) == "warm"
    # Not one kvlb could load again, nor one loading, nor one a request of kvlb's runs on.
    assert choice({"hot", "theirs"}) == "hot"
    assert choice({"hot", "warm"}, spared={"warm"}) == "hot"
    slots.started("hot")
    assert choice({"hot", "theirs"}) is None
    slots.ended("hot")
    # Unloaded: out of the slots too.
    slots.unloaded("hot")
    assert not slots.holds("hot") and slots.resident() == []


def test_evicting_costs_a_load_for_a_sought_after_adapter_with_no_other_copy():
    demand = AdapterDemand()
    here, there = AdapterSlots(2, 500.0, demand), AdapterSlots(2, 500.0, demand)
    for _ in range(20):
        here.started("hot")
        here.ended("hot")
    assert here.eviction_cost("hot") == 1.0
    # A second copy elsewhere halves what losing this one costs.
    there.started("hot")
    there.ended("hot")
    assert here.eviction_cost("hot") == 0.5
    # Demand fades with the fleet's later requests for other adapters.
    for i in range(400):
        there.started(f"other-{i % 2}")
        there.ended(f"other-{i % 2}")
    assert demand.holders("hot") == 1  # the other copy was evicted there
    assert here.eviction_cost("hot") < 0.5


def _core(adapters: tuple[str, ...] = ("sql", "chat")) -> tuple[RoutingCore, Fleet]:
    fleet = Fleet([ReplicaSettings(url="http://127.0.0.1:9001", name="r", model="base", adapters=adapters,
                                   max_loras=1, lora_load_ms=300.0)])
    core = RoutingCore(fleet, make_policy("predictive", {}, 0), CacheTracker(RoutingSettings(), lambda: 0.0),
                       AdmissionQueue(8, 8), CoreSettings(), call_at=lambda when, callback: None)
    return core, fleet


def test_a_prompt_cached_under_one_adapter_is_not_cached_for_another_or_the_base():
    core, fleet = _core()
    replica = fleet.replicas[0]
    first = core.plan(ROUTE, RequestFeatures(ROUTE, model="sql"), PROMPT, fleet.replicas)
    assert first.features.adapter == "sql"
    assert core.next_attempt(first, 0.0) is replica
    assert replica.adapter_slots.resident() == ["sql"] and replica.adapter_slots.running("sql") == 1
    core.first_byte(first, 0.1)
    core.end_attempt(first, answered=True)
    assert replica.adapter_slots.running("sql") == 0

    again = core.plan(ROUTE, RequestFeatures(ROUTE, model="sql"), PROMPT, fleet.replicas)
    assert again.ranking[0].terms["cached"] > 0 and again.ranking[0].terms["adapter_ms"] == 0
    other = core.plan(ROUTE, RequestFeatures(ROUTE, model="chat"), PROMPT, fleet.replicas)
    assert other.features.adapter == "chat"
    assert other.ranking[0].terms["cached"] == 0 and other.ranking[0].terms["adapter_ms"] == 300.0
    base = core.plan(ROUTE, RequestFeatures(ROUTE, model="base"), PROMPT, fleet.replicas)
    assert base.features.adapter is None and base.ranking[0].terms["cached"] == 0


def test_adapters_come_from_config_and_from_what_replicas_list_with_a_parent():
    core, fleet = _core(adapters=())
    assert fleet.adapter_of("sql") is None and not fleet.replicas[0].serves("sql")
    fleet.replicas[0].discovered_adapters = frozenset({"sql"})
    fleet.refresh_adapters()
    assert fleet.adapter_of("sql") == "sql" and fleet.replicas[0].serves("sql")
    assert fleet.adapter_of("base") is None and fleet.adapter_of(None) is None


def test_sglangs_base_colon_adapter_names_the_same_adapter():
    core, fleet = _core()
    replica = fleet.replicas[0]
    assert replica.serves("base:sql") and fleet.adapter_of("base:sql") == "sql"
    assert not replica.serves("base:unknown") and not replica.serves("other:sql")
    assert fleet.adapter_of("base:unknown") is None
    first = core.plan(ROUTE, RequestFeatures(ROUTE, model="base:sql"), PROMPT, fleet.replicas)
    assert core.next_attempt(first, 0.0) is replica
    core.end_attempt(first, answered=True)
    # Cached and held under the adapter's name, whichever way the request spelled it.
    again = core.plan(ROUTE, RequestFeatures(ROUTE, model="sql"), PROMPT, fleet.replicas)
    assert again.ranking[0].terms["cached"] > 0 and again.ranking[0].terms["adapter_ms"] == 0


def test_a_load_under_way_is_waited_out_by_whoever_comes_next_until_its_request_answers():
    fleet = Fleet([ReplicaSettings(url=f"http://127.0.0.1:900{i}", name=f"r{i}", model="base", adapters=("sql", "chat"),
                                   max_loras=1, lora_load_ms=500.0) for i in range(2)])
    core = RoutingCore(fleet, make_policy("predictive", {}, 0), CacheTracker(RoutingSettings(), lambda: 0.0),
                       AdmissionQueue(8, 8), CoreSettings(), call_at=lambda when, callback: None)
    loading, idle = fleet.replicas

    def predicted(model: str) -> dict[str, float]:
        journey = core.plan(ROUTE, RequestFeatures(ROUTE, model=model), "a question of its own", fleet.replicas)
        return {c.replica.name: c.terms["model_ttft_ms"] for c in journey.ranking}

    before = predicted("base")
    first = core.plan(ROUTE, RequestFeatures(ROUTE, model="sql"), PROMPT, [loading])
    assert core.next_attempt(first, 0.0) is loading and loading.adapter_slots.loading_ms == 500.0
    # A base-model request too: the engine's iterations stall while it loads.
    during = predicted("base")
    assert during["r0"] >= before["r0"] + 500.0 and during["r1"] == before["r1"]
    assert core.plan(ROUTE, RequestFeatures(ROUTE, model="base"), "another", fleet.replicas).ranking[0].replica is idle
    core.first_byte(first, 0.6)
    assert loading.adapter_slots.loading_ms == 0.0
    # A load whose request failed before answering is over too.
    core.end_attempt(first, answered=True)
    second = core.plan(ROUTE, RequestFeatures(ROUTE, model="sql"), PROMPT, [idle])
    core.next_attempt(second, 1.0)
    assert idle.adapter_slots.loading_ms == 500.0
    core.end_attempt(second, answered=False)
    assert idle.adapter_slots.loading_ms == 0.0
    # Blind to adapters, blind to their loads.
    blind = RoutingCore(fleet, make_policy("predictive", {"adapter_weight": 0}, 0),
                        CacheTracker(RoutingSettings(), lambda: 0.0), AdmissionQueue(8, 8), CoreSettings(),
                        call_at=lambda when, callback: None)
    third = blind.plan(ROUTE, RequestFeatures(ROUTE, model="chat"), PROMPT, [loading])
    blind.next_attempt(third, 2.0)
    assert loading.adapter_slots.loading_ms == 500.0
    looked = blind.plan(ROUTE, RequestFeatures(ROUTE, model="base"), "a question", [loading])
    assert looked.ranking[0].terms["model_ttft_ms"] < 100
