"""Flow control's decisions, on virtual time: who goes, in which order, and who is refused."""

from __future__ import annotations

from collections import Counter

import pytest

from balancer.errors import ClientError
from balancer.routing.flow import (
    DISPLACED,
    GO,
    QUEUE_FULL,
    QUEUED,
    RUNNING,
    TENANT_QUEUE_FULL,
    TTFT_SLO,
    WAIT,
    WAIT_TOO_LONG,
    FlowClass,
    FlowController,
    TenantPolicy,
)

CLASSES = [FlowClass("critical", ttft_slo_s=2.0), FlowClass("standard"), FlowClass("batch", sheddable=True)]


def controller(max_in_flight=2, max_queued=100, classes=CLASSES, tenants=None, free=None, **kw):
    slots = free if free is not None else (lambda model, now: 1 << 30)
    return FlowController(classes, "standard", max_in_flight, max_queued, 10.0, slots, tenants, **kw)


def fill(flow, n, now=0.0):
    """`n` running requests of tenant `bg`."""
    running = []
    for _ in range(n):
        t = flow.ticket("bg", "standard", None, 100, None, now)
        assert flow.arrive(t, now)[0] == GO
        running.append(t)
    return running


def served(flow, current, steps: int, start: float = 0.0, gap: float = 1.0) -> Counter:
    """Requests ending one after another on a single place: whose go next, `steps` times."""
    counts: Counter = Counter()
    for step in range(steps):
        (current,) = flow.done(current, start + gap * step)
        counts[current.tenant] += 1
    return counts


def test_below_saturation_every_request_goes_at_once():
    flow = controller(max_in_flight=3)
    tickets = [flow.ticket(f"t{i}", None, None, 100, None, 0.0) for i in range(3)]
    assert [flow.arrive(t, 0.0)[0] for t in tickets] == [GO, GO, GO]
    assert flow.queued == 0 and flow.in_flight == 3


def test_higher_classes_go_first_once_saturated():
    flow = controller(max_in_flight=1)
    (running,) = fill(flow, 1)
    order = []
    for klass in ("batch", "standard", "batch", "critical"):
        t = flow.ticket("a", klass, None, 100, None, 0.0)
        t.ttft_slo_s = None
        assert flow.arrive(t, 0.0)[0] == WAIT
        order.append(t)
    woken = []
    current = running
    for step in range(4):
        (nxt,) = flow.done(current, float(step))
        woken.append(nxt.klass)
        current = nxt
    assert woken == ["critical", "standard", "batch", "batch"]


def test_tenants_share_by_tokens_not_requests():
    """Tenant `big` sends requests ten times the size of `small`'s: once both are
    backlogged, `small` gets about ten requests through for each of `big`'s."""
    flow = controller(max_in_flight=1)
    (current,) = fill(flow, 1)
    for _ in range(30):
        flow.arrive(flow.ticket("big", None, None, 1000, None, 0.0), 0.0)
        flow.arrive(flow.ticket("small", None, None, 100, None, 0.0), 0.0)
    counts = served(flow, current, 22)
    assert counts["small"] >= 18 and 1 <= counts["big"] <= 4, counts


def test_weights_scale_a_tenants_share():
    flow = controller(max_in_flight=1, tenants={"gold": TenantPolicy(weight=3.0)}, fairness_window_s=1e6)
    (current,) = fill(flow, 1)
    for _ in range(40):
        flow.arrive(flow.ticket("gold", None, None, 100, None, 0.0), 0.0)
        flow.arrive(flow.ticket("plain", None, None, 100, None, 0.0), 0.0)
    assert served(flow, current, 40) == {"gold": 30, "plain": 10}


def test_a_tenant_below_its_share_goes_first_even_in_a_burst():
    """`busy` has been served for a while; `light` sends three requests at once after a
    quiet spell: each goes before any more of `busy`'s."""
    flow = controller(max_in_flight=1)
    (current,) = fill(flow, 1)
    for _ in range(50):
        flow.arrive(flow.ticket("busy", None, None, 100, None, 0.0), 0.0)
    for step in range(20):
        (current,) = flow.done(current, 0.1 * step)
    for _ in range(3):
        flow.arrive(flow.ticket("light", None, None, 100, None, 2.0), 2.0)
    order = []
    for step in range(5):
        (current,) = flow.done(current, 2.0 + 0.1 * step)
        order.append(current.tenant)
    assert order == ["light", "light", "light", "busy", "busy"]


