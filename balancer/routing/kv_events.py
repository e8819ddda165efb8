"""Precise mode: keep the prefix index exact from the engines' own KV cache events.

vLLM and SGLang (`--kv-events-config`) publish on a ZMQ PUB socket, one multipart message per
batch: `[topic, sequence number (8 bytes, big-endian), msgpack [timestamp, [events],
data-parallel rank]]` (older SGLang leaves the rank out). Events are `BlockStored`,
`BlockRemoved` and `AllBlocksCleared`, encoded either as arrays tagged by their first element
(vLLM up to 0.23) or as maps with a "type" key (later vLLM, SGLang); block hashes are 64-bit
integers or 32 raw bytes.

The engines' hashes are opaque and differ between engines and versions, so the index is keyed
by kvlb's own chained hash of the blocks' token ids (`balancer.routing.prefix`, one engine block per
index block). A prompt tokenized as the engine tokenizes it then hashes to the same keys. The
engine's hash of each block is kept per replica only to map a later `BlockRemoved` or a
child's `parent_block_hash` to kvlb's key.

A gap in the sequence numbers means lost events: the replica's entries can no longer be
trusted, so they are dropped, and rebuilt as the engine stores blocks again.

A message is checked whole before any of it is applied. One that is not a well-formed batch
(a field of the wrong type, an unhashable block hash, token ids that are not ids) is counted
and dropped, and changes nothing; the subscription goes on. It does not move the sequence on
either, so if it was the engine's own batch, the next one shows the gap: its events are lost
like any lost message's, and the replica's entries are dropped rather than left listing
blocks a lost `BlockRemoved` evicted.
"""

from __future__ import annotations

import logging
import math
import reprlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from balancer.routing.index import PrefixIndex
from balancer.routing.prefix import token_block_hashes

log = logging.getLogger("kvlb.kv_events")

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
# The tier an engine computes from; offloaded copies (CPU, disk) are not prefix hits.
PRIMARY_MEDIA = (None, "GPU", "gpu")


