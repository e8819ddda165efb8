"""Places handed between instances: a place that frees goes to the instance whose waiting
tenant one fair share would serve next (`FlowController.hand_off`, on virtual time)."""

from __future__ import annotations

from balancer.routing.flow import GO, WAIT
from tests.routing.test_flow import controller


class Places:
    """One model's capped places (the instance's own limit too, so that requests wait here);
    a handed place counts as taken, as the sync counts it."""

    def __init__(self, cap: int, accept: bool = True) -> None:
        self.cap, self.lent, self.accept = cap, 0, accept
        self.handed: list[str] = []
        self.flow = controller(max_in_flight=cap, free=lambda model, now: self.cap - self.flow.in_flight - self.lent)
        self.flow.hand_off = self.hand_off

    def hand_off(self, peer, model, klass, tenant) -> bool:
        if self.accept:
            self.lent += 1
            self.handed.append(peer)
        return self.accept


def arrive(flow, tenant, now=0.0, klass="standard", cost=100):
    ticket = flow.ticket(tenant, klass, None, cost, None, now)
    outcome = flow.arrive(ticket, now)[0]
    return ticket, outcome


def busy_with(fleet, tenant, waiting, cost=1000):
    """The only place held by `tenant` (a request of `cost` tokens: the service it has had),
    which has `waiting` more of 100 tokens in line here."""
    running, outcome = arrive(fleet.flow, tenant, cost=cost)
    assert outcome == GO
    for _ in range(waiting):
        assert arrive(fleet.flow, tenant)[1] == WAIT
    return running


def test_a_place_goes_to_the_peer_whose_tenant_has_had_less_service():
    fleet = Places(cap=1)
    running = busy_with(fleet, "wide", waiting=2)
    fleet.flow.set_remote({("standard", "narrow"): (0.0, 2)}, 0.0, 1, {("standard", "narrow"): "b"})
    assert fleet.flow.done(running, 1.0) == []
    assert fleet.handed == ["b"] and fleet.flow.handed_off == 1
    # Counted as one fewer waiting there, and served: the place after the next goes back here.
    assert fleet.flow.by_name["standard"].remote_queued == {"narrow": 1}
    assert fleet.flow.by_name["standard"].remote["narrow"] == 100


def test_a_tenant_only_a_little_behind_elsewhere_does_not_take_the_place():
    fleet = Places(cap=1)
    running = busy_with(fleet, "wide", waiting=1, cost=100)
    fleet.flow.set_remote({("standard", "narrow"): (0.0, 2)}, 0.0, 1, {("standard", "narrow"): "b"})
    # Less service by under one request (100 tokens, faded a little): stale views on either
    # side could disagree on that, so it is left to this instance's own order.
    (woken,) = fleet.flow.done(running, 1.0)
    assert woken.tenant == "wide" and fleet.handed == []


def test_handing_stops_once_the_peers_tenant_has_caught_up():
    fleet = Places(cap=1)
    running = busy_with(fleet, "wide", waiting=3, cost=150)
    fleet.flow.set_remote({("standard", "narrow"): (0.0, 5)}, 0.0, 1, {("standard", "narrow"): "b"})
    fleet.flow.done(running, 1.0)
    fleet.lent = 0  # the peer's place ended
    (woken,) = fleet.flow.pump(1.5)
    # `narrow` has had a request's service now (100), near `wide`'s (150, fading): no longer
    # less by more than a request, so the place stays here.
    assert fleet.handed == ["b"] and woken.tenant == "wide"


def test_a_tenant_waiting_on_both_is_ordered_here_and_not_handed_for():
    fleet = Places(cap=1)
    running = busy_with(fleet, "wide", waiting=1)
    fleet.flow.set_remote({("standard", "wide"): (0.0, 4)}, 0.0, 1, {("standard", "wide"): "b"})
    (woken,) = fleet.flow.done(running, 1.0)
    assert woken.tenant == "wide" and fleet.handed == []


def test_a_higher_class_waiting_on_a_peer_takes_the_place():
    fleet = Places(cap=1)
    running = busy_with(fleet, "light", waiting=1)
    fleet.flow.set_remote({("critical", "heavy"): (1e6, 1)}, 0.0, 1, {("critical", "heavy"): "b"})
    assert fleet.flow.done(running, 1.0) == [] and fleet.handed == ["b"]


def test_a_place_that_frees_with_nothing_waiting_here_goes_to_a_peer_at_once():
    fleet = Places(cap=2)
    running, _ = arrive(fleet.flow, "any")
    fleet.flow.set_remote({("batch", "late"): (0.0, 1), ("standard", "early"): (50.0, 3)}, 0.0, 1,
                          {("batch", "late"): "c", ("standard", "early"): "b"})
    fleet.flow.done(running, 1.0)
    # Two places free: both to the higher class's tenant, which has three waiting; one
    # request fewer waiting there for each.
    assert fleet.handed == ["b", "b"] and fleet.flow.remote_waiting == 2


def test_a_place_no_peer_can_take_is_used_here():
    fleet = Places(cap=1, accept=False)
    running = busy_with(fleet, "wide", waiting=1)
    fleet.flow.set_remote({("standard", "narrow"): (0.0, 2)}, 0.0, 1, {("standard", "narrow"): "b"})
    (woken,) = fleet.flow.done(running, 1.0)
    assert woken.tenant == "wide" and fleet.flow.handed_off == 0


def test_without_peers_nothing_is_handed():
    fleet = Places(cap=1)
    running = busy_with(fleet, "wide", waiting=1)
    fleet.flow.set_remote({}, 0.0, 0)
    (woken,) = fleet.flow.done(running, 1.0)
    assert woken.tenant == "wide" and fleet.handed == []


def test_a_tenant_waiting_on_an_instance_not_named_counts_toward_its_bound_but_gets_no_place():
    fleet = Places(cap=1)
    running = busy_with(fleet, "wide", waiting=1)
    fleet.flow.set_remote({("standard", "narrow"): (0.0, 2)}, 0.0, 1)
    assert fleet.flow.by_name["standard"].remote_queued == {"narrow": 2}
    (woken,) = fleet.flow.done(running, 1.0)
    assert woken.tenant == "wide" and fleet.handed == []
