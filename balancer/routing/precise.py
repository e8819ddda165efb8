"""Precise mode's routing state: what the engines report they cache, plus what was just routed.

Three indexes, all keyed by kvlb's hashes of engine-sized blocks of token ids:
- `exact`, fed only by the engines' KV events (`balancer.routing.kv_events`): a block is listed while
  the engine holds it, whatever its age, and leaves when the engine says it evicted it;
- `pending`: prompts sent to a replica whose first byte has not come back. The engine stores
  their blocks as it prefills them, however long they queue and whatever it evicts meanwhile,
  so follow-up requests (the next turn of a chat, a burst sharing a document) go to the same
  replica instead of scattering. A prompt leaves when its answer starts or its attempt fails;
- `index`, the speculative one: a prompt whose answer has started is listed for
  `speculative_ttl_s` more, since its KV events may still be on their way. An eviction the
  engine reports overrules it at once. Other kvlb instances' routing decisions
  (balancer/watchers/sync.py) land here too.

A request's predicted hit is the longest of the three, capped below the whole prompt: engines
always compute at least the prompt's last token, so a prompt of exactly N cached blocks is
answered with N - 1 of them from cache (vLLM: `num_tokens - 1` is the longest hit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from balancer.config import KvEventsSettings, RoutingSettings
from balancer.routing.fleet import Replica
from balancer.routing.index import PrefixIndex
from balancer.routing.kv_events import KvEventIndex
from balancer.routing.prefix import PrefixHasher
from balancer.routing.tokenizer import (
    ModelTokenizer,
    TokenizerError,
    given_ids,
    tokenize_request_body,
)
from balancer.routing.tracker import CacheTracker, Lesson, Routed

# Events, not age, remove exact and pending entries; the TTL only has to outlast them.
NO_EXPIRY_S = 10 * 365 * 86400.0


class RemotePrompt(bytes):
    """A prompt kvlb cannot tokenize itself: the body of the engine `/tokenize` call that will."""


class PreciseTracker(CacheTracker):
    def __init__(self, routing: RoutingSettings, settings: KvEventsSettings, clock: Callable[[], float]) -> None:
        self.block_size = settings.block_size
        self.answer_chars = 0  # the engine's KV events report the blocks it decoded
        self._count_demand(clock)

        def index(ttl_s: float) -> PrefixIndex:
            return PrefixIndex(tokens_per_block=settings.block_size, ttl_s=ttl_s,
                               max_entries=routing.index_max_entries, clock=clock)

        self.hasher = PrefixHasher(block_tokens=settings.block_size)
        self.index = index(settings.speculative_ttl_s)
        self.exact = index(NO_EXPIRY_S)
        self.pending = index(NO_EXPIRY_S)
        # Per replica, how many pending prompts hold each block: prompts share prefixes, and
        # a block leaves `pending` with the last prompt that holds it.
        self._pending: dict[str, dict[int, int]] = {}
        self.events = KvEventIndex(self.exact, settings.block_size, settings.max_blocks_per_replica, self.index)

    def predict(self, prompt: str | Sequence[int], model: str | None = None, adapter: str | None = None) -> Routed:
        if isinstance(prompt, str):
            raise TypeError("precise mode routes on token ids")
        hashes = self.hasher.lazy(prompt, adapter)
        tokens = len(prompt)
        longest = (tokens - 1) // self.block_size if tokens else 0
        found: dict[str, int] = self.exact.match(hashes)
        for guesses in (self.index.match(hashes), self.pending.match(hashes) if self._pending else {}):
            for name, blocks in guesses.items():
                if blocks > found.get(name, 0):
                    found[name] = blocks
        cached = {}
        for name, blocks in found.items():
            blocks = min(blocks, longest)
            if blocks:
                cached[name] = blocks * self.block_size
        return self._with_demand(Routed(hashes, tokens, cached, self.block_size, model, adapter=adapter))

    def _record_routed(self, routed: Routed, replica: Replica) -> None:
        self.pending.record(replica.name, routed.hashes)
        holders = self._pending.setdefault(replica.name, {})
        for h in routed.hashes:
            holders[h] = holders.get(h, 0) + 1

    def _leave_pending(self, routed: Routed, replica: Replica) -> None:
        holders = self._pending.get(replica.name)
        if holders is None:
            return
        first_unheld = None
        for h in routed.hashes:
            count = holders.get(h, 0) - 1
            if count > 0:
                holders[h] = count
                continue
            holders.pop(h, None)
            if first_unheld is None:
                first_unheld = h
        # Blocks below an unheld one belong only to prompts through it: none are left.
        if first_unheld is not None:
            self.pending.discard(replica.name, first_unheld)
        if not holders:
            del self._pending[replica.name]

    def transferred(self, routed: Routed, replica: Replica) -> None:
        pass  # the decode replica's own KV events say what it stored

    def first_byte(self, routed: Routed, replica: Replica) -> None:
        self._leave_pending(routed, replica)
        self.index.record(replica.name, routed.hashes)

    def finish(self, routed: Routed, replica: Replica, *, answered: bool, prefilled: bool) -> None:
        if not prefilled:
            self._leave_pending(routed, replica)
            if answered:  # a non-streamed answer: its first byte is its last
                self.index.record(replica.name, routed.hashes)

    def learn(self, routed: Routed, replica: Replica, prompt_tokens: int, cached_tokens: int | None) -> Lesson | None:
        # Nothing to correct: the engine's events keep the exact index right. The lesson is
        # still reported, since prediction against outcome is what precise mode promises.
        if routed.learned or prompt_tokens <= 0 or cached_tokens is None:
            return None
        routed.learned = True
        return Lesson(routed.cached.get(replica.name, 0), cached_tokens, False)

    def forget(self, replica: str) -> None:
        # Only the guesses: an engine that stopped answering may keep its cache, and if it
        # restarted, its events say so (the sequence starts again).
        self.index.remove_replica(replica)


class PromptTokens:
    """Which tokenizer serves which model, and the prompt of a request as token ids."""

    def __init__(self, settings: KvEventsSettings) -> None:
        self._default: ModelTokenizer | None = None
        self._by_model: dict[str, ModelTokenizer] = {}
        loaded: dict[str, ModelTokenizer] = {}

        def load(directory: str) -> ModelTokenizer:
            if directory not in loaded:
                loaded[directory] = ModelTokenizer(directory)
            return loaded[directory]

        if settings.tokenizer is not None:
            self._default = load(settings.tokenizer)
        for model, directory in settings.tokenizers.items():
            self._by_model[model] = load(directory)

    def prompt_of(self, route: str, data: Mapping[str, Any]) -> list[int] | RemotePrompt | None:
        model = data.get("model")
        tokenizer = self._by_model.get(model, self._default) if isinstance(model, str) else self._default
        if tokenizer is not None:
            return tokenizer.prompt_ids(route, data)
        ids = given_ids(route, data)
        if ids is not None:
            return ids
        body = tokenize_request_body(route, data)
        return None if body is None else RemotePrompt(body)


def load_prompt_tokens(settings: KvEventsSettings) -> PromptTokens:
    """Raises TokenizerError with the directory at fault."""
    try:
        return PromptTokens(settings)
    except TokenizerError:
        raise
    except Exception as exc:  # a broken directory must stop start-up with its reason
        raise TokenizerError(str(exc)) from None
