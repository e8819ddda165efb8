"""Prefix demand: the rate at which requests meet one cached prefix, the traffic a copy of it
would serve. One system prompt shared by every request builds a rate; a conversation whose
turns each end deeper than the last never does."""

from __future__ import annotations

import pytest

from balancer.config import RoutingSettings
from balancer.routing.fleet import Fleet, ReplicaSettings
from balancer.routing.prefix_demand import PrefixDemand
from balancer.routing.tracker import CacheTracker


def test_a_steady_rate_converges_on_itself_and_fades_when_it_stops() -> None:
    demand = PrefixDemand(time_constant_s=10.0)
    now = 0.0
    for _ in range(600):  # 12 requests a second for 50 s
        demand.observe(7, now)
        now += 1 / 12
    assert demand.rate(7, now) == pytest.approx(12, rel=0.05)
    assert demand.rate(7, now + 30) < 1.0
    assert demand.rate(8, now) == 0.0


def test_the_prefixes_it_keeps_are_bounded_and_the_least_recently_met_go_first() -> None:
    demand = PrefixDemand(max_entries=3)
    for key in range(5):
        demand.observe(key, float(key))
    assert len(demand) == 3
    assert demand.rate(0, 5.0) == 0.0 and demand.rate(4, 5.0) > 0.0


@pytest.mark.parametrize("bad", [{"time_constant_s": 0}, {"max_entries": 0}])
def test_bad_bounds_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        PrefixDemand(**bad)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def sent(tracker: CacheTracker, fleet: Fleet, prompt: str, clock: Clock) -> float:
    """Predict `prompt`, send it to the first replica, and return the rate it was priced at."""
    routed = tracker.predict(prompt)
    tracker.start(routed, fleet.replicas[0])
    clock.now += 0.1
    return routed.prefix_rate


def test_requests_under_one_system_prompt_build_a_rate_and_a_conversation_does_not() -> None:
    clock = Clock()
    tracker = CacheTracker(RoutingSettings(), clock)
    fleet = Fleet([ReplicaSettings(url="http://127.0.0.1:9001", name="r")])
    system = "You answer questions about the shipping policy. " * 200
    rates = [sent(tracker, fleet, system + f"Question number {i}: where is my parcel?", clock) for i in range(20)]
    assert rates[0] == 0.0  # nothing held yet: no prefix to count
    assert rates[-1] > rates[2] > 0.0

    turns = "Tell me a story about a lighthouse. " * 200
    conversation = []
    for turn in range(20):
        turns += f"And then, in part {turn}, what happened to the keeper and the storm? " * 5
        conversation.append(sent(tracker, fleet, turns, clock))
    # Each turn's longest cached prefix is the previous turn, met once: no rate builds.
    assert max(conversation) <= 1.0 / tracker.demand.time_constant_s + 1e-9


def test_a_retried_request_counts_once() -> None:
    clock = Clock()
    tracker = CacheTracker(RoutingSettings(), clock)
    fleet = Fleet([ReplicaSettings(url="http://127.0.0.1:9001", name="a"),
                   ReplicaSettings(url="http://127.0.0.1:9002", name="b")])
    system = "Shared instructions for every request. " * 100
    sent(tracker, fleet, system + "first", clock)
    routed = tracker.predict(system + "second")
    for replica in fleet.replicas:  # the first attempt failed, the second is the same request
        tracker.start(routed, replica)
    third = tracker.predict(system + "third")
    assert third.prefix_rate == pytest.approx(1.0 / tracker.demand.time_constant_s, rel=0.05)
