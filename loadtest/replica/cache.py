"""The prefix cache: KV blocks addressed by chained hashes, shared between requests.

Capacity is counted in blocks of `block_size` tokens. A block is in one of three states:

- private: allocated to one request and not (yet) addressable by hash; a prompt block not
  yet prefilled, or the partial last block of a sequence. Only a count is kept.
- cached and referenced: in the hash table, used by `ref_count` running requests; never
  evicted.
- cached and unreferenced: in the hash table and in the LRU order; its memory is reusable.
  It is evicted, least recently released first and only when it has no cached children,
  when an allocation finds no free block.

Like vLLM's allocator, a cached block whose hash is computed again by another request is
shared rather than duplicated, and a released chain enters the LRU order leaf first, so a
prefix's tail is evicted before its head. The cache never reads a clock: recency is the
order of release.

A cached block is three integers in three dicts keyed by its hash, not an object: a replica
caches tens of thousands of blocks and every prompt commits and releases a hundred or more,
and objects would keep the garbage collector busy (each collection of the oldest generation
walks them all, tens of milliseconds in the middle of the engine loop), where dicts of
integers stay out of its sight.

A `CacheListener` may watch the hashed blocks come and go (the KV events vLLM and SGLang
publish). Without one the cost is one test per commit and per eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class CacheListener(Protocol):
    """Told of every change to the set of hashed blocks, in order; replaying the calls
    rebuilds that set exactly."""

    def blocks_stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[str],
        adapter: str | None = None,
    ) -> None:
        """Consecutive blocks of one chain became cached; `parent` is the hash of the block
        before the first (None at the root) and `tokens` are exactly these blocks' tokens.
        `adapter` names the LoRA adapter that computed them; it is passed only when there is
        one, so a listener that never meets adapters may leave it out."""

    def block_removed(self, block_hash: int) -> None:
        """One cached block was evicted."""

    def all_cleared(self) -> None:
        """Every cached block was dropped at once."""


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if capacity_tokens < block_size:
            raise ValueError("capacity must hold at least one block")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        # Per cached block: running requests using it, its parent's hash (None at the root),
        # and how many of its children are cached.
        self._refs: dict[int, int] = {}
        self._parents: dict[int, int | None] = {}
        self._children: dict[int, int] = {}
        # Unreferenced cached blocks, least recently released first; values unused.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._private_blocks = 0
        self.evicted_blocks_total = 0
        self.listener: CacheListener | None = None

    # -- sizes ---------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests; what vLLM's KV usage and SGLang's token usage count."""
        return self._private_blocks + len(self._refs) - len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all, not even evictable cache."""
        return self.capacity_blocks - self._private_blocks - len(self._refs)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs

    def ref_count(self, block_hash: int) -> int:
        return self._refs.get(block_hash, 0)

    # -- lookups and references ----------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks of `hashes` cached, how many of those are unreferenced).

        The second number matters for admission: acquiring those blocks takes them out of
        the evictable pool, so they cannot also be counted as reusable space.
        """
        matched = unreferenced = 0
        refs = self._refs
        for block_hash in hashes:
            count = refs.get(block_hash)
            if count is None:
                break
            matched += 1
            if count == 0:
                unreferenced += 1
        return matched, unreferenced

    def can_allocate(self, blocks: int, also_acquiring_unreferenced: int = 0) -> bool:
        available = self.free_blocks + len(self._evictable) - also_acquiring_unreferenced
        return blocks <= available

    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (a matched prefix) for a running request."""
        refs = self._refs
        evictable = self._evictable
        for block_hash in hashes:
            count = refs[block_hash]
            if count == 0:
                del evictable[block_hash]
            refs[block_hash] = count + 1

    def allocate(self, blocks: int) -> bool:
        """Take `blocks` private blocks, evicting cache only if free space runs short."""
        if not self.can_allocate(blocks):
            return False
        shortfall = blocks - self.free_blocks
        for _ in range(shortfall):
            self._evict_one()
        self._private_blocks += blocks
        return True

    def commit(
        self,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[str] = (),
        first_block: int = 0,
        adapter: str | None = None,
    ) -> None:
        """Private blocks became full and computed: make them addressable by hash.

        `hashes` are consecutive blocks of one chain and `parent` is the hash of the block
        before the first (None at the root). A block another request already cached is
        shared and this copy freed, so a hot prefix costs its memory once. `tokens` (the
        whole sequence's), `first_block` (the index of `hashes[0]` in it, in blocks) and
        `adapter` (the LoRA adapter's name, None for the base model) only tell a listener
        which tokens the new blocks hold and for whom.
        """
        listener = self.listener
        if listener is not None:
            self._report_stored(listener, hashes, parent, tokens, first_block, adapter)
        self._private_blocks -= len(hashes)
        refs = self._refs
        parents = self._parents
        children = self._children
        evictable = self._evictable
        for block_hash in hashes:
            count = refs.get(block_hash)
            if count is not None:
                if count == 0:
                    del evictable[block_hash]
                refs[block_hash] = count + 1
            else:
                refs[block_hash] = 1
                parents[block_hash] = parent
                children[block_hash] = 0
                if parent in children:
                    children[parent] += 1
            parent = block_hash

    def _report_stored(
        self,
        listener: CacheListener,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[str],
        first_block: int,
        adapter: str | None,
    ) -> None:
        # Before the blocks go in: a run of blocks not yet cached is one stored event, and
        # a block already cached (shared, not stored) ends the run.
        refs = self._refs
        size = self.block_size
        start = None
        for i in range(len(hashes) + 1):
            new = i < len(hashes) and hashes[i] not in refs
            if new and start is None:
                start = i
            elif not new and start is not None:
                run_parent = hashes[start - 1] if start else parent
                begin = (first_block + start) * size
                run = hashes[start:i]
                run_tokens = tokens[begin : begin + (i - start) * size]
                if adapter is None:
                    listener.blocks_stored(run, run_parent, run_tokens)
                else:
                    listener.blocks_stored(run, run_parent, run_tokens, adapter=adapter)
                start = None

    def release(self, hashes: Sequence[int], private_blocks: int) -> None:
        """A request left: drop its references and free its private blocks.

        `hashes` is the request's cached chain, root first. It is released leaf first so
        that, at equal recency, the leaf is evicted before its parent.
        """
        self._private_blocks -= private_blocks
        refs = self._refs
        evictable = self._evictable
        for block_hash in reversed(hashes):
            count = refs[block_hash] - 1
            refs[block_hash] = count
            if count == 0:
                evictable[block_hash] = None

    # -- eviction ------------------------------------------------------------------------

    def _evict_one(self) -> None:
        # Leaves come first in the LRU order by construction (a chain is released leaf
        # first and a parent is always used when its child is), so the scan almost always
        # stops at the first entry; it only walks on past a parent whose child is still
        # cached.
        children = self._children
        for block_hash in self._evictable:
            if children[block_hash] == 0:
                break
        else:  # pragma: no cover - every finite forest has a leaf
            raise RuntimeError("no evictable leaf")
        del self._evictable[block_hash]
        del self._refs[block_hash]
        del children[block_hash]
        parent = self._parents.pop(block_hash)
        self.evicted_blocks_total += 1
        if parent in children:
            children[parent] -= 1
        listener = self.listener
        if listener is not None:
            listener.block_removed(block_hash)

    def clear(self) -> None:
        """Drop every unreferenced cached block (a flush_cache).

        When no running request holds a cached block, everything goes at once and a listener
        hears one `all_cleared`, as vLLM reports a prefix-cache reset; otherwise the blocks
        in use stay, and it hears each removal, so its picture stays exact.
        """
        if len(self._evictable) < len(self._refs):
            while self._evictable:
                self._evict_one()
            return
        self.evicted_blocks_total += len(self._refs)
        for table in (self._refs, self._parents, self._children, self._evictable):
            table.clear()
        if self.listener is not None:
            self.listener.all_cleared()
