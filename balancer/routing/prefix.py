"""Prompt → chained block hashes: the keys of the prefix index.

A prompt is cut into blocks of `block_chars` characters (token ids from SGLang's /generate:
`block_tokens` ids). Only whole blocks count, because an engine caches whole blocks only.
Block i's hash is xxh3 of the block seeded with block i-1's hash, so it stands for the whole
prefix up to block i: equal prefixes give equal leading hashes, and changing block k changes
hashes k and after, never those before.

Hashing is the dearest part of routing (one Python-level call per block: ~2,000 for a
32k-token prompt), so `lazy()` hashes on demand. The index's walk reads only as deep as some
replica matches, and recording the chosen replica's blocks later finishes the job without
starting again.

The hashes are the same on every machine and Python version, since the inputs are UTF-8 text
or little-endian uint32 ids and xxh3 is stable. Balancers that share index state agree.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import overload

from xxhash import xxh3_64_intdigest

# Token-id chains start from their own seed, so ids whose packed bytes equal some text's
# bytes still get different hashes.
_TEXT_SEED = 0
_TOKEN_IDS_SEED = 0x6B766C62_746F6B73  # "kvlbtoks"


@lru_cache(maxsize=4096)
def adapter_seed(seed: int, adapter: str | None) -> int:
    """The first block's seed for a prompt under a LoRA adapter: engines key their prefix
    cache by adapter (vLLM hashes the adapter into every block), so the same prompt under two
    adapters shares no cached block, and neither does it with the base model."""
    return seed if adapter is None else xxh3_64_intdigest(adapter.encode(), seed)


class BlockHashes(Sequence[int]):
    """The chained block hashes of one prompt. Each one is computed the first time it is read,
    then kept.

    Indexing hashes everything up to the index read (at least 16 blocks and doubling, so a
    walk deep into a long prompt calls in only log n times). `computed` says how far that has
    gone (the benchmark and the tests use it). Iterating or calling `all()` hashes everything.
    """

    __slots__ = ("_source", "_unit", "_struct", "_struct8", "_count", "_seed", "_hashes")

    def __init__(self, source: str | memoryview, unit: int, seed: int) -> None:
        # source: the text (unit = characters per block) or packed ids (unit = bytes per block).
        self._source = source
        self._unit = unit
        self._struct, self._struct8 = _structs(unit)
        self._count = len(source) // unit
        self._seed = seed
        self._hashes: list[int] = []

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            stop = index.indices(self._count)[1]
            if stop > len(self._hashes):
                self._extend(stop)
            return self._hashes[index]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError("block index out of range")
        if index >= len(self._hashes):
            self._extend(index + 1)
        return self._hashes[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.all())

    @property
    def computed(self) -> int:
        """How many leading hashes have been computed so far."""
        return len(self._hashes)

    def all(self) -> list[int]:
        """Every whole block's hash. The list is this object's own: do not change it."""
        if len(self._hashes) < self._count:
            self._extend(self._count)
        return self._hashes

    def continued(self, more: str) -> BlockHashes:
        """The hashes of this text followed by `more`. Every whole block of this text is a
        whole block of the longer one too, with the same hash, so only the rest is hashed."""
        source = self._source
        if not isinstance(source, str):
            raise TypeError("only text continues as text")
        longer = BlockHashes(source + more, self._unit, self._seed)
        longer._hashes = list(self.all())
        return longer

    def _extend(self, upto: int) -> None:
        hashes = self._hashes
        # Doubling, at least 16: a dozen small calls would cost more than hashing a few extra
        # blocks.
        upto = min(self._count, max(upto, 2 * len(hashes), 16))
        h = hashes[-1] if hashes else self._seed
        unit = self._unit
        chunk = self._source[len(hashes) * unit:upto * unit]
        if isinstance(chunk, str):
            if not chunk.isascii():
                # Blocks are counted in characters, not UTF-8 bytes, so slice the text. The
                # UTF-8 of each slice is what the ASCII path below hashes too, so a block's
                # hash is the same whichever path computes it.
                for start in range(0, len(chunk), unit):
                    h = xxh3_64_intdigest(chunk[start:start + unit].encode("utf-8", "surrogatepass"), h)
                    hashes.append(h)
                return
            chunk = chunk.encode("ascii")
        # iter_unpack cuts whole blocks in C, where slicing in Python costs as much as a hash.
        # Eight blocks a turn saves a third of the loop's overhead.
        x3 = xxh3_64_intdigest
        extend = hashes.extend
        whole = len(chunk) // (8 * unit) * 8 * unit
        for b0, b1, b2, b3, b4, b5, b6, b7 in self._struct8.iter_unpack(chunk[:whole]):
            h0 = x3(b0, h)
            h1 = x3(b1, h0)
            h2 = x3(b2, h1)
            h3 = x3(b3, h2)
            h4 = x3(b4, h3)
            h5 = x3(b5, h4)
            h6 = x3(b6, h5)
            h = x3(b7, h6)
            extend((h0, h1, h2, h3, h4, h5, h6, h))
        for (block,) in self._struct.iter_unpack(chunk[whole:]):
            h = x3(block, h)
            hashes.append(h)


class PrefixHasher:
    """Turns prompts into chained block hashes and estimates their length in tokens."""

    def __init__(self, block_chars: int = 64, tokens_per_char: float = 0.25,
                 block_tokens: int = 16) -> None:
        if block_chars < 1 or block_tokens < 1:
            raise ValueError("block_chars and block_tokens must be at least 1")
        if not tokens_per_char > 0:
            raise ValueError("tokens_per_char must be positive")
        self.block_chars = block_chars
        self.tokens_per_char = tokens_per_char
        self.block_tokens = block_tokens

    @property
    def tokens_per_block(self) -> float:
        """Estimated tokens in one text block. One index serves text and token-id prompts
        alike, so keep this equal to `block_tokens` (the defaults are: 64 × 0.25 = 16)."""
        return self.block_chars * self.tokens_per_char

    def estimate_tokens(self, text: str, tokens_per_char: float | None = None) -> int:
        """`text`'s length in tokens at `tokens_per_char` (default: the configured ratio)."""
        per_char = self.tokens_per_char if tokens_per_char is None else tokens_per_char
        return int(len(text) * per_char + 0.5)

    def lazy(self, prompt: str | Sequence[int], adapter: str | None = None) -> BlockHashes:
        """The prompt's block hashes, computed as they are read. The index's `match` reads
        only as deep as some replica matches. `prompt` is canonical text or token ids;
        `adapter` the LoRA adapter it runs under, if any."""
        if isinstance(prompt, str):
            return BlockHashes(prompt, self.block_chars, adapter_seed(_TEXT_SEED, adapter))
        return BlockHashes(_pack_ids(prompt), 4 * self.block_tokens, adapter_seed(_TOKEN_IDS_SEED, adapter))

    def hashes(self, text: str) -> list[int]:
        """All whole-block chained hashes of `text`."""
        return self.lazy(text).all()

    def token_id_hashes(self, ids: Sequence[int]) -> list[int]:
        """All whole-block chained hashes of token ids, `block_tokens` ids a block."""
        return self.lazy(ids).all()


def token_block_hashes(ids: Sequence[int], block_tokens: int, parent: int | None = None,
                       adapter: str | None = None) -> list[int]:
    """Chained hashes of whole blocks of token ids that follow block `parent` (None: the
    first blocks of a prompt, under `adapter` if any): the keys `PrefixHasher.lazy(ids,
    adapter)` gives the same blocks."""
    seed = adapter_seed(_TOKEN_IDS_SEED, adapter) if parent is None else parent
    return BlockHashes(_pack_ids(ids), 4 * block_tokens, seed).all()


@lru_cache(maxsize=8)
def _structs(unit: int) -> tuple[struct.Struct, struct.Struct]:
    return struct.Struct(f"{unit}s"), struct.Struct(f"{unit}s" * 8)


def _pack_ids(ids: Sequence[int]) -> memoryview:
    try:
        packed = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
    except (OverflowError, TypeError) as error:
        raise ValueError(f"token ids must be integers in [0, 2**32): {error}") from None
    if sys.byteorder == "big":
        packed = array("I", packed)
        packed.byteswap()
    return memoryview(packed).cast("B")
