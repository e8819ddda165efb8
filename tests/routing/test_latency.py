"""Each replica's fitted speed: it follows a replica slower or faster than its profile,
resists single outliers, stays bounded, and learns only from streamed first bytes."""

from __future__ import annotations

import math

import pytest

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.admission import AdmissionQueue
from balancer.routing.core import CoreSettings, RoutingCore
from balancer.routing.fleet import Fleet
from balancer.routing.latency import CONFIRMED_EVIDENCE, MAX_SCALE, MIN_SCALE, SHIFT_RUN, LatencyFit
from balancer.routing.tracker import CacheTracker
from policies.base import RequestFeatures
from policies.registry import make_policy

PROMPT = "a prompt of some length " * 200


def test_a_replica_five_times_slower_is_found_within_twenty_answers() -> None:
    fit = LatencyFit()
    for _ in range(20):
        fit.observe(observed_ms=500.0, model_ms=100.0)
    assert 4.0 < fit.scale <= 5.0
    assert fit.samples == 20
    assert fit.last_error == pytest.approx(500.0 / 100.0 / fit.scale, rel=0.3)


def test_a_faster_replica_is_found_too_and_the_error_shrinks_as_it_learns() -> None:
    fit = LatencyFit()
    errors = [fit.observe(50.0, 100.0) for _ in range(30)]
    assert fit.scale == pytest.approx(0.5, rel=0.05)
    assert errors[0] == pytest.approx(0.5)
    assert errors[-1] == pytest.approx(1.0, rel=0.05)


def test_one_outlier_moves_the_fit_by_a_bounded_step() -> None:
    fit = LatencyFit()
    for _ in range(30):
        fit.observe(100.0, 100.0)
    fit.observe(60_000.0, 100.0)  # one request stalled for a minute
    assert fit.scale < 1.51
    for _ in range(10):
        fit.observe(100.0, 100.0)
    assert fit.scale < 1.1


def test_a_run_of_answers_far_off_alone_confirms_a_change_at_once() -> None:
    # A replica that turns five times slower: three answers to requests that found its
    # queue empty are a change, not outliers, and the fit counts as fully taught.
    fit = LatencyFit()
    for _ in range(30):
        fit.observe(100.0, 100.0, confirmable=True)
    for _ in range(SHIFT_RUN - 1):
        fit.observe(500.0, 100.0, confirmable=True)
    assert fit.scale < 1.5 ** 2 and fit.evidence == fit.samples
    fit.observe(500.0, 100.0, confirmable=True)
    assert fit.scale == pytest.approx(5.0, rel=0.01)
    assert fit.evidence >= CONFIRMED_EVIDENCE
    # And back: the replica recovers, and a run the other way brings the fit back to 1.
    for _ in range(SHIFT_RUN):
        fit.observe(100.0, 100.0, confirmable=True)
    assert fit.scale == pytest.approx(1.0, rel=0.01)


def test_a_run_broken_by_an_ordinary_answer_or_taught_under_a_queue_confirms_nothing() -> None:
    broken, queued = LatencyFit(), LatencyFit()
    for i in range(3 * SHIFT_RUN):
        ordinary = i % SHIFT_RUN == SHIFT_RUN - 1
        broken.observe(100.0 if ordinary else 60_000.0, 100.0, confirmable=True)
        if i < SHIFT_RUN:
            queued.observe(500.0, 100.0, confirmable=False)
    # Six outliers in all, never three in a row: six bounded steps at most, not a jump to 600x.
    assert broken.scale <= 1.5 ** 6 and broken.evidence == broken.samples
    # Taught under a queue, the same run is three bounded steps (2.2x), not a jump to 5x.
    assert queued.scale < 2.5 and queued.evidence == queued.samples


def test_answers_that_waited_behind_a_queue_move_the_fit_slowly() -> None:
    # Identical replicas in overload: each answer's wait for KV memory, unseen by the model,
    # swings from 1x to 16x of the prediction. Taught by them, the fit must not chase it.
    swinging, alone = LatencyFit(), LatencyFit()
    seen: dict[str, list[float]] = {"swinging": [], "alone": []}
    for i in range(80):
        swinging.observe(1600.0 if i % 4 == 0 else 100.0, 100.0, queued=True)
        alone.observe(1600.0 if i % 4 == 0 else 100.0, 100.0)
        seen["swinging"].append(swinging.scale)
        seen["alone"].append(alone.scale)
    late = {name: scales[40:] for name, scales in seen.items()}
    assert max(late["swinging"]) / min(late["swinging"]) < 1.2
    assert max(late["alone"]) / min(late["alone"]) > 1.4
    # A wait that lasts (a replica stuck behind long prompts) still shows, within dozens.
    stuck = LatencyFit()
    for _ in range(40):
        stuck.observe(400.0, 100.0, queued=True)
    assert 2.5 < stuck.scale <= 4.0


