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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _CachedBlock:
    parent: int | None
    ref_count: int = 0
    children: int = 0


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if capacity_tokens < block_size:
            raise ValueError("capacity must hold at least one block")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: dict[int, _CachedBlock] = {}
        # Unreferenced cached blocks, least recently released first; values unused.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._private_blocks = 0
        self.evicted_blocks_total = 0

    # -- sizes ---------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests; what vLLM's KV usage and SGLang's token usage count."""
        return self._private_blocks + len(self._blocks) - len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all, not even evictable cache."""
        return self.capacity_blocks - self._private_blocks - len(self._blocks)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def ref_count(self, block_hash: int) -> int:
        block = self._blocks.get(block_hash)
        return block.ref_count if block else 0

    # -- lookups and references ----------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks of `hashes` cached, how many of those are unreferenced).

        The second number matters for admission: acquiring those blocks takes them out of
        the evictable pool, so they cannot also be counted as reusable space.
        """
        matched = unreferenced = 0
        blocks = self._blocks
        for block_hash in hashes:
            block = blocks.get(block_hash)
            if block is None:
                break
            matched += 1
            if block.ref_count == 0:
                unreferenced += 1
        return matched, unreferenced

    def can_allocate(self, blocks: int, also_acquiring_unreferenced: int = 0) -> bool:
        available = self.free_blocks + len(self._evictable) - also_acquiring_unreferenced
        return blocks <= available

    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (a matched prefix) for a running request."""
        for block_hash in hashes:
            block = self._blocks[block_hash]
            if block.ref_count == 0:
                del self._evictable[block_hash]
            block.ref_count += 1

    def allocate(self, blocks: int) -> bool:
        """Take `blocks` private blocks, evicting cache only if free space runs short."""
        if not self.can_allocate(blocks):
            return False
        shortfall = blocks - self.free_blocks
        for _ in range(shortfall):
            self._evict_one()
        self._private_blocks += blocks
        return True

    def commit(self, hashes: Sequence[int], parent: int | None) -> None:
        """Private blocks became full and computed: make them addressable by hash.

        `hashes` are consecutive blocks of one chain and `parent` is the hash of the block
        before the first (None at the root). A block another request already cached is
        shared and this copy freed, so a hot prefix costs its memory once.
        """
        self._private_blocks -= len(hashes)
        blocks = self._blocks
        evictable = self._evictable
        for block_hash in hashes:
            block = blocks.get(block_hash)
            if block is not None:
                if block.ref_count == 0:
                    del evictable[block_hash]
                block.ref_count += 1
            else:
                blocks[block_hash] = _CachedBlock(parent=parent, ref_count=1)
                if parent is not None:
                    parent_block = blocks.get(parent)
                    if parent_block is not None:
                        parent_block.children += 1
            parent = block_hash

    def release(self, hashes: Sequence[int], private_blocks: int) -> None:
        """A request left: drop its references and free its private blocks.

        `hashes` is the request's cached chain, root first. It is released leaf first so
        that, at equal recency, the leaf is evicted before its parent.
        """
        self._private_blocks -= private_blocks
        blocks = self._blocks
        evictable = self._evictable
        for block_hash in reversed(hashes):
            block = blocks[block_hash]
            block.ref_count -= 1
            if block.ref_count == 0:
                evictable[block_hash] = None

    # -- eviction ------------------------------------------------------------------------

    def _evict_one(self) -> None:
        # Leaves come first in the LRU order by construction (a chain is released leaf
        # first and a parent is always used when its child is), so the scan almost always
        # stops at the first entry; it only walks on past a parent whose child is still
        # cached.
        for block_hash in self._evictable:
            block = self._blocks[block_hash]
            if block.children == 0:
                break
        else:  # pragma: no cover - every finite forest has a leaf
            raise RuntimeError("no evictable leaf")
        del self._evictable[block_hash]
        del self._blocks[block_hash]
        self.evicted_blocks_total += 1
        if block.parent is not None:
            parent_block = self._blocks.get(block.parent)
            if parent_block is not None:
                parent_block.children -= 1

    def clear(self) -> None:
        """Drop every unreferenced cached block (a flush_cache)."""
        while self._evictable:
            self._evict_one()
