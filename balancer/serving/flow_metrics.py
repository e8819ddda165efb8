"""Flow control's metrics, per class and tenant: queue time, refusals by reason, requests and
tokens served, and how many met their time-to-first-token target. Tenant labels are bounded
(`flow_control.max_tenants`, beyond which tenants share the label `other`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from balancer.routing.flow import REASONS, FlowController, Ticket
from balancer.serving.metrics import _Histogram


class FlowMetrics(Collector):
    def __init__(self, flow: FlowController) -> None:
        self.flow = flow
        self.queue_time: defaultdict[tuple[str, str], _Histogram] = defaultdict(_Histogram)
        self.refused: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.served: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.tokens: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.slo: defaultdict[tuple[str, str, str], int] = defaultdict(int)

    def observe(self, ticket: Ticket, status: int, error: str, ttft_s: float | None) -> None:
        key = (ticket.klass, ticket.label)
        self.queue_time[key].observe(ticket.queued_s)
        if error in REASONS:
            self.refused[(*key, error)] += 1
        if status < 400 and ttft_s is not None:
            self.served[key] += 1
            self.tokens[key] += ticket.cost
        if ticket.ttft_slo_s is not None:
            met = status < 400 and ttft_s is not None and ttft_s <= ticket.ttft_slo_s
            self.slo[(*key, "true" if met else "false")] += 1

    def collect(self) -> Iterator[Metric]:
        queue_time = HistogramMetricFamily(
            "kvlb_flow_queue_seconds", "Time requests waited in flow control", labels=["class", "tenant"])
        for key, hist in list(self.queue_time.items()):
            queue_time.add_metric(list(key), hist.family_buckets(), hist.total)
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
        for key, count in list(self.served.items()):
            served.add_metric(list(key), count)
            tokens.add_metric(list(key), self.tokens[key])
        yield served
        yield tokens
        slo = CounterMetricFamily(
            "kvlb_flow_ttft_slo", "Requests with a time-to-first-token target, by whether they met it "
            "(a refused request did not)", labels=["class", "tenant", "met"])
        for key, count in list(self.slo.items()):
            slo.add_metric(list(key), count)
        yield slo
        yield GaugeMetricFamily(
            "kvlb_flow_shared_peers", "Other instances whose tenants' shares flow control counts (through "
            "Redis, sync.redis_url); 0: it enforces on this instance's own state", value=self.flow.remote_peers)
        queued = GaugeMetricFamily("kvlb_flow_queued_requests", "Requests waiting in flow control now",
                                   labels=["class"])
        for name in self.flow.by_name:
            queued.add_metric([name], self.flow.queued_in(name))
        yield queued
