"""Hand-made fleets for policy tests: replicas are plain data a test sets as it likes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from balancer.routing.adapters import AdapterSlots


@dataclass
class FakeReplica:
    """Implements policies.base.ReplicaView."""

    name: str
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    in_flight: int = 0
    prefill_tokens_queued: int = 0
    decoding: int = 0
    context_tokens: int = 0
    ttft_scale: float = 1.0
    itl_scale: float = 1.0
    # A fake's scales count as fitted and trusted: a test that sets one means a replica long measured.
    ttft_samples: int = 100
    itl_samples: int = 100
    # No fitted terms trusted unless a test sets them.
    ttft_terms: tuple[float, ...] | None = None
    itl_terms: tuple[float, ...] | None = None
    adapter_slots: AdapterSlots = field(default_factory=lambda: AdapterSlots(1, 100.0))


def holder_and_loader(holding_queued: int, loading_queued: int, adapter: str = "sql",
                      load_ms: float = 500.0) -> tuple[FakeReplica, FakeReplica]:
    """Two replicas with two adapter slots each, backlogs as given: `holding` has `adapter`
    loaded and idle, `loading` would have to load it."""
    holding = FakeReplica("holding", prefill_tokens_queued=holding_queued)
    loading = FakeReplica("loading", prefill_tokens_queued=loading_queued)
    for replica in (holding, loading):
        replica.adapter_slots = AdapterSlots(2, load_ms)
    holding.adapter_slots.started(adapter)
    holding.adapter_slots.ended(adapter)
    return holding, loading
