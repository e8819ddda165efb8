"""How long Python's cyclic garbage collector stopped this process, per generation.

Every collection stops the event loop: each request in flight waits for it. Young ones take
a millisecond; a full one (generation 2) walks every tracked object and frees all cyclic
garbage at once. Per-request state caught in a reference cycle once made those 60-300 ms
and doubled the TTFT p99 of a live run, which nothing else exported showed. Full
collections above ~30 ms, or counts that climb with traffic, mean such a cycle is back
(docs/performance.md, "Streams").

The collector's callbacks are the process's, so every balancer in a process reports every
collection in it: one kvlb process is one balancer.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from balancer.serving.metrics import Histogram

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = 3


class GcPauses(Collector):
    """`kvlb_gc_pause_seconds` and `kvlb_gc_collected_objects_total`, by generation, from
    the moment `start` hooks the collector until `stop`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started_at: float | None = None
        self._pauses = [Histogram(PAUSE_BUCKETS) for _ in range(GENERATIONS)]
        self._collected = [0] * GENERATIONS  # objects freed, per generation

    def start(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_at = self._clock()
            return
        started, self._started_at = self._started_at, None
        generation = info.get("generation", 0)
        if started is None or not 0 <= generation < GENERATIONS:
            return
        self._pauses[generation].observe(self._clock() - started)
        self._collected[generation] += info.get("collected", 0)

    def collect(self) -> Iterator[Metric]:
        pauses = HistogramMetricFamily(
            "kvlb_gc_pause_seconds",
            "Time Python's garbage collector stopped the process (and every request in flight), "
            "per collection, by generation (2: a full collection)",
            labels=["generation"],
        )
        collected = CounterMetricFamily(
            "kvlb_gc_collected_objects",
            "Objects the garbage collector freed, by generation: cyclic garbage, which a request "
            "should not leave",
            labels=["generation"],
        )
        for generation, histogram in enumerate(self._pauses):
            pauses.add_metric([str(generation)], histogram.family_buckets(), histogram.total)
            collected.add_metric([str(generation)], self._collected[generation])
        yield pauses
        yield collected
