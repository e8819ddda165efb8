"""Bookkeeping of cache-aware routing through the routing core: every routed request leaves
the replica's queued prefill and decoding counts as it found them, and the index learns
from what replicas say."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.admission import AdmissionQueue
from balancer.routing.core import CoreSettings, Journey, RoutingCore
from balancer.routing.fleet import Fleet, Replica
from balancer.routing.tracker import CacheTracker
from policies.base import RequestFeatures
from policies.registry import make_policy

PROMPT = "system prompt words " * 100  # 2,000 characters: 31 whole blocks


class Core:
    """A routing core over one replica, `r`, with the test's clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.tracker = CacheTracker(RoutingSettings(), lambda: self.now)
        self.fleet = Fleet([ReplicaSettings(url="http://127.0.0.1:9001", name="r")])
        self.timers: list[tuple[float, Callable[[float], None]]] = []
        self.core = RoutingCore(self.fleet, make_policy("cache_aware"), self.tracker, AdmissionQueue(8, 8),
                                CoreSettings(forget_unhealthy_after_s=30.0),
                                call_at=lambda when, callback: self.timers.append((when, callback)))

    def run_timers(self, until: float) -> None:
        due = [t for t in self.timers if t[0] <= until]
        self.timers = [t for t in self.timers if t[0] > until]
        for when, callback in due:
            callback(when)

    def send(self, prompt: str) -> Journey:
        journey = self.core.plan("/v1/completions", RequestFeatures("/v1/completions"), prompt, self.fleet.replicas)
        assert self.core.next_attempt(journey, self.now) is not None
        return journey


def make() -> tuple[Core, Replica]:
    core = Core()
    return core, core.fleet.replicas[0]


def test_prefill_is_queued_until_the_first_byte_and_the_slot_held_until_the_end() -> None:
    c, replica = make()
    journey = c.send(PROMPT)
    assert journey.routed is not None
    assert journey.routed.cached == {} and journey.routed.prompt_tokens == 500
    assert replica.prefill_tokens_queued == 500 and replica.decoding == 1 and replica.in_flight == 1
    c.core.first_byte(journey)
    c.core.first_byte(journey)  # every later chunk is not another first byte
    assert replica.prefill_tokens_queued == 0 and replica.decoding == 1
    c.core.end_attempt(journey, answered=True)
    assert replica.prefill_tokens_queued == 0 and replica.decoding == 0 and replica.in_flight == 0
    # The replica now holds the prompt: the next one like it is predicted as cached.
    again = c.send(PROMPT)
    assert again.routed is not None and again.routed.cached == {"r": 31 * 16}
    assert replica.prefill_tokens_queued == 500 - 31 * 16
    c.core.end_attempt(again, answered=True)
    assert replica.prefill_tokens_queued == 0


def test_an_attempt_that_failed_is_forgotten() -> None:
    c, replica = make()
    journey = c.send(PROMPT)
    c.core.end_attempt(journey, answered=False)
    assert replica.prefill_tokens_queued == 0 and replica.decoding == 0 and replica.in_flight == 0
    assert c.tracker.predict(PROMPT).cached == {}


def test_the_ranking_is_tried_once_each_and_at_most_max_attempts() -> None:
    c, replica = make()
    journey = c.core.plan("/v1/completions", RequestFeatures("/v1/completions"), PROMPT, c.fleet.replicas)
    assert c.core.next_attempt(journey, 0.0) is replica
    c.core.end_attempt(journey, answered=False)
    assert c.core.next_attempt(journey, 0.0) is None  # one replica: never the same one twice
    assert journey.attempts == ["r"]


def test_learning_forgets_what_an_lru_engine_evicted() -> None:
    c, replica = make()
    older = "an older conversation " * 100
    for t, prompt in ((1.0, older), (2.0, PROMPT)):
        c.now = t
        c.core.end_attempt(c.send(prompt), answered=True)
    c.now = 3.0
    journey = c.send(PROMPT)
    assert journey.routed is not None and journey.routed.cached["r"] > 0
    # The replica says it had nothing cached: it restarted, or evicted this prompt and,
    # being LRU, the older one before it.
    lesson = c.core.learn(journey, prompt_tokens=400, cached_tokens=0)
    assert lesson is not None and lesson.corrected and lesson.actual == 0
    assert c.core.learn(journey, 400, 0) is None  # once per request
    c.core.end_attempt(journey, answered=True)
    assert "r" not in c.tracker.predict(older).cached
    assert c.tracker.predict(PROMPT).cached.get("r", 0) > 0  # just recomputed there


