"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018).

A session keeps landing on the same replica, so that replica's KV cache keeps its prefix,
until that replica holds more than `load_factor` times its fair share of the in-flight
requests; then the session spills to the next replica clockwise on the ring, and only there.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from xxhash import xxh64_intdigest

from policies.base import Choice, Policy, ReplicaView, RequestFeatures

# Names on the ring that no call has offered for this many calls lose their virtual nodes.
# Until then an absent replica stays on the ring and the walk merely skips it, which gives
# exactly the order a ring of the present replicas alone would give: so a replica that is
# left out for a moment (at its concurrency cap, briefly unhealthy) costs no rebuild.
_SWEEP_EVERY = 4096
_MAX_VIRTUAL_NODES = 10_000


class ConsistentHashPolicy(Policy):
    """Walk the ring clockwise from hash(session_key); replicas with room come first.

    A replica has room when its in_flight + 1 is at most its capacity, the ceiling of
    load_factor * (total in_flight + 1) * weight / total weight (for equal weights, Mirrokni's
    ceil(c * m / n), counting the request being routed). Replicas over capacity follow, still
    in ring order. Requests without a session key start the walk at a random point.
    """

    name = "consistent_hash"

    def __init__(
        self,
        *,
        load_factor: float = 1.25,
        virtual_nodes: int = 100,
        seed: int | None = None,
        **params: Any,
    ) -> None:
        super().__init__(seed=seed, **params)
        if isinstance(load_factor, bool) or not isinstance(load_factor, int | float):
            raise ValueError(f"load_factor must be a number, got {load_factor!r}")
        if not (math.isfinite(load_factor) and load_factor > 1.0):
            raise ValueError(f"load_factor must be a finite number > 1.0, got {load_factor!r}")
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int):
            raise ValueError(f"virtual_nodes must be an integer, got {virtual_nodes!r}")
        if not 1 <= virtual_nodes <= _MAX_VIRTUAL_NODES:
            raise ValueError(
                f"virtual_nodes must be between 1 and {_MAX_VIRTUAL_NODES}, got {virtual_nodes}"
            )
        self.load_factor = float(load_factor)
        self.virtual_nodes = virtual_nodes
        # The ring: every replica name seen recently, with the weight its nodes were built for.
        self._weights: dict[str, float] = {}
        self._ring: list[tuple[int, str]] = []
        self._points: list[int] = []
        # Owners twice over, so a walk from any start is one forward range with no modulo.
        self._owners: list[str] = []
        self._seen: set[str] = set()
        self._calls = 0

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        weights = self._weights
        present: dict[str, ReplicaView] = {}
        changed = False
        total_in_flight = 0
        total_weight = 0.0
        for r in replicas:
            present[r.name] = r
            total_in_flight += r.in_flight
            total_weight += r.weight
            if weights.get(r.name) != r.weight:
                changed = True
        if changed:
            self._add(replicas)
        self._seen.update(present)
        self._calls += 1
        if self._calls >= _SWEEP_EVERY:
            self._sweep()

        key = request.session_key
        point = xxh64_intdigest(key) if key is not None else self.rng.getrandbits(64)
        start = bisect_left(self._points, point)
        owners = self._owners
        pending = dict(present)
        order: list[ReplicaView] = []
        # The last replica needs no search: it is whichever is still pending.
        if len(pending) > 1:
            for k in range(start, start + len(self._points)):
                r = pending.pop(owners[k], None)
                if r is not None:
                    order.append(r)
                    if len(pending) == 1:
                        break
        order.extend(pending.values())
        if len(present) != len(replicas):
            # Two entries share a name, so the ring cannot tell them apart; the contract is
            # still every entry once, so the unplaced ones go last.
            placed = set(map(id, order))
            order.extend(r for r in replicas if id(r) not in placed)

        per_weight = self.load_factor * (total_in_flight + 1) / total_weight
        with_room: list[Choice] = []
        over: list[Choice] = []
        for position, r in enumerate(order):
            # The tolerance keeps a product meant to be a whole number from rounding up past it.
            capacity = math.ceil(per_weight * r.weight - 1e-9)
            terms = {
                "in_flight": float(r.in_flight),
                "capacity": float(capacity),
                "ring_order": float(position),
            }
            (with_room if r.in_flight + 1 <= capacity else over).append(Choice(r, terms))
        with_room.extend(over)
        return with_room

    def _add(self, replicas: Sequence[ReplicaView]) -> None:
        """Put new replicas (or new weights) on the ring; the others' nodes stay where they are."""
        changed = {r.name: r.weight for r in replicas if self._weights.get(r.name) != r.weight}
        ring = self._ring
        if any(name in self._weights for name in changed):
            ring = [node for node in ring if node[1] not in changed]
        for name, weight in changed.items():
            count = max(1, round(self.virtual_nodes * weight))
            ring.extend((xxh64_intdigest(f"{name}#{i}"), name) for i in range(count))
        ring.sort()
        self._weights.update(changed)
        self._set_ring(ring)

    def _sweep(self) -> None:
        absent = self._weights.keys() - self._seen
        if absent:
            for name in absent:
                del self._weights[name]
            self._set_ring([node for node in self._ring if node[1] not in absent])
        self._seen = set()
        self._calls = 0

    def _set_ring(self, ring: list[tuple[int, str]]) -> None:
        self._ring = ring
        self._points = [point for point, _ in ring]
        owners = [name for _, name in ring]
        self._owners = owners + owners
