"""Prometheus metrics. Per-app registry, so several balancers can live in one process (tests)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from balancer.fleet import Fleet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NO_REPLICA = "none"
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


class FleetCollector(Collector):
    """Reads load and health from the fleet at scrape time: the fleet stays the one source."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
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


class Metrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(FleetCollector(fleet))
        self.requests = Counter(
            "kvlb_requests",
            "Requests answered, by route, serving replica and HTTP status",
            ["route", "replica", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvlb_request_duration_seconds",
            "Time from receiving a request to the end of its response",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.attempts = Counter(
            "kvlb_upstream_attempts",
            "Attempts to send a request to a replica, by outcome",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "kvlb_client_disconnects",
            "Requests whose client went away before the response ended",
            ["route"],
            registry=self.registry,
        )
        # labels() takes a lock and builds a key each call; children are cached per label set.
        self._request_children: dict[tuple[str, str, int], Counter] = {}
        self._duration_children: dict[str, Histogram] = {}
        self._attempt_children: dict[tuple[str, str], Counter] = {}

    def count_attempt(self, replica: str, outcome: str) -> None:
        child = self._attempt_children.get((replica, outcome))
        if child is None:
            child = self._attempt_children[(replica, outcome)] = self.attempts.labels(replica, outcome)
        child.inc()

    def observe_request(self, route: str, replica: str, status: int, seconds: float) -> None:
        key = (route, replica, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, replica, str(status))
        child.inc()
        hist = self._duration_children.get(route)
        if hist is None:
            hist = self._duration_children[route] = self.duration.labels(route)
        hist.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
