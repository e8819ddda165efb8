"""Precise mode's routing state: what the engines report they cache, plus what was just routed.

Two indexes, both keyed by kvlb's hashes of engine-sized blocks of token ids:
- `exact`, fed only by the engines' KV events (`balancer.kv_events`): a block is listed while
  the engine holds it, whatever its age, and leaves when the engine says it evicted it;
- `index`, the speculative one: a prompt routed to a replica is listed there for
  `speculative_ttl_s`, because its blocks exist on the engine only once prefilled and its
  events follow. Follow-up requests in that window (the next turn of a chat, a burst sharing
  a document) go to the same replica instead of scattering. Other kvlb instances' routing
  decisions (balancer/sync.py) land there too.

A request's predicted hit is the longer of the two, capped below the whole prompt: engines
always compute at least the prompt's last token, so a prompt of exactly N cached blocks is
answered with N - 1 of them from cache (vLLM: `num_tokens - 1` is the longest hit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from balancer.config import KvEventsSettings, RoutingSettings
from balancer.fleet import Replica
from balancer.index import PrefixIndex
from balancer.kv_events import KvEventIndex
from balancer.prefix import PrefixHasher
from balancer.routing import CacheTracker, Lesson, Routed
from balancer.tokenizer import ModelTokenizer, TokenizerError, given_ids, tokenize_request_body

# Events, not age, remove exact entries; the TTL only has to be longer than any cache life.
EXACT_TTL_S = 10 * 365 * 86400.0


class RemotePrompt(bytes):
    """A prompt kvlb cannot tokenize itself: the body of the engine `/tokenize` call that will."""


class PreciseTracker(CacheTracker):
    def __init__(self, routing: RoutingSettings, settings: KvEventsSettings, clock: Callable[[], float]) -> None:
        self.block_size = settings.block_size
        self.hasher = PrefixHasher(block_tokens=settings.block_size)
        self.index = PrefixIndex(
            tokens_per_block=settings.block_size, ttl_s=settings.speculative_ttl_s,
            max_entries=routing.index_max_entries, clock=clock,
        )
        self.exact = PrefixIndex(
            tokens_per_block=settings.block_size, ttl_s=EXACT_TTL_S,
            max_entries=routing.index_max_entries, clock=clock,
        )
        # Per replica, the requests sent there whose first byte has not come back: their
        # blocks are on the way whatever the engine evicts meanwhile.
        self._prefilling: dict[str, dict[int, Routed]] = {}
        self.events = KvEventIndex(self.exact, settings.block_size, settings.max_blocks_per_replica,
                                   self.index, self._prefilling_hashes)

    def predict(self, prompt: str | Sequence[int]) -> Routed:
        if isinstance(prompt, str):
            raise TypeError("precise mode routes on token ids")
        hashes = self.hasher.lazy(prompt)
        tokens = len(prompt)
        longest = (tokens - 1) // self.block_size if tokens else 0
        exact = self.exact.match(hashes)
        speculative = self.index.match(hashes)
        cached = {}
        for name in exact.keys() | speculative.keys():
            blocks = min(max(exact.get(name, 0), speculative.get(name, 0)), longest)
            if blocks:
                cached[name] = blocks * self.block_size
        return Routed(hashes, tokens, cached)

    def _prefilling_hashes(self, replica: str) -> list[Sequence[int]]:
        return [routed.hashes for routed in self._prefilling.get(replica, {}).values()]

    def start(self, routed: Routed, replica: Replica) -> None:
        super().start(routed, replica)
        self._prefilling.setdefault(replica.name, {})[id(routed)] = routed

    def _done_prefilling(self, routed: Routed) -> None:
        if routed.replica is not None:
            waiting = self._prefilling.get(routed.replica.name)
            if waiting is not None:
                waiting.pop(id(routed), None)
                if not waiting:
                    del self._prefilling[routed.replica.name]

    def first_byte(self, routed: Routed) -> None:
        self._done_prefilling(routed)
        super().first_byte(routed)

    def finish(self, routed: Routed, *, answered: bool) -> None:
        self._done_prefilling(routed)
        super().finish(routed, answered=answered)

    def learn(self, routed: Routed, replica: Replica, prompt_tokens: int, cached_tokens: int) -> Lesson | None:
        # Nothing to correct: the engine's events keep the exact index right. The lesson is
        # still reported, since prediction against outcome is what precise mode promises.
        if routed.learned or prompt_tokens <= 0:
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
