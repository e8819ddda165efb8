"""The offline simulator in precise mode: routing on the engines' own KV cache events."""

from __future__ import annotations

import orjson
import pytest

from balancer.config import PolicySettings
from balancer.process.cli import main as kvlb
from balancer.routing.precise import PreciseTracker
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.replica.parsing import parse_chat
from loadtest.replica.tokens import block_hashes, token_ids
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.simulator import MODEL, SimulationResult, Simulator

# Chat sessions whose turns extend each other, on replicas whose caches (250 blocks) hold a
# few sessions each: engines evict all along, so a prediction must follow their evictions.
MULTI_TURN = (
    "multi-turn,sessions=24,turns=4,system_tokens=600,user_tokens=80,output_tokens=60,"
    "think_s=3,rate=3"
)
CAPACITY = 4000
BLOCK = 16


def simulate(policy: str, precise: bool = False, **kwargs) -> tuple[Simulator, SimulationResult, dict]:
    sim = Simulator(
        uniform_fleet(4, kv_capacity_tokens=CAPACITY), PolicySettings(name=policy, seed=0),
        precise=precise, **kwargs,
    )
    result = sim.run(load_workload(MULTI_TURN).requests)
    return sim, result, summarize(result.records, result.duration_s, replicas=result.replicas)


@pytest.fixture(scope="module")
def precise() -> tuple[Simulator, SimulationResult, dict]:
    return simulate("cache_aware", precise=True)


def test_precise_predictions_are_the_engines_hits_within_a_block(precise):
    sim, result, summary = precise
    assert isinstance(sim.tracker, PreciseTracker) and result.precise
    assert summary["errors"] == 0
    evicted = sum(node.engine.cache.evicted_blocks_total for node in sim.nodes.values())
    assert evicted > 1000 and sim.kv_events.stats.removed_blocks == evicted
    assert summary["predicted_within_one_block"] >= 0.95  # 1.0 at the time of writing
    _, _, approximate = simulate("cache_aware")
    # Estimating tokens from characters and guessing evictions misses far more often.
    assert approximate["predicted_within_one_block"] < summary["predicted_within_one_block"]


def test_precise_routing_finds_far_more_cache_than_random(precise):
    _, _, summary = precise
    _, _, random = simulate("random")
    assert summary["cache_hit_ratio"] > random["cache_hit_ratio"] + 0.1


def test_a_policy_blind_to_the_prompt_predicts_nothing():
    sim, result, summary = simulate("random", precise=True)
    assert sim.tracker is None and not result.precise
    assert summary["predicted_within_one_block"] is None
    assert all(r.predicted_cached_tokens is None for r in result.records)


def test_the_exact_index_lists_what_each_engine_caches(precise):
    sim, _, _ = precise
    index = sim.tracker.exact
    stats = sim.kv_events.stats
    assert stats.gaps == stats.unknown_parent == stats.ignored == 0
    for name, node in sim.nodes.items():
        assert index.entries_of(name) == node.engine.cache.cached_blocks > 0
    # Block for block: every prompt's cached prefix, as the engine and as the index see it.
    checked = 0
    for request in load_workload(MULTI_TURN).requests:
        words = parse_chat(request.payload(MODEL)).tokens
        listed = index.match(sim.tracker.hasher.lazy(token_ids(words)))
        for name, node in sim.nodes.items():
            cached, _ = node.engine.cache.match(block_hashes(words, BLOCK))
            assert listed.get(name, 0) == cached
            checked += cached > 0
    assert checked > 10


def test_events_reach_the_index_no_sooner_than_their_iteration_ends():
    sim = Simulator(uniform_fleet(2, kv_capacity_tokens=CAPACITY), PolicySettings(name="cache_aware", seed=0),
                    precise=True)
    apply = sim.kv_events.apply
    early: list[tuple[str, float, float]] = []

    def watched(replica, events):
        # The fleet has no network delay: a batch lands when its iteration ends, before the
        # engine starts the next one.
        busy_until = sim.nodes[replica].engine.busy_until
        if sim.now < busy_until:
            early.append((replica, sim.now, busy_until))
        apply(replica, events)

    sim.kv_events.apply = watched
    sim.run(load_workload(MULTI_TURN).requests[:40])
    assert sim.kv_events.stats.batches > 20
    assert early == []


def test_decode_runs_change_nothing_in_precise_mode_either(precise):
    _, fast, _ = precise
    _, slow, _ = simulate("cache_aware", precise=True, decode_runs=False)
    assert fast.decode_runs > 0 and fast.events < slow.events
    for a, b in zip(fast.records, slow.records, strict=True):
        assert (a.replica, a.cached_tokens, a.predicted_cached_tokens) == (b.replica, b.cached_tokens, b.predicted_cached_tokens)
        assert a.ttft_s == pytest.approx(b.ttft_s, abs=1e-9)


def test_a_flushed_cache_leaves_the_index_at_once():
    sim, _, _ = simulate("cache_aware", precise=True)
    held = {name: sim.tracker.exact.entries_of(name) for name in sim.nodes}
    flushed = max(held, key=held.__getitem__)
    sim.flush_cache(flushed)
    sim.run([])  # delivers anything still on its way
    assert sim.kv_events.stats.cleared == 1
    assert sim.nodes[flushed].engine.cache.cached_blocks == 0
    assert sim.tracker.exact.entries_of(flushed) == 0
    assert {name: sim.tracker.exact.entries_of(name) for name in sim.nodes if name != flushed} == {
        name: count for name, count in held.items() if name != flushed
    }


def test_simulate_precise_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "run"
    assert kvlb(["simulate", "--workload", MULTI_TURN, "--replicas", "4", "--kv-capacity-tokens",
                 str(CAPACITY), "--precise", "--out", str(out), "--no-progress"]) == 0
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["precise"] is True and summary["predicted_within_one_block"] >= 0.95
    first = orjson.loads((out / "requests.jsonl").read_bytes().splitlines()[0])
    assert first["predicted_cached_tokens"] == 0  # nothing cached anywhere yet
    assert "predictive (precise)" in capsys.readouterr().out


def test_compare_refuses_precise_live_runs(tmp_path, capsys):
    assert kvlb(["compare", "--workload", MULTI_TURN, "--live", "--precise", "--out", str(tmp_path)]) == 2
    assert "--precise is offline only" in capsys.readouterr().err
