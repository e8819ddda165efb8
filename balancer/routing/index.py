"""The prefix index: which replica holds which prompt blocks in its KV cache (as predicted).

Blocks are keyed by chained hash (see `balancer.routing.prefix`). Each block is a node, and the blocks
before it form the path to it. A node keeps a bitmask of the replicas that hold it. An
"entry" is one (replica, block) pair.

Prefix semantics: a replica is recorded as holding a block only together with every block
before it, and it loses a block only after every block under it is gone. The replicas along
any prompt's path therefore only shrink with depth. That lets `match` gallop, then bisect,
reading O(R log n) nodes instead of n, so it hashes only about as deep as the deepest match.

Each replica has an LRU (an OrderedDict from hash to last-use time). `record` refreshes a
path leaf first, so a parent is always more recent than its children, and popping the LRU
front removes leaves first. The replica's blocks stay a consistent prefix, as they leave the
engine. TTL expiry and the global `max_entries` budget pop the LRU fronts too, so every
removal costs O(1) however big the index is. Finding the globally oldest front costs O(R)
per run of equally old entries. A second, global LRU would avoid that but costs ~150 bytes
an entry.

Nodes are tuples of ints, not objects, so the garbage collector never has to walk them
(see `_Node`).

Time is injected: `clock` returns monotonic seconds, and nothing here reads the time
otherwise.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from heapq import heappop, heappush
from itertools import repeat
from math import inf

# A node is a tuple (mask, parent, children), replaced whole when it changes:
#   mask: one bit per replica holding the block (bit number: see `_ids`);
#   parent: the previous block's hash, None at block 0;
#   children: None, one child's hash, or a set of them (most blocks have one child, so a set
#   is paid for only where prompts diverge).
# Tuples of ints are untracked by the garbage collector, where a million slotted objects would
# make every full collection walk them all (pauses of ~100 ms at a million entries).
_Node = tuple[int, "int | None", "int | set[int] | None"]
_MASK, _PARENT, _CHILDREN = 0, 1, 2


class PrefixIndex:
    """Block hash → the replicas predicted to hold it, bounded in time, per replica and overall.

    `hashes` arguments are a prompt's chained block hashes from block 0: a list or a
    `balancer.routing.prefix.BlockHashes`.
    """

    def __init__(self, *, tokens_per_block: float, ttl_s: float = 600.0,
                 max_entries: int = 2_000_000, clock: Callable[[], float],
                 default_capacity_tokens: float | None = None) -> None:
        if not tokens_per_block > 0:
            raise ValueError("tokens_per_block must be positive")
        if not ttl_s > 0:
            raise ValueError("ttl_s must be positive")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.tokens_per_block = tokens_per_block
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._nodes: dict[int, _Node] = {}
        self._ids: dict[str, int] = {}  # replica name → bit number
        self._names: list[str] = []  # bit number → replica name ("" when free)
        # Per bit number: block hash → last use, least recent first, children before parents.
        self._lru: list[OrderedDict[int, float]] = []
        self._free_ids: list[int] = []  # heap: reusing the lowest keeps the masks short
        # Kept by name, so it outlives remove_replica (a restart empties a cache, not its size).
        self._capacity_tokens: dict[str, float] = {}
        # Tokens one block of a replica's is worth, where it differs from `tokens_per_block`:
        # text blocks are characters, and how many tokens those are is learned per model.
        self._block_tokens: dict[str, float] = {}
        # For replicas whose capacity nobody gave: no engine holds more than this, so neither
        # does the index, and its memory follows the fleet rather than the traffic.
        self.default_capacity_tokens = default_capacity_tokens
        self._entries = 0
        # True while every parent is more recent than its children in the LRUs (all `record`
        # calls); `extend` gives that up, and age-based removal then takes subtrees.
        self.ordered = True
        self._next_expiry = inf  # no entry expires before this, so most calls skip the check
        # Entries evicted, by cause, for /metrics: past their TTL, past a replica's KV capacity
        # (its LRU), past the global max_entries budget. Corrections, failed attempts and
        # forgotten replicas are not evictions (see `forget_older_than`, `truncate`,
        # `remove_replica`).
        self.evicted_ttl = 0
        self.evicted_capacity = 0
        self.evicted_budget = 0

    # -- stats -------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        """Replica × block entries, over all replicas."""
        return self._entries

    @property
    def nodes(self) -> int:
        return len(self._nodes)

    def entries_of(self, replica: str) -> int:
        rid = self._ids.get(replica)
        return 0 if rid is None else len(self._lru[rid])

    # -- queries -----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica holding the prompt's first block, how many leading blocks it holds
        (× the tokens a block is worth: cached tokens). With `BlockHashes`, only about as many blocks
        as the deepest match are hashed (at most max(16, 2 × depth + 2))."""
        self._expire(self._clock())
        count = len(hashes)
        if not count:
            return {}
        nodes = self._nodes
        first = nodes.get(hashes[0])
        if first is None:
            return {}
        # Gallop: depths 0, 1, 3, 7, … until no replica holds the block (or the prompt ends).
        mask = first[_MASK]
        probes = [0]
        masks = [mask]
        depth = 0
        while mask:
            if depth == count - 1:
                probes.append(count)
                masks.append(0)
                break
            depth = min(2 * depth + 1, count - 1)
            node = nodes.get(hashes[depth])
            mask = node[_MASK] & mask if node is not None else 0
            probes.append(depth)
            masks.append(mask)
        # Hashed as far as the last probe. Bisect between probes whose replica sets differ.
        path = hashes[:probes[-1] + 1]
        names = self._names
        result: dict[str, int] = {}
        stack = [(probes[k], masks[k], probes[k + 1], masks[k + 1])
                 for k in range(len(probes) - 1) if masks[k] != masks[k + 1]]
        while stack:
            lo, lo_mask, hi, hi_mask = stack.pop()
            if hi - lo == 1:
                gone = lo_mask & ~hi_mask  # they hold blocks 0..lo, that is `hi` blocks
                while gone:
                    low = gone & -gone
                    result[names[low.bit_length() - 1]] = hi
                    gone ^= low
                continue
            mid = (lo + hi) // 2
            node = nodes.get(path[mid])
            # Clamped between its neighbours, so replica sets shrink with depth even if the
            # index were ever inconsistent.
            mid_mask = ((node[_MASK] if node is not None else 0) & lo_mask) | hi_mask
            if mid_mask != lo_mask:
                stack.append((lo, lo_mask, mid, mid_mask))
            if mid_mask != hi_mask:
                stack.append((mid, mid_mask, hi, hi_mask))
        return result

    # -- updates -----------------------------------------------------------------------------

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        """`replica` now holds the whole prompt: add its missing blocks and refresh the rest.

        The index may exceed its bounds by one prompt's blocks while this runs, never after.
        """
        now = self._clock()
        self._expire(now)
        path = hashes if isinstance(hashes, list) else list(hashes)
        count = len(path)
        if not count:
            return
        rid = self._id_of(replica)
        bit = 1 << rid
        nodes = self._nodes
        # The replica holds a prefix of this path; bisect for its length.
        lo, hi = 0, count
        while lo < hi:
            mid = (lo + hi) // 2
            node = nodes.get(path[mid])
            if node is not None and node[_MASK] & bit:
                lo = mid + 1
            else:
                hi = mid
        held = lo
        # Then blocks other replicas hold; then, since a node exists only while someone holds
        # it and so do its ancestors, blocks nobody holds, to the end of the path.
        first_new = held
        while first_new < count:
            h = path[first_new]
            node = nodes.get(h)
            if node is None:
                break
            nodes[h] = (node[_MASK] | bit, node[_PARENT], node[_CHILDREN])
            first_new += 1
        if first_new < count:
            parent = path[first_new - 1] if first_new else None
            if parent is not None:
                self._link(parent, path[first_new])
            new = path[first_new:]
            nodes.update(zip(new, zip(repeat(bit, len(new)), [parent, *new[:-1]], [*new[1:], None],
                                      strict=True), strict=True))
        lru = self._lru[rid]
        before = len(lru)
        # New entries are appended leaf first. Then the held prefix moves behind them, deepest
        # first, so every parent ends more recent than its children.
        lru.update(zip(reversed(path), repeat(now)))
        deque(map(lru.move_to_end, reversed(path[:held])), maxlen=0)
        self._entries += len(lru) - before
        self._next_expiry = min(self._next_expiry, now + self.ttl_s)
        self._enforce_capacity(replica, rid)
        self._enforce_budget()

    def extend(self, replica: str, parent: int | None, hashes: Sequence[int]) -> bool:
        """`replica` now holds `hashes`, the blocks that follow block `parent` (None: from
        the root), as an engine's KV event reports them. False, and nothing recorded, when
        the replica is not listed as holding `parent`: without the path to it the blocks
        could never be matched.

        Unlike `record`, the ancestors are not refreshed: walking to the root for every
        block a long conversation decodes would cost O(depth) an event. The LRU then lists
        some parents before their children, so from the first call on, removal by age takes
        whole subtrees (`ordered` turns false). An index fed this way should be bounded by
        its owner's removals, as the engines' events bound it, not by capacity or TTL.
        """
        nodes = self._nodes
        now = self._clock()
        self._expire(now)
        if parent is not None:
            rid = self._ids.get(replica)
            node = nodes.get(parent)
            if rid is None or node is None or not node[_MASK] & 1 << rid:
                return False
        else:
            rid = self._id_of(replica)
        self.ordered = False
        bit = 1 << rid
        lru = self._lru[rid]
        before = len(lru)
        previous = parent
        for h in hashes:
            node = nodes.get(h)
            if node is None:
                nodes[h] = (bit, previous, None)
                if previous is not None:
                    self._link(previous, h)
            elif not node[_MASK] & bit:
                nodes[h] = (node[_MASK] | bit, node[_PARENT], node[_CHILDREN])
            lru[h] = now
            lru.move_to_end(h)
            previous = h
        self._entries += len(lru) - before
        self._next_expiry = min(self._next_expiry, now + self.ttl_s)
        self._enforce_budget()
        return True

    def discard(self, replica: str, h: int) -> int:
        """The replica no longer holds block `h` (its engine evicted it): it loses that
        block and, by prefix semantics, every block under it. Returns how many entries went."""
        rid = self._ids.get(replica)
        if rid is None:
            return 0
        return self._drop_subtree(rid, h)

    def truncate(self, replica: str, hashes: Sequence[int], keep_blocks: int) -> int:
        """The replica reported holding only `keep_blocks` blocks of this prompt (its
        usage.cached_tokens // tokens_per_block). It loses the rest, and every block under
        them: by prefix semantics it cannot hold those. Returns how many entries went."""
        rid = self._ids.get(replica)
        keep = max(keep_blocks, 0)
        if rid is None or keep >= len(hashes):
            return 0
        return self._drop_subtree(rid, hashes[keep])

    def _drop_subtree(self, rid: int, start: int) -> int:
        bit = 1 << rid
        nodes = self._nodes
        node = nodes.get(start)
        if node is None or not node[_MASK] & bit:
            return 0
        if node[_CHILDREN] is None:  # a leaf, as engines evict them: no walk
            del self._lru[rid][start]
            self._drop(bit, start)
            return 1
        subtree = [start]  # parents before children
        for h in subtree:  # grows while it is walked
            for child in _children(nodes[h][_CHILDREN]):
                if nodes[child][_MASK] & bit:
                    subtree.append(child)
        lru = self._lru[rid]
        for h in reversed(subtree):
            del lru[h]
            self._drop(bit, h)
        return len(subtree)

    def last_use(self, replica: str, h: int) -> float | None:
        """When the replica last used block `h`, or None if it is not listed as holding it."""
        rid = self._ids.get(replica)
        return None if rid is None else self._lru[rid].get(h)

    def forget_older_than(self, replica: str, t: float) -> int:
        """The replica turned out not to hold a block it last used at `t`. Engines evict least
        recently used first, so everything it last used no later than `t` is gone as well.
        Pops the LRU front (leaves first), so the replica keeps a consistent prefix. Returns
        how many entries went."""
        rid = self._ids.get(replica)
        if rid is None:
            return 0
        lru = self._lru[rid]
        bit = 1 << rid
        removed = 0
        while lru:
            h = next(iter(lru))
            if lru[h] > t:
                break
            before = len(lru)
            self._pop_front(rid, bit, h)
            removed += before - len(lru)
        return removed

    def remove_replica(self, replica: str) -> int:
        """Forget everything the replica holds (removed, restarted empty, or unhealthy too
        long). Its capacity setting stays. Returns how many entries went."""
        rid = self._ids.pop(replica, None)
        if rid is None:
            return 0
        bit = 1 << rid
        lru = self._lru[rid]
        removed = len(lru)
        for h in lru:  # front to back is leaves first
            self._drop(bit, h)
        lru.clear()
        self._names[rid] = ""
        heappush(self._free_ids, rid)
        return removed

    def set_capacity(self, replica: str, tokens: float | None) -> None:
        """Model the replica's KV cache as holding `tokens` (None: no limit). Past that, its
        least recently used blocks leave the index, leaves first, as they leave the engine."""
        if tokens is None:
            self._capacity_tokens.pop(replica, None)
            return
        if tokens < 0:
            raise ValueError("capacity must not be negative")
        self._capacity_tokens[replica] = tokens
        rid = self._ids.get(replica)
        if rid is not None:
            self._enforce_capacity(replica, rid)

    def block_tokens_of(self, replica: str) -> float:
        return self._block_tokens.get(replica, self.tokens_per_block)

    def set_block_tokens(self, replica: str, tokens: float) -> None:
        """Count each of the replica's blocks as `tokens` against its capacity."""
        if not tokens > 0:
            raise ValueError("tokens per block must be positive")
        self._block_tokens[replica] = tokens
        rid = self._ids.get(replica)
        if rid is not None:
            self._enforce_capacity(replica, rid)

    def check_invariants(self) -> None:
        """Assert the index is self-consistent. For tests: O(size)."""
        nodes = self._nodes
        holders: dict[int, int] = {}
        for rid, lru in enumerate(self._lru):
            assert not lru or self._names[rid], "a free replica number holds entries"
            position = {h: i for i, h in enumerate(lru)}
            times = list(lru.values())
            assert times == sorted(times), "LRU times out of order"
            for h, i in position.items():
                holders[h] = holders.get(h, 0) | 1 << rid
                parent = nodes[h][_PARENT]
                if parent is not None:
                    assert parent in position, "parent missing"
                    assert not self.ordered or position[parent] > i, "parent older than child"
        assert self._entries == sum(map(len, self._lru)), "entry count drifted"
        assert self._entries <= self.max_entries, "over the memory budget"
        assert holders == {h: node[_MASK] for h, node in nodes.items()}, "masks disagree"
        for h, (mask, parent, children) in nodes.items():
            assert mask, "empty node kept"
            if parent is not None:
                assert h in _children(nodes[parent][_CHILDREN]), "child not linked"
            for child in _children(children):
                assert nodes[child][_PARENT] == h, "child links a different parent"
        for name, cap in self._capacity_tokens.items():
            assert self.entries_of(name) * self.block_tokens_of(name) <= cap, "over capacity"

    # -- internals ---------------------------------------------------------------------------

    def _id_of(self, replica: str) -> int:
        rid = self._ids.get(replica)
        if rid is None:
            if self._free_ids:
                rid = heappop(self._free_ids)
                self._names[rid] = replica
            else:
                rid = len(self._names)
                self._names.append(replica)
                self._lru.append(OrderedDict())
            self._ids[replica] = rid
        return rid

    def _drop(self, bit: int, h: int) -> None:
        """Take one entry out of its node (the caller takes it out of the LRU)."""
        self._entries -= 1
        nodes = self._nodes
        mask, parent, children = nodes[h]
        mask &= ~bit
        if mask:
            nodes[h] = (mask, parent, children)
            return
        # Prefix semantics: nobody holds its children either, so they are already gone.
        del nodes[h]
        siblings = nodes.get(parent) if parent is not None else None
        if siblings is not None:
            others = siblings[_CHILDREN]
            if isinstance(others, set):
                others.discard(h)
                if len(others) == 1:
                    nodes[parent] = (siblings[_MASK], siblings[_PARENT], next(iter(others)))
            elif others == h:
                nodes[parent] = (siblings[_MASK], siblings[_PARENT], None)

    def _link(self, parent: int, h: int) -> None:
        mask, grandparent, children = self._nodes[parent]
        if children is None:
            self._nodes[parent] = (mask, grandparent, h)
        elif isinstance(children, set):
            children.add(h)
        elif children != h:
            self._nodes[parent] = (mask, grandparent, {children, h})

    def _pop_oldest(self, rid: int, count: int) -> None:
        lru = self._lru[rid]
        bit = 1 << rid
        if not self.ordered:
            left = len(lru) - count
            while len(lru) > left:
                self._drop_subtree(rid, next(iter(lru)))
            return
        for _ in range(count):
            h, _ = lru.popitem(last=False)
            self._drop(bit, h)

    def _enforce_capacity(self, replica: str, rid: int) -> None:
        cap = self._capacity_tokens.get(replica, self.default_capacity_tokens)
        if cap is not None:
            excess = len(self._lru[rid]) - int(cap // self.block_tokens_of(replica))
            if excess > 0:
                self._pop_oldest(rid, excess)
                self.evicted_capacity += excess

    def _enforce_budget(self) -> None:
        if self._entries <= self.max_entries:
            return
        before = self._entries
        while self._entries > self.max_entries:
            oldest_rid, oldest, runner_up = -1, inf, inf
            for rid, lru in enumerate(self._lru):
                if lru:
                    t = lru[next(iter(lru))]
                    if t < oldest:
                        oldest_rid, oldest, runner_up = rid, t, oldest
                    elif t < runner_up:
                        runner_up = t
            # Pop the oldest replica's run until it passes the runner-up. Entries recorded
            # together share a time, so the runs are long.
            lru = self._lru[oldest_rid]
            bit = 1 << oldest_rid
            while self._entries > self.max_entries and lru:
                h = next(iter(lru))
                if lru[h] > runner_up:
                    break
                self._pop_front(oldest_rid, bit, h)
        self.evicted_budget += before - self._entries

    def _pop_front(self, rid: int, bit: int, h: int) -> None:
        if self.ordered:
            del self._lru[rid][h]
            self._drop(bit, h)
        else:
            self._drop_subtree(rid, h)

    def _expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        before = self._entries
        cutoff = now - self.ttl_s
        next_expiry = inf
        for rid, lru in enumerate(self._lru):
            bit = 1 << rid
            while lru:
                h = next(iter(lru))
                t = lru[h]
                if t > cutoff:
                    next_expiry = min(next_expiry, t + self.ttl_s)
                    break
                self._pop_front(rid, bit, h)
        self._next_expiry = next_expiry
        self.evicted_ttl += before - self._entries


def _children(children: int | set[int] | None) -> tuple[int, ...] | set[int]:
    if children is None:
        return ()
    if isinstance(children, int):
        return (children,)
    return children
