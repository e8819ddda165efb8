"""The decode batch's persistence: how much of the batch a request is sent beside its answer
still decodes beside, learned from answers, bounded, and used by `predictive` so that a
conversation is not moved off the replica holding it for a batch that will be gone."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.admission import AdmissionQueue
from balancer.routing.batch_persistence import (
    MAX_MODELS,
    MIN_SAMPLES,
    BatchPersistence,
    BatchPersistences,
)
from balancer.routing.core import CoreSettings, RoutingCore
from balancer.routing.fleet import Fleet
from balancer.routing.tracker import CacheTracker
from policies.base import RequestFeatures
from policies.predictive import PredictivePolicy
from policies.registry import make_policy
from tests.fakes import FakeReplica

PROMPT = "a prompt of some length " * 200


@pytest.mark.parametrize("slope", [0.0, 0.3, 0.8])
def test_the_slope_of_the_batch_decoded_beside_on_the_batch_sent_to_is_learned(slope: float) -> None:
    rng = random.Random(7)
    fit = BatchPersistence()
    for _ in range(MIN_SAMPLES - 1):
        sent = rng.uniform(-1.0, 1.0)
        fit.observe(sent, 0.4 + slope * sent + rng.gauss(0.0, 0.05))
    assert fit.slope is None  # too few answers yet: the policy keeps the snapshot
    for _ in range(2000):
        sent = rng.uniform(-1.0, 1.0)
        # The whole fleet filling (+0.4) moves every answer's batch alike: not persistence.
        fit.observe(sent, 0.4 + slope * sent + rng.gauss(0.0, 0.05))
    assert fit.slope == pytest.approx(slope, abs=0.03)


def test_the_slope_is_bounded_and_absent_where_the_batches_sent_to_never_differed() -> None:
    steep, inverted, flat = BatchPersistence(), BatchPersistence(), BatchPersistence()
    for i in range(200):
        sent = (i % 7) - 3.0
        steep.observe(sent, 3.0 * sent)
        inverted.observe(sent, -sent)
        flat.observe(0.5, float(i % 3))
    assert steep.slope == 1.0 and inverted.slope == 0.0
    assert flat.slope is None


def test_it_follows_a_change_of_workload() -> None:
    fit = BatchPersistence()
    for i in range(1000):
        sent = (i % 11) - 5.0
        fit.observe(sent, 0.9 * sent)
    for i in range(2000):
        sent = (i % 11) - 5.0
        fit.observe(sent, 0.2 * sent)
    assert fit.slope == pytest.approx(0.2, abs=0.02)


def test_the_fits_by_model_are_bounded() -> None:
    fits = BatchPersistences()
    for m in range(MAX_MODELS + 10):
        fits.observe(f"model-{m}", 1.0, 1.0)
    assert fits.slope("model-0") is None and len(fits._fits) == MAX_MODELS


def _core(names: tuple[str, ...]) -> tuple[RoutingCore, Fleet]:
    fleet = Fleet([ReplicaSettings(url=f"http://127.0.0.1:{9001 + i}", name=name) for i, name in enumerate(names)])
    core = RoutingCore(fleet, make_policy("predictive"), CacheTracker(RoutingSettings(), lambda: 0.0),
                       AdmissionQueue(8, 8), CoreSettings(), call_at=lambda when, cb: None)
    return core, fleet


def test_answers_beside_a_batch_that_drains_teach_the_core_a_low_persistence() -> None:
    # Each answer is sent to a replica with a batch of 20 others beside it, which all end as
    # its first token arrives: it decodes alone. The next request's features say so.
    core, fleet = _core(("r0", "r1"))
    crowded, idle = fleet.replicas
    t = 0.0
    for i in range(MIN_SAMPLES + 20):
        others = []
        for j in range(20):
            other = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=True),
                              f"{PROMPT} other {i} {j}", [crowded])
            core.next_attempt(other, t)
            others.append(other)
        target = crowded if i % 2 else idle  # some sent beside the crowd, some not
        journey = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=True),
                            f"{PROMPT} {i}", fleet.replicas)
        # As a failover would: the attempt goes to `target`, ranked among both.
        journey.ranking = sorted(journey.ranking, key=lambda choice: choice.replica is not target)
        core.next_attempt(journey, t)
        first = t + 0.05
        core.first_byte(journey, first)
        for other in others:
            core.end_attempt(other, answered=False, now=first)
        end = first + 1.0
        core.learned_output(journey, 100, end)
        core.end_attempt(journey, answered=True, now=end)
        t = end + 1.0
    features = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=True),
                         PROMPT, fleet.replicas).features
    assert features.batch_persistence is not None and features.batch_persistence < 0.1


def test_a_batch_that_will_be_gone_does_not_move_a_request_off_its_cached_prompt() -> None:
    # r0 holds the conversation's 6,000 tokens and decodes 6 answers of 4,000-token contexts;
    # r1 is idle and cold. Taken as lasting, the batch outweighs the prefill; learned to be
    # gone before the answer is, it does not.
    core, fleet = _core(("r0", "r1"))
    home, idle = fleet.replicas
    home.decoding, home.context_tokens = 6, 24_000
    features = RequestFeatures("/v1/chat/completions", stream=True, prompt_tokens=6_000,
                               cached_tokens={"r0": 6_000}, max_tokens=1000, expected_output_tokens=400)
    policy = PredictivePolicy(seed=0)
    assert policy.rank(features, fleet.replicas)[0].replica is idle
    assert policy.rank(replace(features, batch_persistence=1.0), fleet.replicas)[0].replica is idle
    assert policy.rank(replace(features, batch_persistence=0.2), fleet.replicas)[0].replica is home
    snapshot = PredictivePolicy(seed=0, learn_batch_persistence=False)
    assert snapshot.rank(replace(features, batch_persistence=0.2), fleet.replicas)[0].replica is idle


def test_a_shared_prompt_still_spreads_to_a_replica_that_would_copy_it() -> None:
    # Three replicas hold an 8k system prompt that requests meet 12 times a second, each
    # decoding 3 answers; a fourth is idle and cold. The prompt's own requests are what its
    # holders decode, so a copy would thin those batches, which no one answer's persistence
    # measures: the cold replica's batch counts as it stands, and it still wins the copy,
    # as it does priced on the snapshot.
    warm = [FakeReplica(f"w{i}", decoding=3, context_tokens=3 * 8200) for i in range(3)]
    cold = FakeReplica("cold")
    features = RequestFeatures("/v1/completions", stream=True, prompt_tokens=8200,
                               cached_tokens={w.name: 8000 for w in warm}, expected_output_tokens=150,
                               prefix_rate=12.0)
    policy = PredictivePolicy(seed=0, tie_tolerance_ms=0.0, tie_tolerance_ratio=0.0)
    assert policy.rank(features, [*warm, cold])[0].replica is cold
    assert policy.rank(replace(features, batch_persistence=0.2), [*warm, cold])[0].replica is cold
    # A prompt met by no one else (a conversation's history) beside bigger batches, 6 each:
    # priced as they stand they push it to the cold replica, whole prefill and all; learned
    # to be gone before its answer is, they do not.
    for replica in warm:
        replica.decoding, replica.context_tokens = 6, 6 * 8200
    private = replace(features, prefix_rate=0.0)
    assert policy.rank(private, [*warm, cold])[0].replica is cold
    assert policy.rank(replace(private, batch_persistence=0.2), [*warm, cold])[0].replica is not cold


def test_a_prompt_met_now_and_then_stays_beside_a_batch_that_will_be_gone() -> None:
    # One of many system prompts (SGLang's shared-prefix benchmark: 64 prompts at 8 requests/s
    # in all), held by one replica decoding 4 answers; a cold replica decodes none and two
    # more decode 2 each. Its own requests are a sliver of what its holder decodes, so a copy
    # would not thin that batch: the cold replica's empty batch is priced as it will persist,
    # the holder's too, and a whole prefill for a batch soon gone is not worth it.
    holder = FakeReplica("holder", decoding=4, context_tokens=4 * 2176)
    cold = FakeReplica("cold")
    others = [FakeReplica(f"o{i}", decoding=2, context_tokens=2 * 2176) for i in range(2)]
    fleet = [holder, cold, *others]
    features = RequestFeatures("/v1/completions", stream=True, prompt_tokens=2176,
                               cached_tokens={"holder": 2048}, expected_output_tokens=256,
                               prefix_rate=0.2, batch_persistence=0.4)
    policy = PredictivePolicy(seed=0, tie_tolerance_ms=0.0, tie_tolerance_ratio=0.0)
    assert policy.rank(features, fleet)[0].replica is holder
    # Met 8 times a second, its requests are most of what its holder decodes: a copy takes
    # them from that batch, so the cold replica's batch counts as it stands, and it wins.
    hot = replace(features, prefix_rate=8.0)
    ranked = policy.rank(hot, fleet)
    assert ranked[0].replica is cold
    snapshot = PredictivePolicy(seed=0, tie_tolerance_ms=0.0, tie_tolerance_ratio=0.0,
                                learn_batch_persistence=False).rank(hot, fleet)
    assert next(c for c in ranked if c.replica is cold).terms["decode_ms"] == pytest.approx(
        next(c for c in snapshot if c.replica is cold).terms["decode_ms"])
