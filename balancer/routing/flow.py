"""Flow control: once the fleet is saturated, who waits, in which order, and who is told no.

Below saturation a request passes straight through: `arrive` answers GO after two integer
comparisons, having counted its tokens to its tenant (service is service, whether it waited
or not). The fleet is saturated when `max_in_flight`
requests are admitted, or when no candidate replica has room (every one at its
`max_concurrency`): the driver then hands the request back with `saturated`, and it waits
here until a place frees.

While requests wait:

- **Classes** are served in strict priority, highest first. A class may reserve a share of
  the places that free (`reserved_share`), so a lower class keeps moving under a flood.
- **Tenants** within a class share by tokens, not requests: each tenant's attained service
  (prompt plus expected output, over its weight) is counted as it is dispatched and fades
  with a time constant of `fairness_window_s`, and the waiting tenant with the least goes
  next. A tenant sending below its share therefore goes ahead of one flooding the class,
  even in a burst of its own; a tenant idle for much longer than the window starts level.
- **Headroom**: the last `headroom_places` free places of a model do not go to the tenant
  that has had the most service in its class while others have had some, so a lighter
  tenant's request finds a place at once instead of waiting for the next one to free.
- **Bounds**: all queues together (`limits.max_queued`), each class and each tenant. A full
  queue first pushes out what matters least: a queued request of a lower class (sheddable
  classes first), else the newest request of the tenant holding the largest share of the
  class's queue, so a flooding tenant fills only its own part.
- **Instances** sharing Redis order waiters by each tenant's service on all of them, and a
  place that frees here goes to a peer instead (`hand_off`, set by the driver) when a
  tenant waiting only there is in a higher class than the next request here, or has had
  less service by more than that request's cost, or when nothing waits here.
- **Targets**: a request with a TTFT target is refused at once when the predicted wait (the
  requests that go before it, over the rate places have been freeing) plus its own time to
  first token once dispatched already exceeds it; once queued it waits no longer than its
  target allows. That time is the routing policy's prediction for this request on the
  replica it would choose (`ticket.ttft_after_s`, from policies that predict time: its
  prompt, what of it is cached where, each replica's queue and fitted speed), else the
  time to first token measured after dispatch, learned from the answers of requests that
  waited. Any request predicted to wait most of `limits.queue_timeout_s` is refused
  at once too. A client that backs off on 429 can fail over within milliseconds.

The controller decides and never waits, and reads no clock: the driver (the proxy with
futures and the loop's timers, the simulator with virtual-time events) passes `now`, keeps
each ticket's waiter, sets a timer for `ticket.deadline`, and wakes the tickets that
`done`, `pump` and `arrive` hand back.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from balancer.errors import ClientError
from balancer.protocol import REJECT_REASON_HEADER
from policies.base import RequestFeatures

GO, WAIT = "go", "wait"
# Why a request was refused: the `x-kvlb-reject-reason` header and the error's `code`.
QUEUE_FULL = "queue_full"
TENANT_QUEUE_FULL = "tenant_queue_full"
DISPLACED = "displaced"
TTFT_SLO = "ttft_slo_unattainable"
QUEUE_TIMEOUT = "queue_timeout"
WAIT_TOO_LONG = "predicted_wait_too_long"
REASONS = (QUEUE_FULL, TENANT_QUEUE_FULL, DISPLACED, TTFT_SLO, QUEUE_TIMEOUT, WAIT_TOO_LONG)

# Ticket states.
NEW, RUNNING, QUEUED, ENDED = 0, 1, 2, 3
# What the steps hand back when there is nothing to wake: one shared empty tuple.
NOTHING: tuple = ()

DEFAULT_TENANT = "default"
OTHER_TENANT = "other"  # the label of tenants beyond `max_tenants`
# Free places an unbounded replica counts for: more than any queue could ask for at once.
UNBOUNDED = 1 << 30
# Completions remembered for the rate at which places free: enough for a steady figure,
# few enough to follow a change in the fleet within seconds.
RATE_WINDOW = 64
TTFT_EWMA = 0.1
# A request predicted to wait more than this share of `queue_timeout_s` is refused at once.
# The prediction counts only who is queued now, not the higher classes and fairer shares that
# will arrive meanwhile, so it runs short for exactly the requests near the end of the line;
# refusing only past the whole timeout leaves the line at its edge, where much of what joins
# still times out after the full wait.
EARLY_REFUSAL_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class FlowClass:
    name: str
    ttft_slo_s: float | None = None
    sheddable: bool = False
    reserved_share: float = 0.0  # of the places that free while this class waits
    max_queued: int | None = None  # default: limits.max_queued


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    weight: float = 1.0
    max_queued: int | None = None
    priority: str | None = None  # its class when the request names none


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place in flow control. The driver keeps its own waiter in `waiter`."""

    tenant: str
    klass: str
    model: str | None
    cost: float  # tokens: prompt plus expected output
    ttft_slo_s: float | None
    arrived: float
    label: str = DEFAULT_TENANT  # the tenant as a metric label (bounded)
    state: int = NEW
    seq: int = 0
    deadline: float = math.inf  # while queued: when the driver must call `expire`
    queued_s: float = 0.0  # time spent waiting, all spells together
    queued_at: float = 0.0
    reserved: bool = False  # dispatched, and not yet placed on a replica
    share: Any = None  # its tenant's _Tenant once admitted: what its end gives back to
    # Its own time to first token once dispatched, as the routing policy predicts it (set by
    # the driver when it must wait and has a target); else the learned `ttft_estimate_s`.
    ttft_after_s: float | None = None
    waiter: Any = None
    refusal: ClientError | None = None  # set when displaced: the driver answers with it