def test_service_long_past_is_forgotten():
    """Once more than several fairness windows have passed, two tenants share evenly again,
    whatever one of them used before."""
    flow = controller(max_in_flight=1, fairness_window_s=10.0)
    (current,) = fill(flow, 1)
    for _ in range(30):
        flow.arrive(flow.ticket("old", None, None, 100, None, 0.0), 0.0)
    for step in range(30):
        (current,) = flow.done(current, 0.1 * step)
    for _ in range(10):
        flow.arrive(flow.ticket("old", None, None, 100, None, 200.0), 200.0)
        flow.arrive(flow.ticket("new", None, None, 100, None, 200.0), 200.0)
    order = []
    for step in range(10):
        (current,) = flow.done(current, 200.0 + 0.1 * step)
        order.append(current.tenant)
    assert order.count("new") == 5, order


def test_a_flooding_tenant_fills_only_its_own_part_of_a_full_queue():
    flow = controller(max_in_flight=1, max_queued=10)
    fill(flow, 1)
    for _ in range(10):
        assert flow.arrive(flow.ticket("noisy", None, None, 100, None, 0.0), 0.0)[0] == WAIT
    with pytest.raises(ClientError) as refused:
        flow.arrive(flow.ticket("noisy", None, None, 100, None, 0.0), 0.0)
    assert refused.value.code == QUEUE_FULL and refused.value.status == 429
    assert ("x-kvlb-reject-reason", QUEUE_FULL) in refused.value.headers()
    steady = flow.ticket("steady", None, None, 100, None, 0.0)
    outcome, _, displaced = flow.arrive(steady, 0.0)
    assert outcome == WAIT and steady.state == QUEUED
    assert len(displaced) == 1 and displaced[0].tenant == "noisy" and displaced[0].refusal.code == DISPLACED


def test_a_higher_class_displaces_sheddable_work_first():
    flow = controller(max_in_flight=1, max_queued=4)
    fill(flow, 1)
    for klass in ("standard", "batch", "standard", "batch"):
        flow.arrive(flow.ticket("a", klass, None, 100, None, 0.0), 0.0)
    first = flow.ticket("b", "standard", None, 100, None, 0.0)
    _, _, displaced = flow.arrive(first, 0.0)
    assert [t.klass for t in displaced] == ["batch"]
    assert flow.queued_in("batch") == 1 and flow.queued == 4


def test_a_tenant_over_its_own_bound_is_refused():
    flow = controller(max_in_flight=1, tenants={"small": TenantPolicy(max_queued=2)})
    fill(flow, 1)
    for _ in range(2):
        flow.arrive(flow.ticket("small", None, None, 100, None, 0.0), 0.0)
    with pytest.raises(ClientError) as refused:
        flow.arrive(flow.ticket("small", None, None, 100, None, 0.0), 0.0)
    assert refused.value.code == TENANT_QUEUE_FULL
    assert flow.arrive(flow.ticket("other", None, None, 100, None, 0.0), 0.0)[0] == WAIT


def test_a_target_that_cannot_be_met_is_refused_at_once():
    """Places have been freeing at 10 a second: a critical request behind 50 of its own
    tenant's would wait about 5 s, past its 2 s target, so it is told at once; another
    tenant's would go next, by fair share, and waits."""
    flow = controller(max_in_flight=1)
    (current,) = fill(flow, 1)
    for _ in range(60):
        flow.arrive(flow.ticket("bg", "critical", None, 100, 100.0, 0.0), 0.0)
    for step in range(10):
        (current,) = flow.done(current, 0.1 * step)
    assert flow.predicted_wait_s(flow.ticket("bg", "critical", None, 100, None, 1.0), 1.0) == pytest.approx(5.1, rel=0.05)
    assert flow.predicted_wait_s(flow.ticket("x", "critical", None, 100, None, 1.0), 1.0) == pytest.approx(0.2, rel=0.05)
    assert flow.arrive(flow.ticket("x", "critical", None, 100, None, 1.0), 1.0)[0] == WAIT
    urgent = flow.ticket("bg", "critical", None, 100, None, 1.0)
    with pytest.raises(ClientError) as refused:
        flow.arrive(urgent, 1.0)
    assert refused.value.code == TTFT_SLO and refused.value.retry_after >= 5
    # A request without a target in the same state waits.
    patient = flow.ticket("x", "standard", None, 100, None, 1.0)
    assert flow.arrive(patient, 1.0)[0] == WAIT


