"""Plain decode runs applied in one step land on exactly the instants stepping would."""

from __future__ import annotations

import random

import pytest

from loadtest.replica.engine import Engine, EngineConfig, run_until_idle
from loadtest.replica.profiles import get_profile


def arrivals(seed: int, count: int, shared_words: int) -> list[tuple[float, list[str], int]]:
    rng = random.Random(seed)
    shared = [f"s{i}" for i in range(shared_words)]
    out, now = [], 0.0
    for n in range(count):
        now += rng.expovariate(4.0)
        own = [f"r{n}w{i}" for i in range(rng.randint(5, 900))]
        out.append((now, shared + own, rng.randint(1, 300)))
    return out


def outcome(seqs):
    return [(s.request_id, s.cached_tokens, s.first_token_time, s.finish_time, s.num_generated, s.preemptions) for s in seqs]


@pytest.mark.parametrize("capacity", [None, 6_000])  # the second one preempts and evicts
def test_decode_runs_match_stepping(capacity):
    config = EngineConfig(get_profile("llama-3.1-8b-h100"), kv_capacity_tokens=capacity, max_running=32)
    work = arrivals(seed=7, count=120, shared_words=600)
    stepped_engine = Engine(config)
    stepped_seqs, stepped_iterations, stepped_end = run_until_idle(stepped_engine, [(t, list(w), m) for t, w, m in work])
    fast_engine = Engine(config)
    fast_seqs, fast_iterations, fast_end = run_until_idle(fast_engine, [(t, list(w), m) for t, w, m in work], decode_runs=True)
    for fast, stepped in zip(outcome(fast_seqs), outcome(stepped_seqs), strict=True):
        assert fast[:2] == stepped[:2]
        assert fast[2] == pytest.approx(stepped[2], abs=1e-9)
        assert fast[3] == pytest.approx(stepped[3], abs=1e-9)
        assert fast[4:] == stepped[4:]
    assert fast_end == pytest.approx(stepped_end, abs=1e-9)
    # The runs did replace most iterations, and the engine counted every one of them.
    assert len(fast_iterations) < len(stepped_iterations) / 3
    assert fast_engine.counters == stepped_engine.counters
    assert fast_engine.cache.cached_blocks == stepped_engine.cache.cached_blocks
    assert fast_engine.cache.evicted_blocks_total == stepped_engine.cache.evicted_blocks_total
    if capacity is not None:
        assert stepped_engine.counters.preemptions > 0 and stepped_engine.cache.evicted_blocks_total > 0