def with_target(features: RequestFeatures, ticket: Ticket) -> RequestFeatures:
    """`features` carrying the ticket's time-to-first-token target, for a policy that ranks
    by it; as they are when the ticket has none or they carry it already."""
    if ticket.ttft_slo_s is None or features.ttft_target_ms is not None:
        return features
    return dataclasses.replace(features, ttft_target_ms=ticket.ttft_slo_s * 1000.0)


@dataclass(slots=True)
class _Tenant:
    weight: float
    max_queued: int | None
    attained: float = 0.0  # tokens dispatched over weight, faded to `at`
    at: float = 0.0
    queue: deque[Ticket] = field(default_factory=deque)
    running: int = 0  # its requests admitted here and not yet ended


@dataclass(slots=True)
class _Class:
    spec: FlowClass
    rank: int
    max_queued: int
    tenants: OrderedDict[str, _Tenant] = field(default_factory=OrderedDict)
    queued: int = 0
    credit: float = 0.0
    # When its last requests got a place: the share of the fleet it takes.
    dispatched: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    # Other instances' share (through Redis): per tenant its attained service as of
    # `remote_at`, and its requests waiting there.
    remote: dict[str, float] = field(default_factory=dict)
    remote_queued: dict[str, int] = field(default_factory=dict)
    remote_at: float = 0.0
    # Per tenant waiting elsewhere, the instance where most of its requests wait: where a
    # place handed off for it goes.
    remote_where: dict[str, str] = field(default_factory=dict)


