"""`avoidable_stall_weight`: the stall that a cache elsewhere would have spared a batch,
priced so that a long-answer conversation stays on the replica that holds it."""

from __future__ import annotations

import pytest

from balancer.config import PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.simulator.fleetspec import uniform_fleet
from loadtest.simulator.simulator import simulate
from policies.base import RequestFeatures
from policies.predictive import PredictivePolicy
from tests.fakes import FakeReplica


def _turn() -> tuple[RequestFeatures, FakeReplica, FakeReplica]:
    # The conversation's replica holds 6,000 of its 7,600 tokens and decodes 3 answers; the
    # other holds none of it and decodes 2. Its 1,500-token answer would decode beside one
    # sequence fewer there, which unpriced outweighs prefilling the conversation again.
    home = FakeReplica("home", decoding=3, context_tokens=3 * 7000)
    other = FakeReplica("other", decoding=2, context_tokens=2 * 7000)
    features = RequestFeatures("/v1/chat/completions", stream=True, prompt_tokens=7600,
                               cached_tokens={"home": 6000}, expected_output_tokens=1500,
                               batch_persistence=0.8)
    return features, home, other


def test_a_conversation_stays_where_it_is_cached_when_its_avoidable_stall_is_priced() -> None:
    features, home, other = _turn()
    blind = PredictivePolicy(seed=0, tie_tolerance_ms=0.0, tie_tolerance_ratio=0.0, avoidable_stall_weight=0.0)
    assert blind.rank(features, [home, other])[0].replica is other
    priced = PredictivePolicy(seed=0, tie_tolerance_ms=0.0, tie_tolerance_ratio=0.0, avoidable_stall_weight=0.8)
    ranked = priced.rank(features, [home, other])
    assert ranked[0].replica is home
    # The holder's own prefill is the least there is: nothing of it was avoidable.
    stalls = {c.replica.name: c.terms["decode_ms"] for c in ranked}
    plain = {c.replica.name: c.terms["decode_ms"] for c in blind.rank(features, [home, other])}
    assert stalls["home"] == pytest.approx(plain["home"])
    assert stalls["other"] > plain["other"]


def test_a_prompt_no_replica_holds_is_ranked_as_without_it() -> None:
    # Unique prompts: every candidate would prefill the whole of it, so none of its stall is
    # avoidable and the weight changes no cost.
    replicas = [FakeReplica(f"r{i}", decoding=i, context_tokens=i * 9000, prefill_tokens_queued=500 * i)
                for i in range(4)]
    features = RequestFeatures("/v1/completions", stream=True, prompt_tokens=9000, expected_output_tokens=300)
    costs = [
        {c.replica.name: c.terms["cost"] for c in PredictivePolicy(seed=0, avoidable_stall_weight=w).rank(features, replicas)}
        for w in (0.0, 0.8)
    ]
    assert costs[0] == pytest.approx(costs[1])


def test_long_answer_conversations_keep_their_cache_offline() -> None:
    # 48 conversations of 6 turns, each 25 s after the last, 1,500-token answers: unpriced,
    # a ninth of the follow-ups leave their replica for a smaller batch.
    workload = load_workload("multi-turn,sessions=48,turns=6,output_tokens=1500,think_s=25,rate=2")

    def run(params: dict) -> tuple[float, int]:
        result = simulate(uniform_fleet(8), workload.requests, PolicySettings(name="predictive", params=params, seed=0))
        by_session: dict[str, list] = {}
        for record in sorted(result.records, key=lambda r: r.send_s):
            by_session.setdefault(record.session, []).append(record.replica)
        moved = sum(a != b for replicas in by_session.values()
                    for a, b in zip(replicas, replicas[1:], strict=False))
        return summarize(result.records, result.duration_s)["cache_hit_ratio"], moved

    unpriced_hit, unpriced_moved = run({"avoidable_stall_weight": 0.0})
    priced_hit, priced_moved = run({})  # the default
    assert priced_hit > unpriced_hit + 0.05
    assert priced_moved < unpriced_moved / 2
