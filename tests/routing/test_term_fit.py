"""Each term of a replica's predicted times fitted apart: it finds a card that departs from
its profile in shape (an H200's attention against an H100 profile), leaves the terms alone
where the traffic cannot tell them apart, resists outliers, stays bounded, and learns in the
routing core only from streamed answers that waited for no one else's prefill."""

from __future__ import annotations

import math
import random

import pytest

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.admission import AdmissionQueue
from balancer.routing.core import CoreSettings, RoutingCore
from balancer.routing.fleet import Fleet
from balancer.routing.term_fit import ITL_RIDGE, MAX_SHAPE, MIN_SHAPE, TTFT_RIDGE, TermFit
from balancer.routing.tracker import CacheTracker
from policies.base import MODEL_TTFT_PARTS, RequestFeatures
from policies.registry import make_policy

# Prefill terms of an H100 profile (docs/calibration.md) for a prompt of n tokens, alone.
A, B, K = 5.3, 0.0191, 7.4e-7


def parts(n: int) -> tuple[float, float, float]:
    return (1.5 + n / 8192) * A, n * B, K * n * n / 2


def h200_ms(n: int) -> float:
    # The same prompt on an H200: fixed 4.0 ms, 0.0210 ms per token, attention 1.9e-7.
    return (1.5 + n / 8192) * 4.0 + n * 0.0210 + 1.9e-7 * n * n / 2


def test_a_card_of_another_shape_is_found_term_by_term() -> None:
    fit = TermFit(TTFT_RIDGE)
    rng = random.Random(0)
    for _ in range(80):
        n = rng.randint(500, 32_000)
        assert fit.observe(h200_ms(n), parts(n))
    iteration, token, attention = fit.shape
    # The iteration and token terms both grow with the prompt, so only their sum is sharp;
    # the attention term, which grows with its square, is told apart.
    assert token == pytest.approx(0.0210 / B, rel=0.1)
    assert attention < 0.5
    # The fitted terms predict what one multiplier cannot: short and long prompts alike. The
    # best single multiplier over these prompts is off by more at both ends.
    single = sum(h200_ms(n) for n in range(500, 32_000, 500)) / sum(sum(parts(n)) for n in range(500, 32_000, 500))
    for n in (1_000, 30_000):
        predicted = sum(s * p for s, p in zip(fit.shape, parts(n), strict=True))
        assert predicted == pytest.approx(h200_ms(n), rel=0.05)
        assert abs(predicted / h200_ms(n) - 1) < abs(single * sum(parts(n)) / h200_ms(n) - 1)


def test_a_replica_slower_in_every_term_is_fitted_so_in_every_term() -> None:
    fit = TermFit(TTFT_RIDGE)
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(500, 32_000)
        fit.observe(2.0 * sum(parts(n)), parts(n))
    assert fit.shape == pytest.approx((2.0, 2.0, 2.0), rel=0.02)


def test_terms_the_traffic_cannot_tell_apart_sit_at_the_multiplier() -> None:
    # Replicas sped up tenfold (a test fleet): every prompt of one length, ten times faster
    # than the profile. Only the sum of the terms is known; each sits near the multiplier.
    fit = TermFit(TTFT_RIDGE)
    for _ in range(60):
        fit.observe(0.1 * sum(parts(4000)), parts(4000))
    assert fit.shape == pytest.approx((0.1, 0.1, 0.1), rel=0.1)


def test_traffic_that_cannot_tell_the_terms_apart_leaves_them_at_one() -> None:
    # Every prompt the same length and as the profile says, bar the noise of the iteration in
    # progress: nothing to tell the terms apart, so nothing moves far.
    fit = TermFit(TTFT_RIDGE)
    rng = random.Random(2)
    for _ in range(200):
        p = parts(4000)
        fit.observe(sum(p) + rng.uniform(-0.5, 0.5) * A, p)
    assert fit.shape == pytest.approx((1.0, 1.0, 1.0), abs=0.15)


def test_one_outlier_moves_the_fit_by_a_bounded_step() -> None:
    fit = TermFit(TTFT_RIDGE)
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(500, 32_000)
        fit.observe(sum(parts(n)), parts(n))
    fit.observe(60_000.0, parts(30_000))  # one prefill stalled for a minute
    iteration, token, attention = fit.shape
    assert max(fit.shape) < 1.6 and min(fit.shape) > 0.6
    for _ in range(60):
        n = rng.randint(500, 32_000)
        fit.observe(sum(parts(n)), parts(n))
    assert fit.shape == pytest.approx((1.0, 1.0, 1.0), abs=0.1)


def test_the_terms_stay_inside_their_bounds() -> None:
    slow, fast = TermFit(TTFT_RIDGE), TermFit(TTFT_RIDGE)
    rng = random.Random(4)
    for _ in range(300):
        n = rng.randint(500, 32_000)
        slow.observe(1e9, parts(n))
        fast.observe(1e-9, parts(n))
    assert all(MIN_SHAPE <= s <= MAX_SHAPE for s in slow.shape + fast.shape)
    assert max(slow.shape) == pytest.approx(MAX_SHAPE) and min(fast.shape) == pytest.approx(MIN_SHAPE)