def test_only_an_attempt_that_found_its_replicas_prefill_queue_empty_may_confirm() -> None:
    now = [0.0]
    core, fleet = _core(now)
    first = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=True), PROMPT, fleet.replicas)
    core.next_attempt(first, 0.0)
    second = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=True), PROMPT + "x",
                       fleet.replicas)
    core.next_attempt(second, 0.0)
    assert first.alone and not second.alone


def test_the_multiplier_stays_inside_its_bounds() -> None:
    slow, fast = LatencyFit(), LatencyFit()
    for _ in range(500):
        slow.observe(1e9, 10.0)
        fast.observe(1e-9, 10.0)
    assert slow.scale == pytest.approx(MAX_SCALE)
    assert fast.scale == pytest.approx(MIN_SCALE)


@pytest.mark.parametrize("observed, model", [(0.0, 100.0), (-5.0, 100.0), (math.inf, 100.0),
                                             (math.nan, 100.0), (100.0, 0.0), (100.0, 0.5)])
def test_samples_that_teach_nothing_are_ignored(observed: float, model: float) -> None:
    fit = LatencyFit()
    assert fit.observe(observed, model) is None
    assert fit.scale == 1.0 and fit.samples == 0


def _core(now: list[float], names: tuple[str, ...] = ("r",)) -> tuple[RoutingCore, Fleet]:
    fleet = Fleet([ReplicaSettings(url=f"http://127.0.0.1:{9001 + i}", name=name) for i, name in enumerate(names)])
    core = RoutingCore(fleet, make_policy("predictive"), CacheTracker(RoutingSettings(), lambda: now[0]),
                       AdmissionQueue(8, 8), CoreSettings(), call_at=lambda when, cb: None)
    return core, fleet


@pytest.mark.parametrize("stream", [True, False])
def test_the_core_fits_a_replica_from_streamed_first_bytes_only(stream: bool) -> None:
    now = [0.0]
    core, fleet = _core(now)
    replica = fleet.replicas[0]
    for i in range(15):
        now[0] = float(i)
        features = RequestFeatures("/v1/completions", stream=stream)
        journey = core.plan("/v1/completions", features, PROMPT + str(i), fleet.replicas)
        assert core.next_attempt(journey, now[0]) is replica
        predicted = journey.model_ttft_ms
        assert predicted > 1.0
        error = core.first_byte(journey, now[0] + 4 * predicted / 1000.0)  # four times slower
        core.end_attempt(journey, answered=True)
        assert (error is not None) == stream
    if stream:
        assert replica.ttft_scale > 3.0 and replica.latency.samples == 15
    else:
        assert replica.ttft_scale == 1.0 and replica.latency.samples == 0
    assert replica.context_tokens == 0 and replica.decoding == 0


def test_the_context_of_decoding_requests_is_counted_while_they_run() -> None:
    now = [0.0]
    core, fleet = _core(now)
    replica = fleet.replicas[0]
    journey = core.plan("/v1/completions", RequestFeatures("/v1/completions"), PROMPT, fleet.replicas)
    core.next_attempt(journey, 0.0)
    assert replica.context_tokens == journey.features.prompt_tokens > 0
    core.first_byte(journey, 0.1)
    assert replica.context_tokens == journey.features.prompt_tokens
    core.end_attempt(journey, answered=True)
    assert replica.context_tokens == 0


@pytest.mark.parametrize("stream, tokens", [(True, 50), (False, 50), (True, 1)])
def test_the_core_fits_decode_speed_from_streamed_answers_of_more_than_one_token(stream: bool, tokens: int) -> None:
    now = [0.0]
    core, fleet = _core(now)
    replica = fleet.replicas[0]
    for i in range(15):
        features = RequestFeatures("/v1/completions", stream=stream)
        journey = core.plan("/v1/completions", features, PROMPT + str(i), fleet.replicas)
        core.next_attempt(journey, float(i))
        first = float(i) + 0.05
        core.first_byte(journey, first)
        per_token_s = 3 * journey.model_itl_ms / 1000.0  # three times slower than predicted
        error = core.learned_output(journey, tokens, first + per_token_s * (tokens - 1))
        core.end_attempt(journey, answered=True)
        assert (error is not None) == (stream and tokens > 1)
    if stream and tokens > 1:
        assert replica.itl_scale > 2.5 and replica.decode_latency.samples == 15
    else:
        assert replica.itl_scale == 1.0 and replica.decode_latency.samples == 0
    assert replica.ttft_scale != 1.0 or not stream  # the other fit is the first bytes'


