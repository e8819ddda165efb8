"""KV cache events over ZMQ, on the wire as vLLM and SGLang send them (`--kv-events-config`).

A `KvEventPublisher` is the prefix cache's listener: it turns each change into an event
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and `flush` sends the events gathered
since the last one as one message, `[topic, sequence number (8 bytes, big-endian), msgpack
of [timestamp, [event, ...], data_parallel_rank]]`, the sequence numbers counting messages
from 0. The replica flushes as each engine iteration ends and after a cache flush.

Events are maps with a "type" key (current vLLM and SGLang) or, with encoding "array", lists
whose first element is the tag (vLLM up to 0.23). Block hashes are the replica's own chained
64-bit hashes and token ids are `tokens.word_token_id` of the words, as `/tokenize` answers.
A block a LoRA adapter computed carries its `lora_id` (the adapter's number, see lora.py) and,
after `medium`, its `lora_name`, as newer vLLM sends them.

Sending never blocks the event loop: a message that would pass the socket's high-water mark
for some subscriber is dropped and counted, and still takes its sequence number, so the
subscriber sees the gap, as it would after any loss.

pyzmq and msgpack are imported only when a publisher is made, so a replica without them
runs as long as it publishes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from loadtest.replica.tokens import token_ids

Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = ("map", "array")
DEFAULT_TOPIC = "kv-events"
# vLLM's default high-water mark, in messages.
DEFAULT_HWM = 100_000
MEDIUM = "GPU"
DATA_PARALLEL_RANK = 0
MISSING_PACKAGES = "KV events need pyzmq and msgpack: pip install 'kvlb[events]'"


class KvEventsUnavailable(RuntimeError):
    """pyzmq or msgpack is missing; the message names the extra that brings them."""


def require_packages() -> tuple[Any, Any]:
    """(zmq, msgpack), or KvEventsUnavailable."""
    try:
        import msgpack
        import zmq
    except ImportError:
        raise KvEventsUnavailable(MISSING_PACKAGES) from None
    return zmq, msgpack


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (`tcp://*:5557`, `tcp://[::]:5557`) or a local transport
    means the engine binds; any other address means it connects and the subscriber binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str = DEFAULT_TOPIC,
        encoding: Encoding = "map",
        *,
        hwm: int = DEFAULT_HWM,
        lora_ids: Callable[[str], int | None] | None = None,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}")
        zmq, msgpack = require_packages()
        self.endpoint = endpoint
        self.topic = topic
        self.encoding = encoding
        # An adapter's name to its number for `lora_id` (the server's registry).
        self.lora_ids = lora_ids
        self._topic = topic.encode()
        self._packb = msgpack.Packer(use_bin_type=True).pack
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._events: list[Any] = []
        self.sequence = 0  # the next message's number
        self.sent = 0
        self.dropped = 0
        sock = zmq.Context.instance().socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, hwm)
            # A full subscriber makes the send fail (and the message count as dropped)
            # instead of vanishing unseen inside libzmq.
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            if publisher_binds(endpoint):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as error:
            sock.close(0)
            # An OSError, so the command line reports it like a taken HTTP port.
            raise OSError(f"KV events endpoint {endpoint}: {error}") from None
        self._socket: Any = sock

    # -- the prefix cache's listener -----------------------------------------------------

    def blocks_stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[str],
        adapter: str | None = None,
    ) -> None:
        ids = token_ids(tokens)
        block_size = len(ids) // len(hashes)
        lora_id = None
        if adapter is not None and self.lora_ids is not None:
            lora_id = self.lora_ids(adapter)
        # The base model's blocks leave `lora_name` out rather than send it null, so their
        # events stay those of the vLLM releases before the field, which subscribers that
        # count fields or compare whole events still expect.
        if self.encoding == "map":
            event: Any = {
                "type": "BlockStored",
                "block_hashes": list(hashes),
                "parent_block_hash": parent,
                "token_ids": ids,
                "block_size": block_size,
                "lora_id": lora_id,
                "medium": MEDIUM,
            }
            if adapter is not None:
                event["lora_name"] = adapter
        else:
            event = ["BlockStored", list(hashes), parent, ids, block_size, lora_id, MEDIUM]
            if adapter is not None:
                event.append(adapter)
        self._events.append(event)

    def block_removed(self, block_hash: int) -> None:
        if self.encoding == "map":
            self._events.append(
                {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": MEDIUM}
            )
        else:
            self._events.append(["BlockRemoved", [block_hash], MEDIUM])

    def all_cleared(self) -> None:
        if self.encoding == "map":
            self._events.append({"type": "AllBlocksCleared"})
        else:
            self._events.append(["AllBlocksCleared"])

    # -- sending -------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Events gathered and not yet sent."""
        return len(self._events)

    def flush(self) -> None:
        """Send the gathered events as one message; nothing when there are none."""
        events = self._events
        if not events:
            return
        self._events = []
        if self._socket is None:  # closed: nobody to tell
            return
        payload = self._packb([time.time(), events, DATA_PARALLEL_RANK])
        number = self.sequence
        self.sequence = number + 1
        try:
            self._socket.send_multipart(
                (self._topic, number.to_bytes(8, "big"), payload), flags=self._noblock
            )
        except self._again:
            self.dropped += 1
        else:
            self.sent += 1

    def close(self) -> None:
        """Release the socket at once; unsent messages are discarded."""
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "topic": self.topic,
            "encoding": self.encoding,
            "messages_sent": self.sent,
            "messages_dropped": self.dropped,
        }