class MalformedEvents(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: Any = None
    medium: Any = None
    # The adapter by name (newer vLLM, whose block hashes take the name): how kvlb keys the
    # blocks. An adapter given only by its engine-local `lora_id` cannot be matched to the
    # names requests use, and its blocks are ignored.
    lora_name: str | None = None
    # The token ids packed as the hashing reads them, when decoding already packed them to
    # check them: packing twice would cost more than half as much again as hashing.
    packed: array | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[Any]
    medium: Any = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _event(raw: Any) -> Event | None:
    """One event in either encoding, checked; None for kinds precise mode has no use for."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == STORED:
            return _stored(raw["block_hashes"], raw.get("parent_block_hash"), raw["token_ids"],
                           raw["block_size"], raw.get("lora_id"), raw.get("medium"), raw.get("lora_name"))
        if kind == REMOVED:
            return _removed(raw["block_hashes"], raw.get("medium"))
        if kind == CLEARED:
            return Cleared()
        return None
    if isinstance(raw, list | tuple) and raw:
        kind, fields = raw[0], raw[1:]
        if kind == STORED:
            if len(fields) < 4:
                raise MalformedEvents(f"BlockStored has {len(fields)} fields, at least 4 expected")
            hashes, parent, tokens, block_size = fields[:4]
            lora = fields[4] if len(fields) > 4 else None
            medium = fields[5] if len(fields) > 5 else None
            lora_name = fields[6] if len(fields) > 6 else None
            return _stored(hashes, parent, tokens, block_size, lora, medium, lora_name)
        if kind == REMOVED:
            if not fields:
                raise MalformedEvents("BlockRemoved has no block hashes")
            return _removed(fields[0], fields[1] if len(fields) > 1 else None)
        if kind == CLEARED:
            return Cleared()
        return None
    raise MalformedEvents(f"an event must be a map or a tagged array, got {type(raw).__name__}")


def _is_block_hash(value: Any) -> bool:
    # 64-bit integers or raw bytes (vLLM), lists of ints (SGLang): each must make a key.
    kind = type(value)
    if kind is int or kind is bytes or kind is str:
        return True
    return (kind is list or kind is tuple) and all(type(part) is int for part in value)


def _block_hashes(value: Any) -> list[Any]:
    if not isinstance(value, list | tuple) or not all(map(_is_block_hash, value)):
        raise MalformedEvents(f"block_hashes must be a list of block hashes, got {_shown(value)}")
    return list(value)


def _medium(value: Any) -> Any:
    if value is not None and type(value) is not str:
        raise MalformedEvents(f"medium must be a string or null, got {_shown(value)}")
    return value


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, lora: Any, medium: Any,
            lora_name: Any = None) -> Stored:
    hashes = _block_hashes(hashes)
    if parent is not None and not _is_block_hash(parent):
        raise MalformedEvents(f"parent_block_hash must be a block hash or null, got {_shown(parent)}")
    if type(block_size) is not int:
        raise MalformedEvents(f"block_size must be an integer, got {_shown(block_size)}")
    if lora is not None and type(lora) not in (int, str):
        raise MalformedEvents(f"lora_id must be an integer or null, got {_shown(lora)}")
    if lora_name is not None and (type(lora_name) is not str or not lora_name):
        raise MalformedEvents(f"lora_name must be a non-empty string or null, got {_shown(lora_name)}")
    # A list only: array() would also take bytes (as raw machine words) or a map's keys.
    if not isinstance(tokens, list):
        raise MalformedEvents(f"token_ids must be a list, got {_shown(tokens)}")
    try:
        packed = array("I", tokens)
    except (TypeError, OverflowError) as exc:
        raise MalformedEvents(f"token_ids must be integers in [0, 2**32): {exc}") from None
    return Stored(hashes, parent, tokens, block_size, lora, _medium(medium), lora_name, packed)


def _removed(hashes: Any, medium: Any) -> Removed:
    return Removed(_block_hashes(hashes), _medium(medium))


def _shown(value: Any) -> str:
    # Bounded: a publisher sending garbage may send a lot of it.
    return reprlib.repr(value)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """(timestamp, events, data-parallel rank or None) of one message's payload."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedEvents(f"not msgpack: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) not in (2, 3):
        raise MalformedEvents("a batch must be [timestamp, events] or [timestamp, events, rank]")
    timestamp, raw_events = batch[0], batch[1]
    # bool is an int to Python, never to an engine.
    if type(timestamp) not in (int, float) or not math.isfinite(timestamp):
        raise MalformedEvents(f"a batch's timestamp must be a number, got {_shown(timestamp)}")
    if not isinstance(raw_events, list | tuple):
        raise MalformedEvents("a batch's events must be a list")
    rank = batch[2] if len(batch) == 3 else None
    if rank is not None and type(rank) is not int:
        raise MalformedEvents(f"a batch's data-parallel rank must be an integer, got {_shown(rank)}")
    try:
        events = [e for e in map(_event, raw_events) if e is not None]
    except KeyError as exc:
        raise MalformedEvents(f"an event lacks {exc}") from None
    except (TypeError, ValueError) as exc:  # what the checks above did not foresee
        raise MalformedEvents(f"bad event: {exc!r}") from None
    return float(timestamp), events, rank


@dataclass(slots=True)
class EventStats:
    """Counters for /metrics (`kvlb_kv_events_*`)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    gaps: int = 0  # lost messages detected: the replica's entries were dropped
    unknown_parent: int = 0  # stored blocks whose parent kvlb never saw: not indexed
    ignored: int = 0  # other media, adapters named only by id, another block size
    malformed: int = 0
    last_lag_s: float = 0.0  # from the engine's timestamp to applying the batch
    connected: set[str] = field(default_factory=set)


class ReplicaBlocks:
    """One replica's engine hashes → kvlb's block hashes, and its place in the sequence."""

    __slots__ = ("kvlb_hash", "copies", "last_seq")

    def __init__(self) -> None:
        self.kvlb_hash: dict[Any, int] = {}
        # vLLM may hold several physical copies of one block (two requests computing the
        # same prefix at once) and reports BlockStored and BlockRemoved per copy: the block
        # stays cached until its last copy goes. Extra copies only; most blocks have none.
        # (This reads vLLM's default, incremental reporting. A request sent with
        # kv_cache_report_mode "full" makes vLLM announce reused blocks again, which would
        # count as copies and keep them listed after their eviction.)
        self.copies: dict[Any, int] = {}
        self.last_seq: int | None = None

    def clear(self) -> None:
        self.kvlb_hash.clear()
        self.copies.clear()


class KvEventIndex:
    """Applies decoded events to the exact index. Clock-free and I/O-free, so the offline
    simulator can feed it directly."""

    def __init__(self, index: PrefixIndex, block_size: int, max_blocks_per_replica: int = 1_000_000,
                 guesses: PrefixIndex | None = None) -> None:
        self.index = index
        # Routing's guesses for prompts already prefilled (precise mode's speculative index):
        # an eviction the engine reports overrules them too, or a prompt answered a moment
        # ago would keep claiming blocks the engine has just given up under memory pressure.
        self.guesses = guesses
        self.block_size = block_size
        self.max_blocks = max_blocks_per_replica
        self.stats = EventStats()
        self._replicas: dict[str, ReplicaBlocks] = {}

    def _blocks(self, replica: str) -> ReplicaBlocks:
        blocks = self._replicas.get(replica)
        if blocks is None:
            blocks = self._replicas[replica] = ReplicaBlocks()
        return blocks

    def sequence(self, replica: str, seq: int) -> None:
        """Check a message's sequence number before its events are applied."""
        blocks = self._blocks(replica)
        last = blocks.last_seq
        blocks.last_seq = seq
        if last is not None and seq != last + 1:
            # Lost messages (or a restarted engine counting from 0 again): what the index
            # lists for this replica may be stale in ways no later event will correct.
            self.stats.gaps += 1
            log.warning("replica %s: KV event sequence jumped from %d to %d; its index entries are dropped",
                        replica, last, seq)
            self.reset(replica)

    def receive(self, replica: str, seq: int, payload: bytes, now: float) -> None:
        """One message from the replica's publisher: its sequence number and payload. Raises
        MalformedEvents, having changed nothing, when the payload is not a batch."""
        timestamp, batch, _rank = decode_batch(payload)
        self.sequence(replica, seq)
        self.apply(replica, batch)
        self.stats.batches += 1
        self.stats.last_lag_s = max(now - timestamp, 0.0)

    def last_sequence(self, replica: str) -> int | None:
        """The number of the replica's last message applied; None before the first."""
        blocks = self._replicas.get(replica)
        return None if blocks is None else blocks.last_seq

    def restart_sequence(self, replica: str) -> None:
        """The next message starts a new sequence (a new connection)."""
        self._blocks(replica).last_seq = None

    def reset(self, replica: str) -> None:
        self.index.remove_replica(replica)
        if self.guesses is not None:
            self.guesses.remove_replica(replica)
        self._blocks(replica).clear()

    def forget(self, replica: str) -> None:
        """The replica left the fleet."""
        self.index.remove_replica(replica)
        self._replicas.pop(replica, None)

    def apply(self, replica: str, events: Iterable[Event]) -> None:
        blocks = self._blocks(replica)
        stats = self.stats
        for event in events:
            if isinstance(event, Stored):
                self._stored(replica, blocks, event)
            elif isinstance(event, Removed):
                if event.medium not in PRIMARY_MEDIA:
                    stats.ignored += len(event.block_hashes)
                    continue
                for engine_hash in event.block_hashes:
                    key = _key(engine_hash)
                    extra = blocks.copies.get(key)
                    if extra:
                        if extra == 1:
                            del blocks.copies[key]
                        else:
                            blocks.copies[key] = extra - 1
                        continue
                    h = blocks.kvlb_hash.pop(key, None)
                    if h is not None:
                        self.index.discard(replica, h)
                        if self.guesses is not None:
                            self.guesses.discard(replica, h)
                        stats.removed_blocks += 1
            else:
                self.reset(replica)
                stats.cleared += 1

    def _stored(self, replica: str, blocks: ReplicaBlocks, event: Stored) -> None:
        stats = self.stats
        count = len(event.block_hashes)
        if (event.medium not in PRIMARY_MEDIA or (event.lora_id is not None and event.lora_name is None)
                or event.block_size != self.block_size or len(event.token_ids) != count * event.block_size):
            stats.ignored += count
            return
        mapping = blocks.kvlb_hash
        if event.parent_block_hash is None:
            parent = None
        else:
            parent = mapping.get(_key(event.parent_block_hash))
            if parent is None:
                stats.unknown_parent += count
                return
        tokens = event.token_ids if event.packed is None else event.packed
        hashes = token_block_hashes(tokens, self.block_size, parent, event.lora_name)
        if not self.index.extend(replica, parent, hashes):
            stats.unknown_parent += count
            return
        copies = blocks.copies
        for engine_hash, h in zip(event.block_hashes, hashes, strict=True):
            key = _key(engine_hash)
            if mapping.get(key) == h:
                copies[key] = copies.get(key, 0) + 1
            else:
                mapping[key] = h
        stats.stored_blocks += count
        if len(mapping) > self.max_blocks:
            # An engine that never reports removals would grow this without end.
            log.warning("replica %s: over %d KV blocks tracked; its index entries are dropped",
                        replica, self.max_blocks)
            self.reset(replica)


def _key(engine_hash: Any) -> Any:
    # msgpack gives 32-byte hashes as bytes and SGLang may send lists of ints; keys must hash.
    return tuple(engine_hash) if isinstance(engine_hash, list) else engine_hash
