"""Flow control (`balancer.routing.flow`) driven by the event loop: a waiting ticket holds a
future, its deadline is a timer on the loop's clock, and whatever the controller hands back
(tickets dispatched, tickets displaced) is woken here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from balancer.routing.flow import GO, RUNNING, FlowController, Ticket
from balancer.serving.flow_metrics import FlowMetrics

# While requests wait, how often places are looked for besides when a request ends here:
# room that frees on its own (another instance's request ending, a replica back from an
# ejection or joining the fleet) then reaches them within this.
PUMP_S = 0.05


class FlowGate:
    def __init__(self, flow: FlowController) -> None:
        self.flow = flow
        self.metrics = FlowMetrics(flow)
        self._pumping: asyncio.TimerHandle | None = None

    def try_enter(self, ticket: Ticket, now: float) -> bool:
        """True: the request may look for a replica now; False: it must `wait`. Raises its
        refusal. (Not a coroutine: below saturation nothing here may cost an await.)"""
        outcome, woken, displaced = self.flow.arrive(ticket, now)
        if woken or displaced:
            self._wake(woken, displaced)
        return outcome == GO

    async def saturated(self, ticket: Ticket) -> None:
        """No replica had room: wait, keeping its turn, until one may."""
        woken, displaced = self.flow.saturated(ticket, asyncio.get_running_loop().time())
        self._wake(woken, displaced)
        await self.wait(ticket)

    def wake(self, woken: Iterable[Ticket]) -> None:
        """What `flow.done` handed back (the driver calls the controller itself there: every
        request ends through it, so one frame fewer)."""
        self._wake(woken, ())

    def room_freed(self) -> None:
        """Room this instance's own requests did not free (a place another instance handed
        here): the line is looked at now rather than at the next pump."""
        flow = self.flow
        if flow.queued:
            self._wake(flow.pump(asyncio.get_running_loop().time()), ())

    async def wait(self, ticket: Ticket) -> None:
        """Until its turn comes; raises its refusal."""
        if ticket.state == RUNNING:  # dispatched at once, by the call that queued it
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        ticket.waiter = waiter
        if self._pumping is None:
            self._pumping = loop.call_later(PUMP_S, self._pump)
        try:
            async with asyncio.timeout_at(ticket.deadline):
                await waiter
        except TimeoutError:
            refusal = self.flow.expire(ticket, loop.time())
            if refusal is not None:
                raise refusal from None
            # Dispatched (or displaced) just as its time ran out: take what it got.
        finally:
            ticket.waiter = None
        if ticket.refusal is not None:
            raise ticket.refusal

    def _pump(self) -> None:
        self._pumping = None
        flow = self.flow
        if not flow.queued:
            return
        loop = asyncio.get_running_loop()
        self._wake(flow.pump(loop.time()), ())
        if flow.queued:
            self._pumping = loop.call_later(PUMP_S, self._pump)

    @staticmethod
    def _wake(woken: Iterable[Ticket], displaced: Iterable[Ticket]) -> None:
        for group in (woken, displaced):
            for ticket in group:
                waiter = ticket.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
