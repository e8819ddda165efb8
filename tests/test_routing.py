"""Bookkeeping of cache-aware routing: every routed request leaves the replica's queued
prefill and decoding counts as it found them, and the index learns from what replicas say."""

from __future__ import annotations

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.fleet import Replica
from balancer.routing import CacheTracker

PROMPT = "system prompt words " * 100  # 2,000 characters: 31 whole blocks


def make() -> tuple[CacheTracker, Replica, list[float]]:
    now = [0.0]
    tracker = CacheTracker(RoutingSettings(), lambda: now[0])
    replica = Replica(ReplicaSettings(url="http://127.0.0.1:9001", name="r"))
    return tracker, replica, now


def test_prefill_is_queued_until_the_first_byte_and_the_slot_held_until_the_end() -> None:
    tracker, replica, _ = make()
    routed = tracker.predict(PROMPT)
    assert routed.cached == {} and routed.prompt_tokens == 500
    tracker.start(routed, replica)
    assert replica.prefill_tokens_queued == 500 and replica.decoding == 1
    tracker.first_byte(routed)
    tracker.first_byte(routed)  # every later chunk is not another first byte
    assert replica.prefill_tokens_queued == 0 and replica.decoding == 1
    tracker.finish(routed, answered=True)
    assert replica.prefill_tokens_queued == 0 and replica.decoding == 0
    # The replica now holds the prompt: the next one like it is predicted as cached.
    again = tracker.predict(PROMPT)
    assert again.cached == {"r": 31 * 16}
    tracker.start(again, replica)
    assert replica.prefill_tokens_queued == 500 - 31 * 16
    tracker.finish(again, answered=True)
    assert replica.prefill_tokens_queued == 0


def test_an_attempt_that_failed_is_forgotten() -> None:
    tracker, replica, _ = make()
    routed = tracker.predict(PROMPT)
    tracker.start(routed, replica)
    tracker.finish(routed, answered=False)
    assert replica.prefill_tokens_queued == 0 and replica.decoding == 0
    assert tracker.predict(PROMPT).cached == {}


def test_learning_forgets_what_an_lru_engine_evicted() -> None:
    tracker, replica, now = make()
    older = "an older conversation " * 100
    for t, prompt in ((1.0, older), (2.0, PROMPT)):
        now[0] = t
        routed = tracker.predict(prompt)
        tracker.start(routed, replica)
        tracker.finish(routed, answered=True)
    now[0] = 3.0
    routed = tracker.predict(PROMPT)
    assert routed.cached["r"] > 0
    tracker.start(routed, replica)
    # The replica says it had nothing cached: it restarted, or evicted this prompt and,
    # being LRU, the older one before it.
    lesson = tracker.learn(routed, replica, prompt_tokens=400, cached_tokens=0)
    assert lesson is not None and lesson.corrected and lesson.actual == 0
    assert tracker.learn(routed, replica, 400, 0) is None  # once per request
    tracker.finish(routed, answered=True)
    assert "r" not in tracker.predict(older).cached
    assert tracker.predict(PROMPT).cached.get("r", 0) > 0  # just recomputed there


def test_a_correct_prediction_changes_nothing() -> None:
    tracker, replica, now = make()
    routed = tracker.predict(PROMPT)
    tracker.start(routed, replica)
    tracker.finish(routed, answered=True)
    routed = tracker.predict(PROMPT)
    tracker.start(routed, replica)
    lesson = tracker.learn(routed, replica, prompt_tokens=400, cached_tokens=392)
    assert lesson is not None and not lesson.corrected
    assert abs(lesson.predicted - lesson.actual) <= 16
