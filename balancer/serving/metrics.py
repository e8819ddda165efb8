"""Prometheus metrics, counted in plain dicts and turned into metric families at scrape time.

prometheus_client's labelled children take a lock and allocate on every update; counting
here costs a dict increment per request, and the exposition (names, types, text format)
is still prometheus_client's. One registry per balancer, so several can share a process.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from balancer.protocol import (
    METRIC_PREFIX_INDEX_BYTES,
    METRIC_PREFIX_INDEX_ENTRIES,
    METRIC_REQUESTS,
)
from balancer.routing.answer_returns import EXPLORE_EVERY, MIN_RETURN_SHARE, AnswerReturns
from balancer.routing.batch_persistence import BatchPersistences
from balancer.routing.breaker import STATE_VALUES
from balancer.routing.fleet import Fleet
from balancer.routing.index import PrefixIndex
from balancer.routing.token_ratio import TokenRatio
from policies.base import MODEL_ITL_PARTS, MODEL_TTFT_PARTS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NO_REPLICA = "none"
ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
# Observed over predicted time to first token: 1.0 is exact, 2.0 twice too slow.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0)
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# Routing decisions take tens to hundreds of microseconds (README, "Routing cost").
DECISION_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)
# Estimated memory of one prefix-index (replica, block) entry, nodes included. Prompts with
# shared prefixes cost 175-248 bytes an entry (`python -m loadtest.bench.routing`); prompts
# that share nothing, each entry its own node, cost ~360 bytes of RSS an entry over two
# million (`python -m loadtest.bench.memory`). The estimate takes the worst case.
INDEX_BYTES_PER_ENTRY = 360

# Per replica that serves LoRA adapters, by kvlb's account of its slots (balancer/routing/
# adapters.py): slots, resident adapters, loads made, loads under way.
ADAPTER_REPLICA_METRICS: tuple[tuple[Any, str, str], ...] = (
    (GaugeMetricFamily, "kvlb_replica_adapter_slots",
     "LoRA adapters the replica holds at once (config's max_loras, else as the engine reports it)"),
    (GaugeMetricFamily, "kvlb_replica_adapters_resident", "LoRA adapters in the replica's slots, by kvlb's account"),
    (CounterMetricFamily, "kvlb_replica_adapter_loads",
     "LoRA adapter loads this instance's requests made the replica do, by kvlb's account of its slots"),
    (GaugeMetricFamily, "kvlb_replica_adapter_loading_ms",
     "LoRA adapter loads under way on the replica for requests not yet answered (this instance's "
     "and its peers'), ms: every request there waits them out"),
)


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family_buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return out


class Metrics(Collector):
    """Every kvlb_* metric (but the sync ones: balancer/watchers/sync.py). Label values come from
    bounded sets: routes, models the fleet serves, replicas, statuses."""

    def __init__(self, fleet: Fleet, index: PrefixIndex | None = None) -> None:
        self.fleet = fleet
        self.index = index  # the prefix index, for cache-aware policies
        self.token_ratio: TokenRatio | None = None  # the approximate index's tokens per character
        self.answer_returns: AnswerReturns | None = None  # whether answers come back, where recorded
        self.batch_persistence: BatchPersistences | None = None  # the routing core's, per model
        self.requests: defaultdict[tuple[str, str, str, int], int] = defaultdict(int)
        self.durations: defaultdict[str, Histogram] = defaultdict(Histogram)
        self.ttfts: defaultdict[tuple[str, str], Histogram] = defaultdict(Histogram)
        self.decisions: defaultdict[str, Histogram] = defaultdict(lambda: Histogram(DECISION_BUCKETS))
        self.failovers: defaultdict[str, int] = defaultdict(int)
        self.attempts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.disconnects: defaultdict[str, int] = defaultdict(int)
        self.client_stalls: defaultdict[str, int] = defaultdict(int)
        # Requests the HTTP wire refused while reading them (limits, framing, timeouts), by
        # error code; the servers count into it (balancer/wire/server.py).
        self.client_refusals: Counter[str] = Counter()
        # Requests of a fleet with prefill and decode roles, by how they were served
        # (balancer/routing/disaggregation.py: split, or whole on one replica and why).
        self.disaggregation: Counter[str] = Counter()
        self.prompt_tokens: defaultdict[str, int] = defaultdict(int)
        self.predicted_tokens: defaultdict[str, int] = defaultdict(int)
        self.actual_tokens: defaultdict[str, int] = defaultdict(int)
        self.corrections: defaultdict[str, int] = defaultdict(int)
        self.prediction_error = Histogram(ERROR_BUCKETS)
        self.ttft_error = Histogram(RATIO_BUCKETS)
        self.itl_error = Histogram(RATIO_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe_request(
        self, route: str, replica: str, status: int, seconds: float, model: str = "",
        ttft: float | None = None, failover: bool = False,
    ) -> None:
        """One request answered. `ttft`: seconds to the answer's first byte, when a replica
        answered; `failover`: it was answered by other than its first-ranked replica."""
        self.requests[(route, model, replica, status)] += 1
        self.durations[route].observe(seconds)
        if ttft is not None:
            self.ttfts[(route, replica)].observe(ttft)
        if failover:
            self.failovers[route] += 1

    def observe_decision(self, route: str, seconds: float) -> None:
        self.decisions[route].observe(seconds)

    def count_attempt(self, replica: str, outcome: str) -> None:
        self.attempts[(replica, outcome)] += 1

    def count_disconnect(self, route: str) -> None:
        self.disconnects[route] += 1

    def count_client_stall(self, route: str) -> None:
        self.client_stalls[route] += 1

    def forget_replica(self, replica: str) -> None:
        """A replica left the fleet: its series go too, so they do not pile up as replicas
        come and go (a Prometheus series that disappears is read as ended)."""
        for table, at in ((self.requests, 2), (self.ttfts, 1), (self.attempts, 0)):
            for key in [k for k in table if k[at] == replica]:
                del table[key]
        for table in (self.prompt_tokens, self.predicted_tokens, self.actual_tokens, self.corrections):
            table.pop(replica, None)

    def observe_lesson(
        self, replica: str, predicted: int, actual: int, corrected: bool, prompt_tokens: int = 0
    ) -> None:
        """A replica's reported cached tokens against the prefix index's prediction, and the
        prompt's length: actual / prompt is the cache hit ratio."""
        self.prompt_tokens[replica] += prompt_tokens
        self.predicted_tokens[replica] += predicted
        self.actual_tokens[replica] += actual
        self.prediction_error.observe(abs(predicted - actual))
        if corrected:
            self.corrections[replica] += 1

    def observe_ttft_error(self, ratio: float) -> None:
        """A streamed answer's observed time to first byte over the policy's prediction."""
        self.ttft_error.observe(ratio)

    def observe_itl_error(self, ratio: float) -> None:
        """A streamed answer's observed time per output token over the policy's prediction."""
        self.itl_error.observe(ratio)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            METRIC_REQUESTS,
            "Requests answered, by route, model (\"\" when none or unknown), serving replica and HTTP status",
            labels=["route", "model", "replica", "status"],
        )
        for (route, model, replica, status), count in list(self.requests.items()):
            requests.add_metric([route, model, replica, str(status)], count)
        yield requests

        duration = HistogramMetricFamily(
            "kvlb_request_duration_seconds", "Time from receiving a request to the end of its response",
            labels=["route"],
        )
        for route, hist in list(self.durations.items()):
            duration.add_metric([route], hist.family_buckets(), hist.total)
        yield duration

        ttft = HistogramMetricFamily(
            "kvlb_time_to_first_token_seconds",
            "Time from receiving a request to relaying the first byte of its replica's answer "
            "(a whole answer when not streamed)",
            labels=["route", "replica"],
        )
        for (route, replica), hist in list(self.ttfts.items()):
            ttft.add_metric([route, replica], hist.family_buckets(), hist.total)
        yield ttft

        decision = HistogramMetricFamily(
            "kvlb_routing_decision_seconds",
            "CPU time to route a request: parse the body, predict cached prefixes, rank replicas",
            labels=["route"],
        )
        for route, hist in list(self.decisions.items()):
            decision.add_metric([route], hist.family_buckets(), hist.total)
        yield decision

        failovers = CounterMetricFamily(
            "kvlb_failovers", "Requests answered by other than their first-ranked replica", labels=["route"]
        )
        for route, count in list(self.failovers.items()):
            failovers.add_metric([route], count)
        yield failovers

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

        stalls = CounterMetricFamily(
            "kvlb_client_stalls",
            "Answers cut because their client stopped reading for timeouts.client_write_s",
            labels=["route"],
        )
        for route, count in list(self.client_stalls.items()):
            stalls.add_metric([route], count)
        yield stalls

        refusals = CounterMetricFamily(
            "kvlb_client_refusals",
            "Requests refused while being read (connection and buffer caps, size, framing, time "
            "limits), by error code",
            labels=["reason"],
        )
        for reason, count in sorted(self.client_refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals

        split = CounterMetricFamily(
            "kvlb_disaggregation",
            "Requests to a fleet with prefill and decode roles, by outcome: disaggregated, "
            "colocated_cached (too little uncached prompt for a transfer), colocated_no_pair or "
            "colocated_faster (the prefill pool queues longer than a whole run would take)",
            labels=["outcome"],
        )
        for reason, count in sorted(self.disaggregation.items()):
            split.add_metric([reason], count)
        yield split

        prompt = CounterMetricFamily(
            "kvlb_prefix_prompt_tokens",
            "Prompt tokens (the balancer's estimate) of the answers that reported their cached tokens",
            labels=["replica"],
        )
        predicted = CounterMetricFamily(
            "kvlb_prefix_predicted_cached_tokens",
            "Cached prompt tokens the prefix index predicted, for answers that reported theirs",
            labels=["replica"],
        )
        actual = CounterMetricFamily(
            "kvlb_prefix_actual_cached_tokens",
            "Cached prompt tokens replicas reported (in the balancer's token estimate)",
            labels=["replica"],
        )
        corrections = CounterMetricFamily(
            "kvlb_prefix_index_corrections",
            "Times a replica held less than predicted and the index forgot what it had evicted",
            labels=["replica"],
        )
        for replica in list(self.predicted_tokens):
            prompt.add_metric([replica], self.prompt_tokens.get(replica, 0))
            predicted.add_metric([replica], self.predicted_tokens[replica])
            actual.add_metric([replica], self.actual_tokens[replica])
            corrections.add_metric([replica], self.corrections.get(replica, 0))
        yield prompt
        yield predicted
        yield actual
        yield corrections
        error = HistogramMetricFamily(
            "kvlb_prefix_prediction_error_tokens",
            "Absolute difference between predicted and reported cached tokens per answer",
        )
        error.add_metric([], self.prediction_error.family_buckets(), self.prediction_error.total)
        yield error
        ttft_error = HistogramMetricFamily(
            "kvlb_ttft_prediction_ratio",
            "Observed over predicted time to first token of streamed answers (predictive policy; "
            "1.0 is exact), with each replica's fitted speed applied",
        )
        ttft_error.add_metric([], self.ttft_error.family_buckets(), self.ttft_error.total)
        yield ttft_error
        itl_error = HistogramMetricFamily(
            "kvlb_itl_prediction_ratio",
            "Observed over predicted time per output token of streamed answers that reported "
            "their length (predictive policy; 1.0 is exact), with each replica's fitted decode "
            "speed applied",
        )
        itl_error.add_metric([], self.itl_error.family_buckets(), self.itl_error.total)
        yield itl_error

        if self.token_ratio is not None:
            per_char = GaugeMetricFamily(
                "kvlb_tokens_per_char",
                "Prompt tokens per character of prompt text, learned per model from the "
                "replicas' usage.prompt_tokens (the approximate index's text-to-token estimate)",
                labels=["model"],
            )
            for model, ratio in self.token_ratio.models().items():
                per_char.add_metric([model], ratio)
            yield per_char

        if self.answer_returns is not None:
            yield GaugeMetricFamily(
                "kvlb_answer_return_share",
                "Share of the answers recorded in the prefix index lately that a later prompt "
                f"sent back (a conversation's next turn); under {MIN_RETURN_SHARE}, only one "
                f"answer in {EXPLORE_EVERY} is recorded",
                value=self.answer_returns.share,
            )

        if self.batch_persistence is not None:
            persistence = GaugeMetricFamily(
                "kvlb_batch_persistence",
                "How much of a replica's decode batch at sending the model's streamed answers "
                "lately still decoded beside, 0 to 1, learned (predictive prices the batch so); "
                "absent until learned",
                labels=["model"],
            )
            for model, slope in self.batch_persistence.slopes().items():
                persistence.add_metric([model or ""], slope)
            yield persistence

        index = self.index
        entries = index.entries if index is not None else 0
        yield GaugeMetricFamily(
            METRIC_PREFIX_INDEX_ENTRIES, "(replica, prompt block) entries in the prefix index", value=entries
        )
        yield GaugeMetricFamily(
            METRIC_PREFIX_INDEX_BYTES,
            f"Estimated memory of the prefix index: entries x {INDEX_BYTES_PER_ENTRY} bytes",
            value=entries * INDEX_BYTES_PER_ENTRY,
        )
        evictions = CounterMetricFamily(
            "kvlb_prefix_index_evictions",
            "Prefix-index entries evicted: past index_ttl_s (ttl), past a replica's KV capacity, "
            "oldest first (capacity), past index_max_entries (budget)",
            labels=["reason"],
        )
        evictions.add_metric(["ttl"], index.evicted_ttl if index is not None else 0)
        evictions.add_metric(["capacity"], index.evicted_capacity if index is not None else 0)
        evictions.add_metric(["budget"], index.evicted_budget if index is not None else 0)
        yield evictions

        # Load and health are read from the fleet, their one source of truth.
        in_flight = GaugeMetricFamily(
            "kvlb_in_flight_requests", "Requests routed to a replica and not finished", labels=["replica"]
        )
        healthy = GaugeMetricFamily(
            "kvlb_replica_healthy", "1 when the replica passes its health checks", labels=["replica"]
        )
        breaker = GaugeMetricFamily(
            "kvlb_replica_breaker_state",
            "Outlier-ejection breaker per replica: 0 closed, 1 open (ejected), 2 half-open (probing)",
            labels=["replica"],
        )
        ejections = CounterMetricFamily(
            "kvlb_replica_ejections", "Times live traffic ejected the replica", labels=["replica"]
        )
        queued = GaugeMetricFamily(
            "kvlb_queued_prefill_tokens",
            "Prompt tokens routed to the replica and not yet past their first token (cache-aware policies)",
            labels=["replica"],
        )
        scale = GaugeMetricFamily(
            "kvlb_replica_ttft_scale",
            "Fitted multiplier on the replica's predicted time to first token (1.0 = as its "
            "profile; 2.0 = twice as slow), learned from streamed answers",
            labels=["replica"],
        )
        itl_scale = GaugeMetricFamily(
            "kvlb_replica_itl_scale",
            "Fitted multiplier on the replica's predicted time per output token (1.0 = as its "
            "profile), learned from streamed answers that reported their length",
            labels=["replica"],
        )
        ttft_terms = GaugeMetricFamily(
            "kvlb_replica_ttft_term_scale",
            "Fitted multiplier on each term of the replica's predicted time to first token "
            "(iteration: the engine iterations waited; token: its prompt tokens; attention), "
            "from answers that found its prefill queue empty: how it departs from its profile "
            "in shape as well as in level",
            labels=["replica", "term"],
        )
        itl_terms = GaugeMetricFamily(
            "kvlb_replica_itl_term_scale",
            "Fitted multiplier on each term of the replica's decode iteration (iteration: its "
            "fixed cost and per sequence; context: the batch's context read), with the stalls "
            "of prefills run meanwhile taken out, which the time-per-token multiplier keeps",
            labels=["replica", "term"],
        )
        terms_used = GaugeMetricFamily(
            "kvlb_replica_terms_in_use",
            "1 where the replica's fitted terms predict its answers well (a typical miss under "
            "about 10 %), so its predictions use them, and its ranking does when every "
            "candidate's do; 0 where it uses its multiplier alone",
            labels=["replica", "prediction"],
        )
        adapters = [family(name, text, labels=["replica"]) for family, name, text in ADAPTER_REPLICA_METRICS]
        now = asyncio.get_running_loop().time()
        for replica in self.fleet.replicas:
            if replica.discovered_adapters or replica.settings.adapters:
                account = replica.adapter_slots
                values = (account.capacity, len(account.resident()), account.loads, account.loading_ms)
                for family, value in zip(adapters, values, strict=True):
                    family.add_metric([replica.name], value)
            scale.add_metric([replica.name], replica.ttft_scale)
            itl_scale.add_metric([replica.name], replica.itl_scale)
            for term, shape in zip(MODEL_TTFT_PARTS, replica.ttft_terms_fit.shape, strict=True):
                ttft_terms.add_metric([replica.name, term], shape)
            for term, shape in zip(MODEL_ITL_PARTS, replica.itl_terms_fit.shape, strict=True):
                itl_terms.add_metric([replica.name, term], shape)
            for prediction, fit in (("ttft", replica.ttft_terms_fit), ("itl", replica.itl_terms_fit)):
                terms_used.add_metric([replica.name, prediction], 1.0 if fit.earned else 0.0)
            in_flight.add_metric([replica.name], replica.in_flight)
            healthy.add_metric([replica.name], 1.0 if replica.healthy else 0.0)
            breaker.add_metric([replica.name], STATE_VALUES[replica.breaker.state(now)])
            ejections.add_metric([replica.name], replica.breaker.ejected_total)
            queued.add_metric([replica.name], replica.prefill_tokens_queued)
        yield in_flight
        yield healthy
        yield breaker
        yield ejections
        yield queued
        yield scale
        yield itl_scale
        yield ttft_terms
        yield itl_terms
        yield terms_used
        yield from adapters
