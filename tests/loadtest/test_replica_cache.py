"""The prefix cache: chained hashes, reference counts, LRU eviction of unreferenced leaves."""

import pytest

from loadtest.replica.cache import PrefixCache
from loadtest.replica.tokens import block_hashes


def words(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def cache_chain(cache: PrefixCache, hashes: list[int]) -> None:
    """Store `hashes` as one request would, then release them (cached, unreferenced)."""
    assert cache.allocate(len(hashes))
    cache.commit(hashes, None)
    cache.release(hashes, 0)


def test_block_hash_covers_everything_before_it():
    shared = words("s", 32)
    a = block_hashes(shared + words("a", 32), 16)
    b = block_hashes(shared + words("b", 32), 16)
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]
    # Same block content after a different prefix hashes differently: the chain matters.
    c = block_hashes(words("x", 16) + shared[16:32], 16)
    assert c[1] != a[1]


def test_partial_block_has_no_hash():
    assert len(block_hashes(words("w", 47), 16)) == 2
    assert block_hashes(words("w", 15), 16) == []


def test_match_counts_leading_cached_blocks():
    cache = PrefixCache(capacity_tokens=16 * 10, block_size=16)
    hashes = block_hashes(words("w", 64), 16)
    cache_chain(cache, hashes[:3])
    assert cache.match(hashes) == (3, 3)
    other = block_hashes(words("v", 64), 16)
    assert cache.match(other) == (0, 0)


def test_references_protect_blocks_and_release_makes_them_evictable():
    cache = PrefixCache(capacity_tokens=16 * 4, block_size=16)
    hashes = block_hashes(words("w", 64), 16)
    assert cache.allocate(4)
    cache.commit(hashes[:1], None)
    cache.commit(hashes[1:], hashes[0])  # committed as prefill progresses, chunk by chunk
    assert cache.used_blocks == 4 and cache.free_blocks == 0
    # Everything is referenced: nothing can be allocated, nothing is evicted.
    assert not cache.allocate(1)
    assert cache.evicted_blocks_total == 0
    cache.release(hashes, 0)
    assert cache.used_blocks == 0 and cache.evictable_blocks == 4
    assert cache.allocate(1)
    assert cache.evicted_blocks_total == 1


def test_no_eviction_while_free_space_remains():
    cache = PrefixCache(capacity_tokens=16 * 8, block_size=16)
    cache_chain(cache, block_hashes(words("a", 64), 16))
    assert cache.allocate(4)  # exactly the free space
    assert cache.evicted_blocks_total == 0
    assert cache.allocate(1)
    assert cache.evicted_blocks_total == 1


def test_eviction_takes_least_recently_released_leaf_first():
    cache = PrefixCache(capacity_tokens=16 * 6, block_size=16)
    old = block_hashes(words("old", 48), 16)
    new = block_hashes(words("new", 48), 16)
    cache_chain(cache, old)
    cache_chain(cache, new)
    assert cache.allocate(1)
    # The old chain loses its leaf, not its root: its first two blocks still match.
    assert cache.match(old) == (2, 2)
    assert cache.match(new) == (3, 3)
    assert cache.allocate(2)
    assert cache.match(old) == (0, 0)
    assert cache.match(new) == (3, 3)


def test_reused_prefix_becomes_recent_again():
    cache = PrefixCache(capacity_tokens=16 * 4, block_size=16)
    first = block_hashes(words("p", 32), 16)
    second = block_hashes(words("q", 32), 16)
    cache_chain(cache, first)
    cache_chain(cache, second)
    cache.acquire(first)  # a new request hits the older prefix
    cache.release(first, 0)
    assert cache.allocate(2)
    assert cache.match(first) == (2, 2)
    assert cache.match(second) == (0, 0)


def test_eviction_never_touches_referenced_blocks():
    cache = PrefixCache(capacity_tokens=16 * 4, block_size=16)
    held = block_hashes(words("held", 32), 16)
    cache_chain(cache, held)
    cache.acquire(held)  # a running request uses them
    cache_chain(cache, block_hashes(words("idle", 32), 16))
    assert cache.allocate(2)
    assert not cache.allocate(1)
    assert all(block in cache for block in held)
    assert [cache.ref_count(block) for block in held] == [1, 1]


def test_commit_of_an_existing_block_shares_it():
    cache = PrefixCache(capacity_tokens=16 * 4, block_size=16)
    hashes = block_hashes(words("w", 32), 16)
    cache_chain(cache, hashes)
    # A second request computed the same blocks privately (it started before they were
    # cached); committing them shares the cached copies and frees its own.
    assert cache.allocate(2)
    assert cache.free_blocks == 0
    cache.commit(hashes, None)
    assert cache.free_blocks == 2
    assert cache.ref_count(hashes[0]) == 1 and cache.cached_blocks == 2


def test_capacity_must_hold_a_block():
    with pytest.raises(ValueError):
        PrefixCache(capacity_tokens=8, block_size=16)