def test_a_lower_class_is_told_at_once_when_higher_traffic_leaves_it_no_room():
    """Places have freed at 10 a second, and critical traffic took 9 of them: batch requests
    of a flooding tenant queue while their predicted wait (one a second each) fits the 10 s
    queue timeout, and are refused at once beyond it rather than after waiting it out."""
    flow = controller(max_in_flight=1000)
    for i in range(100):
        t = i * 0.1
        ticket = flow.ticket("a", "batch" if i % 10 == 0 else "critical", None, 100, None, t)
        assert flow.arrive(ticket, t)[0] == GO
        flow.done(ticket, t + 0.05)
    flow.max_in_flight = 1
    fill(flow, 1, now=10.0)
    outcomes = []
    for _ in range(12):
        try:
            outcomes.append(flow.arrive(flow.ticket("bulk", "batch", None, 100, None, 10.0), 10.0)[0])
        except ClientError as refused:
            outcomes.append(refused.code)
            assert refused.retry_after >= 8
    first = outcomes.index(WAIT_TOO_LONG)  # about one a second of waiting each, refused past 8 s
    assert 6 <= first <= 9 and outcomes == [WAIT] * first + [WAIT_TOO_LONG] * (12 - first), outcomes


def test_a_queued_request_expires_when_its_target_passes():
    flow = controller(max_in_flight=1)
    fill(flow, 1)
    ticket = flow.ticket("x", "critical", None, 100, None, 0.0)
    assert flow.arrive(ticket, 0.0)[0] == WAIT
    assert ticket.deadline == pytest.approx(2.0)
    refusal = flow.expire(ticket, 2.0)
    assert refusal is not None and refusal.code == TTFT_SLO and flow.queued == 0
    assert ticket.queued_s == pytest.approx(2.0)
    assert flow.expire(ticket, 3.0) is None  # once


def test_a_reserved_share_keeps_a_lower_class_moving():
    classes = [FlowClass("high"), FlowClass("low", reserved_share=0.25)]
    flow = FlowController(classes, "high", 1, 1000, 60.0, lambda m, n: 1 << 30)
    (current,) = [t for t in [flow.ticket("a", "high", None, 1, None, 0.0)] if flow.arrive(t, 0.0)[0] == GO]
    for _ in range(100):
        flow.arrive(flow.ticket("a", "high", None, 1, None, 0.0), 0.0)
        flow.arrive(flow.ticket("b", "low", None, 1, None, 0.0), 0.0)
    served = []
    for step in range(40):
        (current,) = flow.done(current, float(step))
        served.append(current.klass)
    assert served.count("low") == 10, served


def test_saturated_replicas_hold_the_request_until_a_place_frees_for_its_model():
    room = {"a": 0, "b": 1}
    flow = controller(max_in_flight=10, free=lambda model, now: room[model])
    first = flow.ticket("t", None, "a", 100, None, 0.0)
    assert flow.arrive(first, 0.0)[0] == GO
    # The driver found every replica for model `a` full.
    woken, displaced = flow.saturated(first, 0.0)
    assert woken == [] and displaced == [] and first.state == QUEUED and flow.in_flight == 0
    # A request for model `b`, which has room, is not held behind it.
    other = flow.ticket("t", None, "b", 100, None, 0.0)
    outcome, woken, _ = flow.arrive(other, 0.0)
    assert outcome == WAIT and woken == [other] and other.state == RUNNING
    # Room for `a` frees: the first goes, holding a reservation until it is placed.
    room["a"] = 1
    assert flow.pump(1.0) == [first] and first.reserved and first.queued_s == pytest.approx(1.0)
    assert flow.pump(1.0) == []
    flow.placed(first)
    assert not first.reserved


def test_tenants_named_by_headers_have_bounded_labels():
    flow = controller(max_tenants=3)
    labels = {flow.ticket(f"t{i}", None, None, 1, None, 0.0).label for i in range(10)}
    assert labels == {"t0", "t1", "t2", "other"}


