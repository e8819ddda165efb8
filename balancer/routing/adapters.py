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

What evicting an adapter costs is the load its next request pays, so it is priced by the
adapter's demand across the fleet (`AdapterDemand`: its share of the latest adapter
requests anywhere) and by how many replicas hold it besides: evicting one of three copies
of a busy adapter costs little, the only copy of one asked for every few seconds a load.
Sans I/O and clock; bounded by the slots and by `MAX_ADAPTERS`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator

# Per adapter request anywhere in the fleet: the weight of earlier ones in an adapter's
# demand. About the last 1 / (1 - FADE) requests count.
FADE = 0.99
# An adapter with this share of the fleet's adapter requests will almost surely be asked for
# again while a replica would still hold it: its eviction costs a whole load.
SURE_SHARE = 0.05
MAX_ADAPTERS = 65536


class AdapterDemand:
    """The fleet's recent requests per adapter, and the replicas kvlb believes hold each."""

    __slots__ = ("_count", "_seen", "_holders")

    def __init__(self) -> None:
        self._count = 0  # adapter requests so far: the clock the fading runs on
        # adapter -> (faded requests as of `_count` then, that count); least recent first.
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._holders: dict[str, int] = {}

    def requested(self, adapter: str) -> None:
        self._count += 1
        value, at = self._seen.pop(adapter, (0.0, self._count))
        self._seen[adapter] = (value * FADE ** (self._count - at) + 1.0, self._count)
        if len(self._seen) > MAX_ADAPTERS:
            self._seen.popitem(last=False)

    def share(self, adapter: str) -> float:
        """The adapter's share of the latest adapter requests, 0 to 1."""
        value, at = self._seen.get(adapter, (0.0, self._count))
        return value * FADE ** (self._count - at) * (1.0 - FADE)

    def holders(self, adapter: str) -> int:
        return self._holders.get(adapter, 0)

    def loaded(self, adapter: str) -> None:
        self._holders[adapter] = self._holders.get(adapter, 0) + 1

    def evicted(self, adapter: str) -> None:
        _decrement(self._holders, adapter)


