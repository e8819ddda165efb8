"""Flow control's metrics, per class and tenant: queue time, refusals by reason, requests and
tokens served, and how many met their time-to-first-token target. Tenant labels are bounded
(`flow_control.max_tenants`, beyond which tenants share the label `other`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from balancer.routing.flow import REASONS, FlowController, Ticket
from balancer.serving.metrics import Histogram


@dataclass(slots=True)
class _Counts:
    """One (class, tenant)'s figures: one lookup per request ended."""

    queue_time: Histogram = field(default_factory=Histogram)
    served: int = 0
    tokens: float = 0.0
    slo_met: int = 0
    slo_missed: int = 0


class FlowMetrics(Collector):
    def __init__(self, flow: FlowController) -> None:
        self.flow = flow
        self.counts: dict[tuple[str, str], _Counts] = {}
        self.refused: defaultdict[tuple[str, str, str], int] = defaultdict(int)

    def observe(self, ticket: Ticket, status: int, error: str, ttft_s: float | None) -> None:
        key = (ticket.klass, ticket.label)
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = _Counts()
        queued = ticket.queued_s
        if queued:
            counts.queue_time.observe(queued)
        else:  # below saturation every request: its bucket is known, no search
            counts.queue_time.counts[0] += 1
        answered = status < 400 and ttft_s is not None
        if answered:
            counts.served += 1
            counts.tokens += ticket.cost
        elif error in REASONS:
            self.refused[(*key, error)] += 1
        slo = ticket.ttft_slo_s
        if slo is not None:
            if answered and ttft_s <= slo:
                counts.slo_met += 1
            else:
                counts.slo_missed += 1

    def collect(self) -> Iterator[Metric]:
        queue_time = HistogramMetricFamily(
            "kvlb_flow_queue_seconds", "Time requests waited in flow control", labels=["class", "tenant"])
        counts = list(self.counts.items())
        for key, each in counts:
            queue_time.add_metric(list(key), each.queue_time.family_buckets(), each.queue_time.total)
        yield queue_time
        refused = CounterMetricFamily(
            "kvlb_flow_rejections", "Requests flow control refused (429), by reason",
            labels=["class", "tenant", "reason"])
        for key, count in list(self.refused.items()):
            refused.add_metric(list(key), count)
        yield refused
        served = CounterMetricFamily(
            "kvlb_flow_served_requests", "Requests answered after flow control", labels=["class", "tenant"])
        tokens = CounterMetricFamily(
            "kvlb_flow_served_tokens",
            "Tokens of the requests answered, as flow control counts them for fair sharing (prompt "
            "estimated from the body, plus the expected output)", labels=["class", "tenant"])
        for key, each in counts:
            if each.served:
                served.add_metric(list(key), each.served)
                tokens.add_metric(list(key), each.tokens)
        yield served
        yield tokens
        slo = CounterMetricFamily(
            "kvlb_flow_ttft_slo", "Requests with a time-to-first-token target, by whether they met it "
            "(a refused request did not)", labels=["class", "tenant", "met"])
        for key, each in counts:
            for met, count in (("true", each.slo_met), ("false", each.slo_missed)):
                if count:
                    slo.add_metric([*key, met], count)
        yield slo
        yield GaugeMetricFamily(
            "kvlb_flow_shared_peers", "Other instances whose tenants' shares flow control counts (through "
            "Redis, sync.redis_url); 0: it enforces on this instance's own state", value=self.flow.remote_peers)
        handed = CounterMetricFamily(
            "kvlb_flow_places_handed", "Places on replicas handed between instances because a tenant "
            "waiting on the other should go next, by direction (sent: given away; received)",
            labels=["direction"])
        handed.add_metric(["sent"], self.flow.handed_off)
        handed.add_metric(["received"], self.flow.places_received)
        yield handed
        queued = GaugeMetricFamily("kvlb_flow_queued_requests", "Requests waiting in flow control now",
                                   labels=["class"])
        for name in self.flow.by_name:
            queued.add_metric([name], self.flow.queued_in(name))
        yield queued