def test_unknown_class_falls_to_the_tenants_then_the_default():
    flow = controller(tenants={"vip": TenantPolicy(priority="critical")})
    assert flow.ticket("vip", None, None, 1, None, 0.0).klass == "critical"
    assert flow.ticket("vip", "batch", None, 1, None, 0.0).klass == "batch"
    plain = flow.ticket("someone", None, None, 1, None, 0.0)
    assert plain.klass == "standard" and plain.ttft_slo_s is None
    assert flow.ticket("vip", None, None, 1, None, 0.0).ttft_slo_s == 2.0


def test_the_last_free_place_waits_for_a_lighter_tenant():
    room = {"m": 10}
    flow = controller(max_in_flight=100, free=lambda model, now: room[model], headroom_places=1)
    light = flow.ticket("light", None, "m", 100, None, 0.0)
    assert flow.arrive(light, 0.0)[0] == GO
    flow.done(light, 0.1)
    heavy = [flow.ticket("heavy", None, "m", 100, None, 0.2) for _ in range(12)]
    for ticket in heavy[:10]:
        assert flow.arrive(ticket, 0.2)[0] == GO
    room["m"] = 0  # every place taken
    for ticket in heavy[10:]:
        if flow.arrive(ticket, 0.3)[0] == GO:
            flow.saturated(ticket, 0.3)  # the driver found no replica with room
    assert flow.queued == 2
    room["m"] = 1  # one place frees: held back from the heaviest tenant
    assert flow.pump(0.4) == []
    late = flow.ticket("light", None, "m", 100, None, 0.5)
    outcome, woken, _ = flow.arrive(late, 0.5)
    assert outcome == WAIT and woken == [late]  # found it at once
    flow.placed(late)
    room["m"] = 2
    assert len(flow.pump(0.6)) == 1  # beyond the headroom the heaviest goes on as before


def test_no_headroom_is_held_from_a_tenant_holding_no_more_places_than_it():
    """One place in all: the heavier tenant is not held to nothing."""
    room = {"m": 1}
    flow = controller(max_in_flight=100, free=lambda model, now: room[model], headroom_places=1)
    for tenant in ("light", "heavy", "heavy"):
        ticket = flow.ticket(tenant, None, "m", 100, None, 0.0)
        flow.arrive(ticket, 0.0)
        flow.done(ticket, 0.0)
    waiting = flow.ticket("heavy", None, "m", 100, None, 0.1)
    room["m"] = 0
    flow.arrive(waiting, 0.1)
    flow.saturated(waiting, 0.1)
    room["m"] = 1
    assert flow.pump(0.2) == [waiting]


def test_no_headroom_is_held_for_a_tenant_alone_in_its_class():
    room = {"m": 0}
    flow = controller(max_in_flight=100, free=lambda model, now: room[model], headroom_places=1)
    first = flow.ticket("only", None, "m", 100, None, 0.0)
    flow.arrive(first, 0.0)
    flow.saturated(first, 0.0)
    room["m"] = 1
    assert flow.pump(0.1) == [first]



def test_a_requests_own_predicted_time_after_dispatch_decides_its_target():
    """With the policy's prediction for the request itself (its prompt, its cache, the
    replica's queue), a long prompt is refused where a short one with the same target waits,
    whatever the time learned from earlier answers says."""
    flow = controller(max_in_flight=1)
    fill(flow, 1)
    flow.ttft_estimate_s = 1.5  # earlier waiters' answers took long: a short prompt need not
    short = flow.ticket("x", "critical", None, 100, None, 0.0)
    short.ttft_after_s = 0.1
    assert flow.arrive(short, 0.0)[0] == WAIT
    assert short.deadline == pytest.approx(1.9)  # it waits as long as its own time allows
    long = flow.ticket("y", "critical", None, 100, None, 0.0)
    long.ttft_after_s = 2.5
    with pytest.raises(ClientError) as refused:
        flow.arrive(long, 0.0)
    assert refused.value.code == TTFT_SLO and "2500 ms" in refused.value.message
    # Without a prediction of its own, the learned time stands in.
    plain = flow.ticket("z", "critical", None, 100, None, 0.0)
    assert flow.arrive(plain, 0.0)[0] == WAIT and plain.deadline == pytest.approx(0.5)
