"""Prometheus metrics, counted in plain dicts and turned into metric families at scrape time.

prometheus_client's labelled children take a lock and allocate on every update; counting
here costs a dict increment per request, and the exposition (names, types, text format)
is still prometheus_client's. One registry per balancer, so several can share a process.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from balancer.fleet import Fleet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NO_REPLICA = "none"
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


class _Histogram:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, value)] += 1
        self.total += value

    def family_buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), self.counts, strict=True):
            cumulative += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return out


class Metrics(Collector):
    """Every kvlb_* metric. Label values come from bounded sets: routes, replicas, statuses."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.requests: defaultdict[tuple[str, str, int], int] = defaultdict(int)
        self.durations: defaultdict[str, _Histogram] = defaultdict(_Histogram)
        self.attempts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.disconnects: defaultdict[str, int] = defaultdict(int)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe_request(self, route: str, replica: str, status: int, seconds: float) -> None:
        self.requests[(route, replica, status)] += 1
        self.durations[route].observe(seconds)

    def count_attempt(self, replica: str, outcome: str) -> None:
        self.attempts[(replica, outcome)] += 1

    def count_disconnect(self, route: str) -> None:
        self.disconnects[route] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "kvlb_requests", "Requests answered, by route, serving replica and HTTP status",
            labels=["route", "replica", "status"],
        )
        for (route, replica, status), count in list(self.requests.items()):
            requests.add_metric([route, replica, str(status)], count)
        yield requests

        duration = HistogramMetricFamily(
            "kvlb_request_duration_seconds", "Time from receiving a request to the end of its response",
            labels=["route"],
        )
        for route, hist in list(self.durations.items()):
            duration.add_metric([route], hist.family_buckets(), hist.total)
        yield duration

        attempts = CounterMetricFamily(
            "kvlb_upstream_attempts", "Attempts to send a request to a replica, by outcome",
            labels=["replica", "outcome"],
        )
        for (replica, outcome), count in list(self.attempts.items()):
            attempts.add_metric([replica, outcome], count)
        yield attempts

        disconnects = CounterMetricFamily(
            "kvlb_client_disconnects", "Requests whose client went away before the response ended",
            labels=["route"],
        )
        for route, count in list(self.disconnects.items()):
            disconnects.add_metric([route], count)
        yield disconnects

        # Load and health are read from the fleet, their one source of truth.
        in_flight = GaugeMetricFamily(
            "kvlb_in_flight_requests", "Requests routed to a replica and not finished", labels=["replica"]
        )
        healthy = GaugeMetricFamily(
            "kvlb_replica_healthy", "1 when the replica passes its health checks", labels=["replica"]
        )
        for replica in self.fleet.replicas:
            in_flight.add_metric([replica.name], replica.in_flight)
            healthy.add_metric([replica.name], 1.0 if replica.healthy else 0.0)
        yield in_flight
        yield healthy