class FlowController:
    def __init__(
        self,
        classes: Iterable[FlowClass],
        default_class: str,
        max_in_flight: int,
        max_queued: int,
        queue_timeout_s: float,
        free_slots: Callable[[str | None, float], int],
        tenants: Mapping[str, TenantPolicy] | None = None,
        max_tenants: int = 1024,
        default_max_queued: int | None = None,
        fairness_window_s: float = 10.0,
        headroom_places: int = 0,
    ) -> None:
        self.classes = [_Class(spec, rank, spec.max_queued if spec.max_queued is not None else max_queued)
                        for rank, spec in enumerate(classes)]
        self.by_name = {c.spec.name: c for c in self.classes}
        if default_class not in self.by_name:
            raise ValueError(f"default class {default_class!r} is not among the classes")
        self.default_class = default_class
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._free_slots = free_slots
        self.tenants = dict(tenants or {})
        self.default_tenant = TenantPolicy(max_queued=default_max_queued)
        self.max_tenants = max_tenants
        self.fairness_window_s = fairness_window_s
        self.headroom_places = headroom_places
        self.in_flight = 0
        self.queued = 0
        self._seq = 0
        self._reserved: dict[str | None, int] = {}
        self._labels: OrderedDict[str, None] = OrderedDict()
        self._completions: deque[float] = deque(maxlen=RATE_WINDOW)
        self.ttft_estimate_s = 0.0  # after dispatch, learned from answers (`first_byte`)
        self.remote_peers = 0  # instances whose shares count here (watchers/flow_share.py)
        self.remote_waiting = 0  # requests waiting on those instances, all classes
        # Set by the driver where instances share: (peer, model, class, tenant) -> whether a
        # place on a replica of `model` was handed to that peer for that tenant's waiting
        # request (and is counted as taken here).
        self.hand_off: Callable[[str, str | None, str, str], bool] | None = None
        self.handed_off = 0  # places handed to peers
        self.places_received = 0  # and from them

    # -- who the request is --------------------------------------------------------------

    def ticket(self, tenant: str | None, klass: str | None, model: str | None, cost: float,
               ttft_slo_s: float | None, now: float) -> Ticket:
        """A ticket for a request; an unknown class falls to the tenant's or the default."""
        tenant = tenant or DEFAULT_TENANT
        policy = self.tenants.get(tenant)
        chosen = self.by_name.get(klass) if klass is not None else None
        if chosen is None:
            klass = policy.priority if policy is not None and policy.priority else self.default_class
            chosen = self.by_name[klass]
        if ttft_slo_s is None:
            ttft_slo_s = chosen.spec.ttft_slo_s
        label = tenant if policy is not None or tenant in self._labels else self._label(tenant)
        return Ticket(tenant, klass, model, cost if cost > 1.0 else 1.0, ttft_slo_s, now, label)

    def known_tenant(self, tenant: str) -> bool:
        """Configured, or named before (and so already checked as a label)."""
        return tenant in self.tenants or tenant in self._labels

    def _label(self, tenant: str) -> str:
        """Configured tenants are labels; tenants named by headers are, up to `max_tenants`."""
        if tenant in self.tenants or tenant == DEFAULT_TENANT:
            return tenant
        labels = self._labels
        if tenant in labels:
            return tenant
        if len(labels) >= self.max_tenants:
            return OTHER_TENANT
        labels[tenant] = None
        return tenant

    # -- the driver's steps ----------------------------------------------------------------

    def arrive(self, ticket: Ticket, now: float) -> tuple[str, Sequence[Ticket], Sequence[Ticket]]:
        """GO: admitted now. WAIT: queued; the driver waits for the ticket to come back from
        `done`/`pump`, or until `ticket.deadline`. Raises the refusal (429, with a reason).
        Also returns the tickets to wake (this one among them when it can go at once after
        all) and those displaced to make room: the driver answers each with its `refusal`."""
        ticket.seq = self._seq = self._seq + 1
        if self.queued == 0 and self.in_flight < self.max_in_flight:
            # The path of every request below saturation: kept to a few lookups.
            self.in_flight += 1
            ticket.state = RUNNING
            # Service is service, queued or not: who used the fleet before it saturated
            # does not start level with who did not.
            klass = self.by_name[ticket.klass]
            klass.dispatched.append(now)
            tenant = klass.tenants.get(ticket.tenant) or self._tenant(klass, ticket.tenant, now)
            tenant.running += 1
            ticket.share = tenant
            self._charge(tenant, ticket, now)
            return GO, NOTHING, NOTHING
        displaced = self._enqueue(ticket, now, front=False)
        return WAIT, self.pump(now), displaced

    def saturated(self, ticket: Ticket, now: float) -> tuple[list[Ticket], list[Ticket]]:
        """An admitted ticket found no replica with room: it gives its place back and waits,
        keeping its turn. Returns (tickets to wake, tickets displaced); raises its refusal
        when it cannot wait."""
        assert ticket.state == RUNNING
        self._unreserve(ticket)
        self.in_flight -= 1
        self._ended(ticket)
        ticket.state = NEW
        displaced = self._enqueue(ticket, now, front=True)
        # Its place may go to a request for another model that has room.
        return self.pump(now), displaced

    def placed(self, ticket: Ticket) -> None:
        """The dispatched ticket's request holds a replica slot now: its reservation ends."""
        self._unreserve(ticket)

    def first_byte(self, ticket: Ticket, ttft_s: float) -> None:
        """The time to first token of a request that waited: what a waiter will add."""
        if ticket.queued_s > 0:
            estimate = self.ttft_estimate_s
            self.ttft_estimate_s = ttft_s if estimate == 0 else estimate + TTFT_EWMA * (ttft_s - estimate)

    def done(self, ticket: Ticket, now: float) -> Sequence[Ticket]:
        """The request is over, however it ended. Returns the tickets to wake."""
        if ticket.state == RUNNING:
            if ticket.reserved:
                self._unreserve(ticket)
            self.in_flight -= 1
            self._ended(ticket)
            self._completions.append(now)
        elif ticket.state == QUEUED:
            self._remove(ticket, now)
        ticket.state = ENDED
        if self.queued:
            return self.pump(now)
        if self.remote_waiting and self.hand_off is not None:
            self._hand_idle(ticket.model, ticket.cost, now)
        return NOTHING

    def withdraw(self, ticket: Ticket, now: float) -> Sequence[Ticket]:
        """The client left: same as `done`."""
        return self.done(ticket, now)

    def expire(self, ticket: Ticket, now: float) -> ClientError | None:
        """The ticket's deadline passed: its refusal, if it was still waiting."""
        if ticket.state != QUEUED:
            return None
        self._remove(ticket, now)
        ticket.state = ENDED
        if ticket.ttft_slo_s is not None and ticket.deadline < ticket.arrived + self.queue_timeout_s:
            return refusal(TTFT_SLO, f"its time-to-first-token target ({ticket.ttft_slo_s * 1000:g} ms) "
                                     "can no longer be met", self._retry_after(0.0))
        return refusal(QUEUE_TIMEOUT, f"no capacity within limits.queue_timeout_s ({self.queue_timeout_s} s)",
                       self._retry_after(0.0))

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch waiting tickets into free places, in order. Returns them (RUNNING, each
        holding a reservation until `placed` or `done`)."""
        woken: list[Ticket] = []
        full: set[str | None] = set()
        while self.queued and self.in_flight < self.max_in_flight:
            ticket = self._next(full, now)
            if ticket is None:
                break
            model = ticket.model
            free = self._free_slots(model, now) - self._reserved.get(model, 0)
            if free <= 0 or (free <= self.headroom_places and self._heaviest(ticket, now)):
                # The last places stay for the class's lighter tenants, who then find one
                # at once rather than waiting for the next request to end.
                full.add(model)
                continue
            if self.remote_waiting and self.hand_off is not None:
                elsewhere = self._needier_elsewhere(ticket, now)
                if elsewhere is not None and self._hand(*elsewhere, model, ticket.cost, now):
                    continue  # that place counts as taken now; the next is looked at
            self._dispatch(ticket, now)
            woken.append(ticket)
        return woken

    # -- other instances -------------------------------------------------------------------

    def shared_state(self, now: float) -> list[list[Any]]:
        """This instance's share, for its peers: [class, tenant, attained service now,
        requests waiting] for each tenant that has any."""
        out = []
        for klass in self.classes:
            for name, tenant in klass.tenants.items():
                attained = self._attained(tenant, now)
                if attained >= 1.0 or tenant.queue:
                    out.append([klass.spec.name, name, attained, len(tenant.queue)])
        return out

    def set_remote(self, shares: Mapping[tuple[str, str], tuple[float, int]], now: float, peers: int,
                   where: Mapping[tuple[str, str], str] | None = None) -> None:
        """The other instances' shares together, as of `now`: per (class, tenant) the
        attained service and the requests waiting, and `where` the instance holding most of
        those. Empty: enforce locally."""
        for klass in self.classes:
            klass.remote, klass.remote_queued, klass.remote_at, klass.remote_where = {}, {}, now, {}
        waiting = 0
        for (class_name, tenant), (attained, queued) in shares.items():
            klass = self.by_name.get(class_name)
            if klass is None or len(klass.remote) >= self.max_tenants:
                continue  # a class this instance does not have; or more tenants than it keeps
            klass.remote[tenant] = attained
            if queued:
                klass.remote_queued[tenant] = queued
                waiting += queued
                peer = where.get((class_name, tenant)) if where is not None else None
                if peer is not None:
                    klass.remote_where[tenant] = peer
        self.remote_peers = peers
        self.remote_waiting = waiting

    def _needier_elsewhere(self, ticket: Ticket, now: float) -> tuple[_Class, str] | None:
        """A tenant waiting on another instance that one fair share would serve before
        `ticket`: in a higher class (unless `ticket`'s class has a share reserved), or in its
        class with less service than `ticket`'s tenant by more than this request's cost, so
        that views a little stale on either side do not hand places back and forth."""
        own = self.by_name[ticket.klass]
        for klass in self.classes:
            if klass.rank > own.rank:
                return None
            if not klass.remote_queued or (klass is not own and own.spec.reserved_share > 0):
                continue
            if klass is not own:
                return klass, min(klass.remote_queued, key=lambda name: self._service(klass, name, now))
            tenant = own.tenants[ticket.tenant]
            least = self._attained(tenant, now, own, ticket.tenant) - ticket.cost / tenant.weight
            best = None
            for name in own.remote_queued:
                local = own.tenants.get(name)
                if name == ticket.tenant or (local is not None and local.queue):
                    continue  # waiting here too: this instance's own order already counts it
                service = self._service(own, name, now)
                if service < least:
                    best, least = name, service
            return (own, best) if best is not None else None
        return None

    def _hand_idle(self, model: str | None, cost: float, now: float) -> None:
        """Nothing waits here: the place that just freed goes to the least served tenant
        waiting elsewhere, highest class first, rather than idling until that instance
        hears of it."""
        free = self._free_slots(model, now) - self._reserved.get(model, 0)
        while free > 0 and self.remote_waiting:
            klass = next((c for c in self.classes if c.remote_queued), None)
            if klass is None:
                return
            name = min(klass.remote_queued, key=lambda n: self._service(klass, n, now))
            if not self._hand(klass, name, model, cost, now):
                return
            free -= 1

    def _hand(self, klass: _Class, name: str, model: str | None, cost: float, now: float) -> bool:
        """Hands a place to the instance where `name` waits, and counts there, until the next
        exchange says otherwise, one request fewer waiting and the service of a request like
        the one it came from (`cost`: what is known here of the peer's requests is their number)."""
        hand_off, peer = self.hand_off, klass.remote_where.get(name)
        if hand_off is None or peer is None or not hand_off(peer, model, klass.spec.name, name):
            return False
        self.handed_off += 1
        left = klass.remote_queued[name] - 1
        if left:
            klass.remote_queued[name] = left
        else:
            del klass.remote_queued[name]
        self.remote_waiting -= 1
        # Unfaded since the exchange: it is at most an interval old, against a window of seconds.
        klass.remote[name] = klass.remote.get(name, 0.0) + cost / self._policy(name).weight
        return True

    def _service(self, klass: _Class, name: str, now: float) -> float:
        """A tenant's attained service on all instances, whether or not it is known here."""
        local = klass.tenants.get(name)
        if local is not None:
            return self._attained(local, now, klass, name)
        return klass.remote.get(name, 0.0) * math.exp(-max(now - klass.remote_at, 0.0) / self.fairness_window_s)

    # -- reading ----------------------------------------------------------------------------

    def would_wait(self) -> bool:
        """Whether a request arriving now could not go at once (it may still be refused)."""
        return self.queued > 0 or self.in_flight >= self.max_in_flight

    def queued_in(self, klass: str) -> int:
        return self.by_name[klass].queued

    def predicted_wait_s(self, ticket: Ticket, now: float, front: bool = False) -> float:
        """How long `ticket` would wait if queued now: the higher classes' queues over the
        rate at which places have been freeing, then those before it in its own class over
        what of that rate the higher classes' traffic leaves (at least its reserved share)."""
        rate = _rate(self._completions, None)
        if rate <= 0:  # nothing has finished yet: no grounds to refuse, the deadline still holds
            return 0.0
        own = self.by_name[ticket.klass]
        higher = [c for c in self.classes if c.rank < own.rank]
        left = rate - sum(_rate(c.dispatched, now) for c in higher)
        left = max(left, own.spec.reserved_share * rate)
        ahead_higher = sum(c.queued for c in higher)
        if left <= 0:
            return math.inf
        return ahead_higher / rate + self._ahead(ticket, front) / left

    def _ahead(self, ticket: Ticket, front: bool) -> float:
        """Requests of its own class that would go before `ticket`, and itself; `front`: it
        goes back to the head of its tenant's queue."""
        own = self.by_name[ticket.klass]
        ahead = 0.0
        tenant = own.tenants.get(ticket.tenant)
        mine = len(tenant.queue) if tenant is not None and not front else 0
        weight = tenant.weight if tenant is not None else self._policy(ticket.tenant).weight
        # Fair sharing: each other backlogged tenant sends about as many (by weight) as this
        # one before it, and never more than it has queued.
        for name, other in own.tenants.items():
            if name != ticket.tenant and other.queue:
                ahead += min(len(other.queue), (mine + 1) * other.weight / weight)
        return ahead + mine + 1

    def _retry_after(self, wait_s: float) -> int:
        return max(1, math.ceil(min(wait_s, self.queue_timeout_s)))

    # -- inside ---------------------------------------------------------------------------

    def _policy(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant) or self.default_tenant

    def _enqueue(self, ticket: Ticket, now: float, front: bool) -> list[Ticket]:
        klass = self.by_name[ticket.klass]
        slo = ticket.ttft_slo_s
        waited = now - ticket.arrived
        wait = self.predicted_wait_s(ticket, now, front)
        after = ticket.ttft_after_s if ticket.ttft_after_s is not None else self.ttft_estimate_s
        if slo is not None and waited + wait + after > slo:
            raise refusal(TTFT_SLO, f"the predicted time to first token ({(waited + wait + after) * 1000:.0f} ms) "
                                    f"exceeds its target ({slo * 1000:g} ms)", self._retry_after(wait))
        if waited + wait > EARLY_REFUSAL_SHARE * self.queue_timeout_s:
            # It would time out in line: better told now, with the wait to expect.
            raise refusal(WAIT_TOO_LONG, f"the predicted wait ({wait:.1f} s) would use up most of "
                                         f"limits.queue_timeout_s ({self.queue_timeout_s:g} s)", self._retry_after(wait))
        tenant = self._tenant(klass, ticket.tenant, now)
        if tenant.max_queued is not None and (
                len(tenant.queue) + klass.remote_queued.get(ticket.tenant, 0) >= tenant.max_queued):
            raise refusal(TENANT_QUEUE_FULL, "this tenant's queue is full", self._retry_after(wait))
        displaced = []
        if self.queued >= self.max_queued or klass.queued >= klass.max_queued:
            victim = self._victim(klass, ticket.tenant, class_full=klass.queued >= klass.max_queued)
            if victim is None:
                raise refusal(QUEUE_FULL, "the queue for its class is full", self._retry_after(wait))
            self._remove(victim, now)
            victim.state = ENDED
            victim.refusal = refusal(DISPLACED, "a request of higher priority or a smaller share took its place",
                                     self._retry_after(self.predicted_wait_s(victim, now)))
            displaced.append(victim)
        if front:
            tenant.queue.appendleft(ticket)
        else:
            tenant.queue.append(ticket)
        klass.tenants.move_to_end(ticket.tenant)
        klass.queued += 1
        self.queued += 1
        ticket.state = QUEUED
        ticket.queued_at = now
        limit = ticket.arrived + self.queue_timeout_s
        if slo is not None:
            # Waiting past this cannot meet the target: better an early no.
            limit = min(limit, ticket.arrived + max(slo - after, 0.0))
        ticket.deadline = limit
        return displaced

    def _victim(self, klass: _Class, tenant: str, class_full: bool) -> Ticket | None:
        """What a full queue gives up for a request of `klass` from `tenant`, if anything."""
        if not class_full:
            lower = [c for c in self.classes if c.rank > klass.rank and c.queued]
            # Sheddable work goes first, the lowest class first.
            lower.sort(key=lambda c: (not c.spec.sheddable, -c.rank))
            for other in lower:
                victim = self._newest_of_largest(other, None)
                if victim is not None:
                    return victim
        return self._newest_of_largest(klass, tenant)

    @staticmethod
    def _newest_of_largest(klass: _Class, arriving: str | None) -> Ticket | None:
        """The newest request of the tenant with the largest weighted share of `klass`'s
        queue; within the arriving tenant's own class, only when that share is larger than
        the arriving tenant's would be with this request."""
        largest, share = None, -1.0
        for tenant in klass.tenants.values():
            if tenant.queue and len(tenant.queue) / tenant.weight > share:
                largest, share = tenant, len(tenant.queue) / tenant.weight
        if largest is None:
            return None
        if arriving is not None:
            own = klass.tenants.get(arriving)
            mine = ((len(own.queue) + 1) / own.weight) if own is not None else 1.0
            if largest is own or share <= mine:
                return None
        return largest.queue[-1]

    def _remove(self, ticket: Ticket, now: float) -> None:
        klass = self.by_name[ticket.klass]
        klass.tenants[ticket.tenant].queue.remove(ticket)
        klass.queued -= 1
        self.queued -= 1
        ticket.queued_s += now - ticket.queued_at

    def _next(self, full: set[str | None], now: float) -> Ticket | None:
        """The next ticket by class priority (with reserved shares), then least attained
        service among the class's tenants; tickets whose model has no room are passed over."""
        waiting = [c for c in self.classes if c.queued]
        for klass in self.classes:
            if not klass.queued:
                klass.credit = 0.0
        order = waiting
        owed = [c for c in waiting[1:] if c.spec.reserved_share > 0]
        if owed:
            for c in owed:
                c.credit += c.spec.reserved_share
            due = max(owed, key=lambda c: c.credit)
            if due.credit >= 1.0:
                order = [due] + [c for c in waiting if c is not due]
        for klass in order:
            best, best_key = None, None
            for name, tenant in klass.tenants.items():
                head = _first_with_room(tenant.queue, full)
                if head is None:
                    continue
                key = (self._attained(tenant, now, klass, name), head.seq)
                if best_key is None or key < best_key:
                    best, best_key = head, key
            if best is not None:
                if klass is not waiting[0] and klass.credit >= 1.0:
                    klass.credit -= 1.0
                return best
        return None

    @staticmethod
    def _ended(ticket: Ticket) -> None:
        tenant, ticket.share = ticket.share, None
        if tenant is not None:
            tenant.running -= 1

    def _heaviest(self, ticket: Ticket, now: float) -> bool:
        """Whether `ticket`'s tenant has had the most service in its class while another
        tenant has had some too, and holds more places than the headroom: then it is never
        held back to nothing, however small the fleet."""
        klass = self.by_name[ticket.klass]
        own = klass.tenants[ticket.tenant]
        if own.running <= self.headroom_places:
            return False
        mine = self._attained(own, now, klass, ticket.tenant)
        others = False
        for name, tenant in klass.tenants.items():
            if name == ticket.tenant:
                continue
            attained = self._attained(tenant, now, klass, name)
            if attained > mine:
                return False
            others = others or attained >= 1.0
        for name, attained in klass.remote.items():
            if name not in klass.tenants and attained > mine:
                return False
            others = others or attained >= 1.0
        return others

    def _tenant(self, klass: _Class, name: str, now: float) -> _Tenant:
        tenant = klass.tenants.get(name)
        if tenant is None:
            policy = self._policy(name)
            tenant = klass.tenants[name] = _Tenant(policy.weight, policy.max_queued, 0.0, now)
            self._trim_idle(klass, name)
        return tenant

    def _charge(self, tenant: _Tenant, ticket: Ticket, now: float) -> None:
        tenant.attained = self._attained(tenant, now) + ticket.cost / tenant.weight
        tenant.at = now

    def _attained(self, tenant: _Tenant, now: float, klass: _Class | None = None, name: str = "") -> float:
        age = now - tenant.at
        own = tenant.attained * math.exp(-age / self.fairness_window_s) if age > 0 else tenant.attained
        if klass is None or not klass.remote:
            return own
        return own + klass.remote.get(name, 0.0) * math.exp(-max(now - klass.remote_at, 0.0) / self.fairness_window_s)

    def _dispatch(self, ticket: Ticket, now: float) -> None:
        klass = self.by_name[ticket.klass]
        tenant = klass.tenants[ticket.tenant]
        if tenant.queue[0] is ticket:
            tenant.queue.popleft()
        else:
            tenant.queue.remove(ticket)
        self._charge(tenant, ticket, now)
        tenant.running += 1
        ticket.share = tenant
        klass.dispatched.append(now)
        klass.queued -= 1
        self.queued -= 1
        ticket.queued_s += now - ticket.queued_at
        ticket.state = RUNNING
        ticket.deadline = math.inf
        ticket.reserved = True
        self._reserved[ticket.model] = self._reserved.get(ticket.model, 0) + 1
        self.in_flight += 1

    def _unreserve(self, ticket: Ticket) -> None:
        if ticket.reserved:
            ticket.reserved = False
            left = self._reserved[ticket.model] - 1
            if left:
                self._reserved[ticket.model] = left
            else:
                del self._reserved[ticket.model]

    def _trim_idle(self, klass: _Class, keep: str) -> None:
        """Tenants with nothing queued are forgotten oldest first beyond `max_tenants`."""
        tenants = klass.tenants
        if len(tenants) <= self.max_tenants:
            return
        for name in list(tenants):
            if len(tenants) <= self.max_tenants:
                break
            if name != keep and not tenants[name].queue and not tenants[name].running:
                del tenants[name]


def _rate(times: deque[float], now: float | None) -> float:
    """Events a second over `times`; with `now`, counting the quiet since the last one."""
    if len(times) < 2:
        return 0.0
    span = (now if now is not None else times[-1]) - times[0]
    return (len(times) - 1) / span if span > 0 else 0.0


# How far into a tenant's queue to look past requests for models with no room.
LOOK_PAST = 8


def _first_with_room(queue: deque[Ticket], full: set[str | None]) -> Ticket | None:
    """The tenant's oldest ticket whose model has room: one model's saturation does not hold
    back the tenant's requests for another."""
    if not queue:
        return None
    if not full or queue[0].model not in full:
        return queue[0]
    for i, ticket in enumerate(queue):
        if i >= LOOK_PAST:
            return None
        if ticket.model not in full:
            return ticket
    return None


def refusal(reason: str, why: str, retry_after: int) -> ClientError:
    return ClientError(
        429, f"kvlb is at capacity ({why}); retry shortly", reason,
        type_="rate_limit_error", retry_after=retry_after, headers=((REJECT_REASON_HEADER, reason),),
    )
