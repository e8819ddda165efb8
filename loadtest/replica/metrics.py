"""`/metrics` under the names vLLM and SGLang export, so scrapers built for them work here.

Values are read from the engine at scrape time instead of being pushed on every iteration,
which would cost CPU in the hot loop for numbers nobody may read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loadtest.replica.driver import RealtimeDriver
from loadtest.replica.engine import EngineSequence
from loadtest.replica.handoff import TransferCounters


class ReplicaCollector:
    def __init__(
        self, driver: RealtimeDriver, model: str, transfers: TransferCounters | None = None
    ) -> None:
        self._driver = driver
        self._labels = [model]
        self._transfers = transfers  # None: not part of a disaggregated pair

    def collect(self) -> Iterator[Metric]:
        engine = self._driver.engine
        counters = engine.counters
        labels = self._labels
        usage = engine.cache.usage
        hit_rate = (
            counters.prefix_hits_tokens / counters.prefix_queries_tokens
            if counters.prefix_queries_tokens
            else 0.0
        )

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", engine.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.", usage)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            counters.prefix_queries_tokens,
        )  # fmt: skip
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            counters.prefix_hits_tokens,
        )  # fmt: skip
        yield counter(
            "vllm:prompt_tokens",
            "Prompt tokens of admitted requests.",
            counters.prefix_queries_tokens,
        )
        yield counter("vllm:generation_tokens", "Generated tokens.", counters.generation_tokens)
        yield counter("vllm:num_preemptions", "Preempted sequences.", counters.preemptions)
        yield counter(
            "vllm:request_success", "Requests finished with all their tokens.",
            counters.requests_finished,
        )  # fmt: skip
        yield gauge("sglang:num_running_reqs", "Requests in the running batch.", engine.num_running)
        yield gauge(
            "sglang:num_queue_reqs", "Requests waiting to be scheduled.", engine.num_waiting
        )
        yield gauge("sglang:token_usage", "Fraction of KV token slots in use.", usage)
        yield gauge("sglang:cache_hit_rate", "Prefix cache hit rate over prompt tokens.", hit_rate)
        yield counter(
            "kvlb_replica_iterations", "Engine iterations run by this simulated replica.",
            counters.iterations,
        )  # fmt: skip
        yield gauge(
            "kvlb_replica_lag_max_seconds",
            "Largest real-time lateness of an iteration; large values mean the simulator lags.",
            self._driver.max_lag_s,
        )
        if engine.config.max_loras:
            yield self._lora_info()
        if self._transfers is not None:
            yield from self._kv_transfers(self._transfers)

    def _kv_transfers(self, transfers: TransferCounters) -> Iterator[Metric]:
        labels = self._labels
        sent = CounterMetricFamily(
            "kvlb_replica_kv_transfers_sent",
            "Prompts' KV fetched from this prefill replica by decode replicas.",
            labels=["model_name"],
        )
        sent.add_metric(labels, transfers.sent)
        yield sent
        received = CounterMetricFamily(
            "kvlb_replica_kv_transfers_received",
            "Prompts' KV fetched by this decode replica from prefill replicas.",
            labels=["model_name"],
        )
        received.add_metric(labels, transfers.received)
        yield received
        failures = CounterMetricFamily(
            "kvlb_replica_kv_transfer_failures",
            "KV transfers that failed, by reason (a decode side's unreachable, timeout, "
            "not_found, bad_answer; a prefill side's expired, dropped).",
            labels=["model_name", "reason"],
        )
        for reason, count in transfers.failures.items():
            failures.add_metric([*labels, reason], count)
        yield failures

    def _lora_info(self) -> GaugeMetricFamily:
        """vLLM's info gauge: the adapters of the running and the waiting requests in its
        labels, the scrape time as its value."""
        engine = self._driver.engine

        def names(seqs: list[EngineSequence]) -> str:
            return ",".join(dict.fromkeys(seq.adapter for seq in seqs if seq.adapter is not None))

        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric(
            [str(engine.config.max_loras), names(engine.waiting()), names(engine.running())],
            time.time(),
        )
        return family


def build_registry(
    driver: RealtimeDriver, model: str, transfers: TransferCounters | None = None
) -> CollectorRegistry:
    """A registry per server, so several replicas in one process (tests) do not collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(driver, model, transfers))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
