"""Which LoRA adapters a replica holds in its GPU slots, as far as kvlb can tell.

An engine serving adapters keeps a few of them resident (vLLM `--max-loras`, SGLang
`--max-loras-per-batch`) and loads any other on demand, evicting the least recently used
one that no running request needs; a load stalls that iteration for the adapter's load time,
and when every resident adapter is in use a request for another waits for one to go idle.
Engines list every adapter they can serve (vLLM's `/v1/models`, with a `parent`), not which
are resident, so kvlb keeps its own model of each replica's slots from the requests it
routes there, as it keeps a model of each replica's prefix cache: the adapters of its
latest requests, least recently used first, at most `capacity`, with the requests of each
still running. The model runs the engine's rule, so it evicts what the engine evicts.

`recent` is an adapter's share of the replica's latest requests (each request there fades
the older ones by `FADE`): what evicting it costs, since a busy adapter's next request there
pays a load of its own. Sans I/O and clock; bounded by `capacity`.
"""

from __future__ import annotations

from collections import OrderedDict

# Per request routed to the replica: the weight of earlier ones in `recent`. About the last
# 1 / (1 - FADE) requests count.
FADE = 0.95


class AdapterSlots:
    __slots__ = ("capacity", "load_ms", "_resident", "_running", "loads")

    def __init__(self, capacity: int, load_ms: float) -> None:
        if capacity < 1:
            raise ValueError("an adapter replica holds at least one adapter")
        self.capacity = capacity
        self.load_ms = load_ms
        # adapter -> its faded count of the replica's latest requests; least recent first.
        self._resident: OrderedDict[str, float] = OrderedDict()
        self._running: dict[str, int] = {}
        self.loads = 0  # loads this model predicts the engine made, for the metrics

    def holds(self, adapter: str) -> bool:
        return adapter in self._resident

    def resident(self) -> list[str]:
        """Least recently used first."""
        return list(self._resident)

    def running(self, adapter: str) -> int:
        return self._running.get(adapter, 0)

    def victim(self) -> str | None:
        """What loading another adapter would evict: None while a slot is free, else the
        least recently used adapter no request here is running on; with none idle, the least
        recently used (the new request then waits for it to go idle)."""
        if len(self._resident) < self.capacity:
            return None
        running = self._running
        for adapter in self._resident:
            if not running.get(adapter):
                return adapter
        return next(iter(self._resident))

    def all_busy(self) -> bool:
        """Every slot holds an adapter that a running request here uses."""
        return len(self._resident) >= self.capacity and all(self._running.get(a) for a in self._resident)

    def recent(self, adapter: str) -> float:
        """The adapter's faded share of the latest requests here (0 to 1)."""
        return self._resident.get(adapter, 0.0) * (1.0 - FADE)

    def started(self, adapter: str) -> None:
        """A request on `adapter` was sent here."""
        resident = self._resident
        for name in resident:
            resident[name] *= FADE
        if adapter in resident:
            resident.move_to_end(adapter)
        else:
            victim = self.victim()
            if victim is not None:
                del resident[victim]
            resident[adapter] = 0.0
            self.loads += 1
        resident[adapter] += 1.0
        self._running[adapter] = self._running.get(adapter, 0) + 1

    def ended(self, adapter: str) -> None:
        left = self._running.get(adapter, 0) - 1
        if left > 0:
            self._running[adapter] = left
        else:
            self._running.pop(adapter, None)

    def forget(self) -> None:
        """The replica restarted or was out long enough to have: it holds none now."""
        self._resident.clear()
