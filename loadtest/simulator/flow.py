"""Flow control (`balancer.routing.flow`) driven on virtual time: a waiting ticket's deadline is
an event, and the tickets the controller hands back are routed (or refused) at once, as the
proxy's futures would be woken."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from balancer.errors import ClientError
from balancer.routing.flow import GO, QUEUED, Ticket
from loadtest.client.summary import RequestRecord
from loadtest.client.workloads import WorkRequest

if TYPE_CHECKING:
    from loadtest.simulator.simulator import Simulator


class SimulatedFlow:
    def __init__(self, sim: Simulator, deadline_event: int) -> None:
        """`deadline_event`: the simulator's event kind that calls `expire` for a request."""
        self.sim = sim
        self.deadline_event = deadline_event
        flow = sim.core.flow
        assert flow is not None
        self.flow = flow
        # One per request of the run: kept to its end for the records.
        self.tickets: dict[int, Ticket] = {}

    def arrive(self, request: WorkRequest) -> None:
        sim = self.sim
        try:
            _, body, features = sim.prepared(request)
        except ClientError as exc:  # as the proxy, which parses before admission
            sim._record_error(request, exc.status, exc.message)
            return
        # Priced as the proxy prices it: from the body it would receive.
        ticket = self.flow.ticket(request.tenant, request.priority, features.model,
                                  sim.core.flow_cost(features, len(body)), None, sim.now)
        ticket.waiter = request
        self.tickets[request.index] = ticket
        if ticket.ttft_slo_s is not None and self.flow.would_wait():
            ticket.ttft_after_s = sim.predicted_ttft_s(request)
        try:
            outcome, woken, displaced = self.flow.arrive(ticket, sim.now)
        except ClientError as exc:
            sim._record_error(request, exc.status, exc.message, exc.code)
            return
        self._queued(ticket)
        self._wake(woken, displaced)
        if outcome == GO:
            sim._route(request)

    def saturated(self, request: WorkRequest) -> None:
        ticket = self.tickets[request.index]
        if ticket.ttft_slo_s is not None and ticket.ttft_after_s is None:
            ticket.ttft_after_s = self.sim.predicted_ttft_s(request)
        try:
            woken, displaced = self.flow.saturated(ticket, self.sim.now)
        except ClientError as exc:
            self.sim._record_error(request, exc.status, exc.message, exc.code)
            self.leave(request)
            return
        self._queued(ticket)
        self._wake(woken, displaced)

    def placed(self, request: WorkRequest) -> None:
        ticket = self.tickets[request.index]
        if ticket.reserved:  # as the proxy: only a dispatched ticket holds a reservation
            self.flow.placed(ticket)

    def first_byte(self, request: WorkRequest, now: float) -> None:
        ticket = self.tickets[request.index]
        self.flow.first_byte(ticket, now - request.arrival_s - ticket.queued_s)

    def leave(self, request: WorkRequest) -> None:
        ticket = self.tickets.get(request.index)
        if ticket is not None:
            self._wake(self.flow.done(ticket, self.sim.now), ())

    def expire(self, request: WorkRequest) -> None:
        ticket = self.tickets[request.index]
        refusal = self.flow.expire(ticket, self.sim.now)
        if refusal is not None:
            self.sim._record_error(request, refusal.status, refusal.message, refusal.code)

    def stamp(self, record: RequestRecord, request: WorkRequest) -> None:
        ticket = self.tickets.get(request.index)
        if ticket is not None:
            record.priority, record.ttft_slo_s, record.queued_s = ticket.klass, ticket.ttft_slo_s, ticket.queued_s
            record.tenant = ticket.tenant

    def _queued(self, ticket: Ticket) -> None:
        if ticket.state == QUEUED:
            self.sim._at(ticket.deadline, self.deadline_event, ticket.waiter)

    def _wake(self, woken: Sequence[Ticket], displaced: Sequence[Ticket]) -> None:
        sim = self.sim
        for ticket in displaced:
            refusal = ticket.refusal
            assert refusal is not None
            sim._record_error(ticket.waiter, refusal.status, refusal.message, refusal.code)
        for ticket in woken:
            sim._route(ticket.waiter)