def test_a_correct_prediction_changes_nothing() -> None:
    c, replica = make()
    c.core.end_attempt(c.send(PROMPT), answered=True)
    journey = c.send(PROMPT)
    lesson = c.core.learn(journey, prompt_tokens=400, cached_tokens=392)
    assert lesson is not None and not lesson.corrected
    assert abs(lesson.predicted - lesson.actual) <= 16


def test_a_replica_still_out_after_a_while_has_its_cache_forgotten() -> None:
    c, replica = make()
    c.core.end_attempt(c.send(PROMPT), answered=True)
    replica.healthy = False  # its health checks fail
    c.core.went_out(replica, now=100.0)
    c.run_timers(until=129.0)
    assert c.tracker.predict(PROMPT).cached == {"r": 31 * 16}  # not yet: it may come back warm
    c.run_timers(until=130.0)
    assert c.tracker.predict(PROMPT).cached == {}  # still out: it has likely restarted empty


def test_a_replica_still_out_after_a_while_starts_again_at_its_profiles_speed() -> None:
    c, replica = make()
    replica.latency.observe(400.0, 100.0)  # fitted slower than its profile
    replica.decode_latency.observe(40.0, 10.0)
    replica.healthy = False
    c.core.went_out(replica, now=100.0)
    c.run_timers(until=129.0)
    assert replica.ttft_scale > 1.0 and replica.itl_scale > 1.0
    c.run_timers(until=130.0)
    assert replica.ttft_scale == 1.0 and replica.itl_scale == 1.0


def test_a_replica_back_in_time_keeps_its_cache() -> None:
    c, replica = make()
    c.core.end_attempt(c.send(PROMPT), answered=True)
    replica.healthy = False
    c.core.went_out(replica, now=100.0)
    replica.healthy = True
    c.run_timers(until=200.0)
    assert c.tracker.predict(PROMPT).cached == {"r": 31 * 16}


def test_an_ejection_starts_the_same_rule() -> None:
    c, replica = make()
    c.core.end_attempt(c.send(PROMPT), answered=True)
    ejected = False
    while not ejected:  # the replica's own faults, until its breaker opens
        journey = c.send(PROMPT)
        ejected = c.core.failed(journey, now=10.0)
        c.core.end_attempt(journey, answered=False)
    assert [when for when, _ in c.timers] == [40.0]
    c.run_timers(until=40.0)  # its breaker is still open (or half open): out
    assert c.tracker.predict(PROMPT).cached == {}


def test_a_waiting_request_gets_the_predictive_policys_time_on_its_best_replica_even_when_full() -> None:
    """Flow control asks for the time to first token of a request that must wait: the
    policy's prediction on the replica it would choose, counted although every replica is
    at its cap; policies that predict no time give none."""
    fleet = Fleet([ReplicaSettings(url=f"http://127.0.0.1:900{i}", name=f"r{i}", max_concurrency=1) for i in range(2)])
    tracker = CacheTracker(RoutingSettings(), lambda: 0.0)
    core = RoutingCore(fleet, make_policy("predictive"), tracker, AdmissionQueue(8, 8), CoreSettings(),
                       call_at=lambda when, callback: None)
    features = RequestFeatures("/v1/completions")
    busy = core.plan("/v1/completions", features, PROMPT * 20, fleet.replicas)
    holder = core.next_attempt(busy, 0.0)
    assert holder is not None
    other = core.plan("/v1/completions", features, "another prompt " * 50, fleet.replicas)
    assert core.next_attempt(other, 0.0) is not None
    assert all(not r.has_room() for r in fleet.replicas)

    short = core.predicted_ttft_s("/v1/completions", features, "a short question", None, 0.0)
    long = core.predicted_ttft_s("/v1/completions", features, PROMPT * 40, None, 0.0)
    assert short is not None and long is not None
    # 20,000 tokens, half of them cached on the first one's replica behind its 10,000
    # queued: about half a second.
    ranking = core.plan("/v1/completions", features, PROMPT * 40, fleet.replicas).ranking
    assert ranking[0].replica is holder
    assert long == pytest.approx(ranking[0].terms["ttft_ms"] / 1000.0)
    assert short < 0.05 and 0.3 < long < 2.0, (short, long)

    plain = RoutingCore(fleet, make_policy("least_load"), None, AdmissionQueue(8, 8), CoreSettings(),
                        call_at=lambda when, callback: None)
    assert plain.predicted_ttft_s("/v1/completions", features, "a short question", None, 0.0) is None