@pytest.mark.parametrize("observed, sample", [
    (0.0, (1.0, 10.0, 1.0)), (-5.0, (1.0, 10.0, 1.0)), (math.inf, (1.0, 10.0, 1.0)), (math.nan, (1.0, 10.0, 1.0)),
    (10.0, (0.1, 0.2, 0.1)), (10.0, (1.0, -10.0, 1.0)), (10.0, (1.0, math.nan, 1.0)), (10.0, (1.0, 10.0)),
])
def test_samples_that_teach_nothing_are_ignored(observed: float, sample: tuple[float, ...]) -> None:
    fit = TermFit(TTFT_RIDGE)
    assert not fit.observe(observed, sample)
    assert fit.shape == (1.0, 1.0, 1.0) and fit.samples == 0


def test_fading_leans_the_terms_back_toward_the_multiplier() -> None:
    fit = TermFit(TTFT_RIDGE)
    rng = random.Random(5)
    for _ in range(80):
        n = rng.randint(500, 32_000)
        fit.observe(h200_ms(n), parts(n))
    learned = fit.shape[2]
    for _ in range(8):
        fit.fade()
    assert learned < fit.shape[2] <= 1.0


def test_decode_terms_fit_the_context_read_apart_from_the_iteration() -> None:
    # An engine that reads context half as fast as its profile says, iteration as said.
    fit = TermFit(ITL_RIDGE)
    rng = random.Random(6)
    for _ in range(100):
        iteration, context = 8.3 + 0.009 * 32, 4.39e-5 * rng.randint(5_000, 400_000)
        fit.observe(iteration + 2.0 * context, (iteration, context))
    assert fit.shape[0] == pytest.approx(1.0, abs=0.15)
    assert fit.shape[1] == pytest.approx(2.0, rel=0.15)


def _core() -> tuple[RoutingCore, Fleet]:
    fleet = Fleet([ReplicaSettings(url="http://127.0.0.1:9001", name="r")])
    core = RoutingCore(fleet, make_policy("predictive"), CacheTracker(RoutingSettings(), lambda: 0.0),
                       AdmissionQueue(8, 8), CoreSettings(), call_at=lambda when, cb: None)
    return core, fleet


def _send(core: RoutingCore, fleet: Fleet, text: str, clock: float, stream: bool = True):  # noqa: ANN202
    """Plan `text` and start its attempt on the one replica; the journey."""
    journey = core.plan("/v1/completions", RequestFeatures("/v1/completions", stream=stream), text, fleet.replicas)
    core.next_attempt(journey, clock)
    return journey


def test_the_core_fits_the_terms_from_streamed_answers_that_found_the_queue_empty() -> None:
    core, fleet = _core()
    replica = fleet.replicas[0]
    rng = random.Random(7)
    clock = 0.0
    for i in range(60):
        journey = _send(core, fleet, f"{i} " + "word " * rng.randint(300, 20_000), clock)
        assert journey.alone
        iteration, token, attention = (journey.ttft_parts[j] for j in range(3))
        assert journey.ttft_parts == journey.ranking[0].parts[:len(MODEL_TTFT_PARTS)]
        # Attention a quarter of the profile's, the rest as it says.
        clock += (iteration + token + 0.25 * attention) / 1000.0
        core.first_byte(journey, clock)
        core.end_attempt(journey, answered=True)
    assert replica.ttft_terms_fit.samples == 60
    assert replica.ttft_terms[2] < 0.5 and replica.ttft_terms[1] == pytest.approx(1.0, abs=0.2)
    # A request behind another's prefill teaches the terms nothing: the wait is the queue's.
    ahead = _send(core, fleet, "a " * 5000, clock)
    behind = _send(core, fleet, "b " * 5000, clock)
    core.first_byte(ahead, clock + 0.1)
    core.first_byte(behind, clock + 10.0)
    assert replica.ttft_terms_fit.samples == 61


def test_prefills_started_during_an_answer_are_stalls_not_a_slow_decode_term() -> None:
    core, fleet = _core()
    replica = fleet.replicas[0]
    rng = random.Random(8)
    clock = 0.0
    for i in range(40):
        answer = _send(core, fleet, f"{i} " + "word " * rng.randint(300, 20_000), clock)
        clock += 0.2
        core.first_byte(answer, clock)
        before = replica.prefill_ms_started
        # Another long prompt arrives while the answer streams: its prefill stalls each token.
        other = _send(core, fleet, f"other {i} " + "word " * 16_000, clock, stream=False)
        stall_ms = replica.prefill_ms_started - before
        assert stall_ms > 100
        tokens = 50
        clock += (sum(answer.itl_parts) * (tokens - 1) + stall_ms) / 1000.0
        core.learned_output(answer, tokens, clock)
        core.first_byte(other, clock)
        core.end_attempt(answer, answered=True)
        core.end_attempt(other, answered=True)
    assert replica.itl_terms_fit.samples == 40
    # The multiplier carries the stalls (it always has); the terms do not read them as a
    # slow iteration or a slow context read.
    assert replica.itl_scale > 1.1
    assert replica.itl_terms_fit.shape == pytest.approx((1.0, 1.0), abs=0.15)