@pytest.mark.parametrize("batch_grows", [True, False])
def test_an_answer_is_fitted_against_the_batch_it_decoded_beside_not_the_one_it_was_sent_to(
        batch_grows: bool) -> None:
    # A fleet filling up: each answer starts beside an empty batch and decodes beside thirty
    # sequences that arrived after it, at the pace the model gives thirty. That is the
    # model's doing, not a slow replica. The same pace with no one beside it is.
    now = [0.0]
    core, fleet = _core(now)
    replica = fleet.replicas[0]
    _fixed, per_seq_ms, per_context_ms = core.policy_for(None).decode_iteration()
    tokens = 100
    for i in range(15):
        start = 10.0 * i
        features = RequestFeatures("/v1/completions", stream=True)
        journey = core.plan("/v1/completions", features, PROMPT + str(i), fleet.replicas)
        core.next_attempt(journey, start)
        first = start + 0.05
        core.first_byte(journey, first)
        sent_context = replica.context_tokens
        others = []
        for j in range(30):
            other = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=True),
                              f"{PROMPT * 5} {i} {j}", fleet.replicas)
            core.next_attempt(other, first)
            others.append(other)
        grown_ms = journey.model_itl_ms + 30 * per_seq_ms + per_context_ms * (replica.context_tokens - sent_context)
        slower = grown_ms / journey.model_itl_ms
        if not batch_grows:
            for other in others:
                core.end_attempt(other, answered=False, now=first)
        end = first + grown_ms / 1000.0 * (tokens - 1)
        core.learned_output(journey, tokens, end)
        core.end_attempt(journey, answered=True, now=end)
        if batch_grows:
            for other in others:
                core.end_attempt(other, answered=False, now=end)
    assert replica.decode_latency.samples == 15
    if batch_grows:
        assert replica.itl_scale == pytest.approx(1.0, abs=0.02)
    else:
        assert slower > 1.5 and replica.itl_scale == pytest.approx(slower, rel=0.1)


def test_a_first_sample_starts_from_the_fleets_median_not_the_profile() -> None:
    # Replicas sped up tenfold: the fleet's fits sit near 0.1. A newcomer's first answer, as
    # fast as theirs, must put it beside them, not at the 1/1.5 a clipped step from 1.0 gives.
    fit = LatencyFit()
    fit.observe(10.0, 100.0, prior=0.1)
    assert fit.scale == pytest.approx(0.1, rel=0.01)
    later = LatencyFit()
    later.observe(10.0, 100.0)
    assert later.scale == pytest.approx(1 / 1.5)


def test_the_core_gives_a_new_replica_the_fleets_median_fit() -> None:
    now = [0.0]
    core, fleet = _core(now, ("r0", "r1"))
    old, new = fleet.replicas
    for _ in range(30):
        old.latency.observe(10.0, 100.0)
    features = RequestFeatures("/v1/completions", stream=True)
    journey = core.plan("/v1/completions", features, PROMPT, [new])
    core.next_attempt(journey, 0.0)
    core.first_byte(journey, 0.1 * journey.model_ttft_ms / 1000.0)  # as fast as the fleet
    assert new.ttft_scale == pytest.approx(old.ttft_scale, rel=0.05)


def test_a_replica_priced_out_as_slow_is_tried_again_once_its_evidence_fades() -> None:
    now = [0.0]
    core, fleet = _core(now, ("r0", "r1"))
    slow, healthy = fleet.replicas
    for _ in range(20):
        healthy.latency.observe(100.0, 100.0, confirmable=True, now=0.0)
    for _ in range(SHIFT_RUN):
        slow.latency.observe(500.0, 100.0, confirmable=True, now=0.0)
    assert slow.ttft_samples >= CONFIRMED_EVIDENCE
    features = RequestFeatures("/v1/completions", stream=True)
    ranked = core.plan("/v1/completions", features, PROMPT, core.candidates(None, None, 1.0)).ranking
    assert ranked[0].replica is healthy and ranked[1].terms["speed"] > 1.5  # over the two's median
    # Minutes in which only the healthy replica answers: the slow one's fit fades back to
    # the fleet's, and the healthy one's, still taught, does not.
    for t in range(2, 400, 2):
        healthy.latency.observe(100.0, 100.0, confirmable=True, now=float(t))
        core.candidates(None, None, float(t))
    assert slow.ttft_samples == 0 and healthy.ttft_samples > CONFIRMED_EVIDENCE
    ranked = core.plan("/v1/completions", features, PROMPT, core.candidates(None, None, 400.0)).ranking
    assert all(choice.terms["speed"] == 1.0 for choice in ranked)