class AdapterSlots:
    __slots__ = ("capacity", "load_ms", "demand", "_resident", "_running", "loads", "loading_ms",
                 "remote_loading_ms")

    def __init__(self, capacity: int, load_ms: float, demand: AdapterDemand | None = None) -> None:
        if capacity < 1:
            raise ValueError("an adapter replica holds at least one adapter")
        self.capacity = capacity
        self.load_ms = load_ms
        self.demand = demand if demand is not None else AdapterDemand()
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._running: dict[str, int] = {}
        self.loads = 0  # loads this model predicts the engine made, for the metrics
        # The loads of requests that have not answered yet, in ms, this instance's and (from
        # Redis sync) its peers': the engine stalls its iterations for each, so every request
        # there waits them out.
        self.loading_ms = 0.0
        self.remote_loading_ms = 0

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

    def eviction_cost(self, adapter: str) -> float:
        """What evicting `adapter` from here costs, in loads (0 to 1): the chance its next
        request finds no other copy, by its demand and its other holders."""
        demand = self.demand
        sure = min(1.0, demand.share(adapter) / SURE_SHARE)
        return sure / max(demand.holders(adapter), 1)

    def started(self, adapter: str) -> float:
        """A request on `adapter` was sent here. Returns the load it makes the engine do, in
        ms (0: the adapter was resident); the routing core counts it in `loading_ms` until
        that request answers."""
        load = 0.0
        if self._use(adapter):
            self.loads += 1
            load = self.load_ms
        self._running[adapter] = self._running.get(adapter, 0) + 1
        return load

    def load_began(self, load_ms: float) -> None:
        self.loading_ms += load_ms

    def load_over(self, load_ms: float) -> None:
        """The request whose start made a load of `load_ms` has its first token, or failed."""
        self.loading_ms = max(float(self.remote_loading_ms), self.loading_ms - load_ms)

    def set_remote_loading(self, loading_ms: int) -> None:
        """Other instances' loads under way here, replacing their previous snapshot."""
        self.loading_ms += loading_ms - self.remote_loading_ms
        self.remote_loading_ms = loading_ms

    def own_loading_ms(self) -> int:
        return max(0, round(self.loading_ms - self.remote_loading_ms))

    def resize(self, capacity: int) -> None:
        """The engine reported how many adapters it holds at once (`max_loras`); with fewer
        slots than before, the least recently used go first, as the engine would have them."""
        if capacity < 1:
            raise ValueError("an adapter replica holds at least one adapter")
        self.capacity = capacity
        resident = self._resident
        while len(resident) > capacity:
            victim = self.victim()
            assert victim is not None
            del resident[victim]
            self.demand.evicted(victim)

    def running_on_engine(self, adapters: Iterable[str]) -> None:
        """The engine reported these adapters running now: they are in its slots, its most
        recently used (engines touch every running adapter at each step), whoever sent
        their requests (another balancer, a client going straight to it)."""
        for adapter in adapters:
            self._resident_now(adapter)

    def touched(self, adapter: str) -> None:
        """Another kvlb instance sent a request on `adapter` here (balancer/watchers/sync.py):
        the engine has it in a slot now, its most recent. That instance counts the load and
        the request's run; here it only orders the slots and counts in the demand."""
        self._use(adapter)

    def _use(self, adapter: str) -> bool:
        """A request on `adapter`: counted in the demand, and the adapter resident now."""
        self.demand.requested(adapter)
        return self._resident_now(adapter)

    def _resident_now(self, adapter: str) -> bool:
        """`adapter` becomes the most recently used, loaded in the engine's victim's place if
        it was not resident: True then."""
        resident = self._resident
        demand = self.demand
        if adapter in resident:
            resident.move_to_end(adapter)
            return False
        victim = self.victim()
        if victim is not None:
            del resident[victim]
            demand.evicted(victim)
        resident[adapter] = None
        demand.loaded(adapter)
        return True

    def unloaded(self, adapter: str) -> None:
        """The engine unregistered `adapter`: out of its slots too."""
        if adapter in self._resident:
            del self._resident[adapter]
            self.demand.evicted(adapter)

    def ended(self, adapter: str) -> None:
        _decrement(self._running, adapter)

    def forget(self) -> None:
        """The replica restarted or was out long enough to have: it holds none now."""
        for adapter in self._resident:
            self.demand.evicted(adapter)
        self._resident.clear()


def unloadable(registered: Iterable[str], reloadable: Collection[str], spared: Collection[str],
               slots: AdapterSlots) -> Iterator[str]:
    """What a replica holding as many adapters as it may could unload to make room: those
    kvlb can load again (`reloadable`), not `spared` (loads under way), with no request of
    kvlb's running on them there."""
    running = slots.running
    for adapter in registered:
        if adapter in reloadable and adapter not in spared and not running(adapter):
            yield adapter


def unload_choice(candidates: Iterable[str], slots: AdapterSlots, holders: Callable[[str], int]) -> str | None:
    """Which of `candidates` (from `unloadable`) to unload: the one whose next request is
    least likely to find no other copy (its demand over the replicas serving it, this one
    included); among equals, the least recently used there, an adapter out of its GPU slots
    first. None when there is none."""
    recency = {adapter: rank for rank, adapter in enumerate(slots.resident())}
    share = slots.demand.share
    best: tuple[float, int, str] | None = None
    for adapter in candidates:
        cost = min(1.0, share(adapter) / SURE_SHARE) / max(holders(adapter), 1)
        key = (cost, recency.get(adapter, -1), adapter)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def _decrement(counts: dict[str, int], key: str) -> None:
    """One fewer of `key`; a count that reaches nothing leaves, so the dict stays bounded."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
