"""What cache-aware routing knows and learns of the replicas' caches.

Before ranking: the prompt's block hashes, its estimated length in tokens, and, from the
prefix index, how many leading tokens each replica is believed to hold. After the choice:
the chosen replica is recorded as holding the prompt (it will once it has prefilled). An
attempt that never got an answer leaves nothing behind. When the replica reports what it
really had cached, a wrong guess is corrected in the index, and its count of the prompt's
tokens teaches the model's tokens per character (`balancer.routing.token_ratio`), which
prices the next text prompts and the replica's text blocks against its capacity.

The tracker keeps the index only; the load a request puts on its replica (queued prefill,
a decode slot) is the routing core's to count (`balancer.routing.core`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from balancer.config import RoutingSettings
from balancer.routing.answer_returns import AnswerReturns
from balancer.routing.fleet import Replica
from balancer.routing.index import PrefixIndex
from balancer.routing.prefix import BlockHashes, PrefixHasher
from balancer.routing.prefix_demand import PrefixDemand
from balancer.routing.token_ratio import TokenRatio

# A learned ratio this close to a replica's current block weight leaves it alone: re-weighing
# costs a capacity check, and a fraction of a percent changes no decision.
REWEIGH_TOLERANCE = 0.01


@dataclass(slots=True)
class Routed:
    """One request's prediction, and what was learned of it."""

    hashes: BlockHashes
    prompt_tokens: int
    cached: dict[str, int]  # replica name -> predicted cached leading tokens
    block_tokens: float  # the tokens one of these blocks is predicted to hold
    model: str | None = None
    chars: int = 0  # the text prompt's length in characters; 0 for token ids
    adapter: str | None = None  # the LoRA adapter its blocks are keyed by
    learned: bool = False
    # When the chosen replica last used the deepest block it was predicted to hold, before
    # this request refreshed it: what its LRU engine would have evicted first if it missed.
    predicted_last_use: float | None = None
    # The deepest block any replica holds of the prompt, and how many requests per second
    # lately met that same prefix (balancer/routing/prefix_demand.py); None and 0 on a miss.
    demand_key: int | None = None
    prefix_rate: float = 0.0
    demand_counted: bool = False

    def blocks(self, cached_tokens: int) -> int:
        """The whole blocks behind a predicted count of cached tokens. The count was cut to an
        integer from blocks × a fractional block size, so it is rounded back: truncating
        would lose the last block whenever the product fell a hair short."""
        return round(cached_tokens / self.block_tokens)


@dataclass(frozen=True, slots=True)
class Lesson:
    """A replica's own figure against the prediction, in the balancer's token estimate."""

    predicted: int
    actual: int
    corrected: bool


class CacheTracker:
    # Called with (replica name, the prompt's block hashes, its LoRA adapter or None) each
    # time a request is sent: how other instances learn this one's decisions
    # (balancer/watchers/sync.py).
    on_record: Callable[[str, Sequence[int], str | None], None] | None = None

    def __init__(self, settings: RoutingSettings, clock: Callable[[], float]) -> None:
        self._count_demand(clock)
        self.hasher = PrefixHasher(settings.block_chars, settings.tokens_per_char)
        self.answer_chars = settings.index_answer_chars
        self.ratio = TokenRatio(settings.tokens_per_char, learn=settings.learn_tokens_per_char)
        self.index = PrefixIndex(
            tokens_per_block=self.hasher.tokens_per_block,
            ttl_s=settings.index_ttl_s,
            max_entries=settings.index_max_entries,
            clock=clock,
            default_capacity_tokens=settings.assumed_kv_capacity_tokens,
        )

    def predict(self, prompt: str | Sequence[int], model: str | None = None, adapter: str | None = None) -> Routed:
        hasher = self.hasher
        hashes = hasher.lazy(prompt, adapter)
        if isinstance(prompt, str):
            per_char = self.ratio.of(model)
            chars = len(prompt)
            prompt_tokens = hasher.estimate_tokens(prompt, per_char)
            per_block = hasher.block_chars * per_char
        else:
            chars = 0
            prompt_tokens = len(prompt)
            per_block = hasher.block_tokens
        cached = {name: int(blocks * per_block) for name, blocks in self.index.match(hashes).items()}
        return self._with_demand(Routed(hashes, prompt_tokens, cached, per_block, model, chars, adapter))

    def _count_demand(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.demand = PrefixDemand()
        self.answer_returns = AnswerReturns()

    def _with_demand(self, routed: Routed) -> Routed:
        if routed.cached:
            deepest = routed.blocks(max(routed.cached.values()))
            if deepest > 0:
                routed.demand_key = key = routed.hashes[deepest - 1]
                routed.prefix_rate = self.demand.rate(key, self.clock())
                self.answer_returns.prompt_met(key)
        return routed

    def uncached(self, routed: Routed, replica: Replica) -> int:
        """The prompt tokens `replica` must compute, by the prediction."""
        return max(routed.prompt_tokens - routed.cached.get(replica.name, 0), 0)

    def start(self, routed: Routed, replica: Replica) -> None:
        """The request is being sent to `replica`."""
        if routed.demand_key is not None and not routed.demand_counted:
            routed.demand_counted = True  # a retry is the same request
            self.demand.observe(routed.demand_key, self.clock())
        self._record_routed(routed, replica)
        if self.on_record is not None:
            self.on_record(replica.name, routed.hashes, routed.adapter)

    def _record_routed(self, routed: Routed, replica: Replica) -> None:
        blocks = routed.blocks(routed.cached.get(replica.name, 0))
        routed.predicted_last_use = (
            self.index.last_use(replica.name, routed.hashes[blocks - 1]) if blocks else None
        )
        self.index.record(replica.name, routed.hashes)

    def first_byte(self, routed: Routed, replica: Replica) -> None:
        """`replica` has answered: its prefill is done (called once per attempt)."""

    def record_answer(self, routed: Routed, replica: Replica, continuation: str) -> None:
        """`replica` wrote a whole answer after the prompt, and its text as the next turn's
        canonical prompt would hold it is `continuation`. Engines keep an answer's KV cached
        after its prompt's (vLLM caches each block it fills while decoding, SGLang inserts
        the whole sequence when it ends), so the next turn, which sends the answer back,
        finds it there. Text prompts only: token ids carry no answer text to hash. Only
        while answers come back (routing/answer_returns.py)."""
        if not routed.chars or not continuation or not self.answer_returns.worth_recording():
            return
        hashes = routed.hashes.continued(continuation[: self.answer_chars])
        if len(hashes) <= len(routed.hashes):
            return  # not a whole block more
        self.index.record(replica.name, hashes)
        self.answer_returns.recorded_answer(hashes[-1])
        if self.on_record is not None:
            self.on_record(replica.name, hashes, routed.adapter)

    def transferred(self, routed: Routed, replica: Replica) -> None:
        """The prompt's KV was copied to `replica`, a decode replica of a disaggregated pair:
        it holds the prefix now as if it had computed it, and may serve it whole later."""
        self.index.record(replica.name, routed.hashes)

    def finish(self, routed: Routed, replica: Replica, *, answered: bool, prefilled: bool) -> None:
        """The attempt on `replica` is over. One that never got an answer leaves nothing in
        the replica's cache beyond what it had, so the index forgets what `start` recorded."""
        if not answered:
            self._forget_attempt(routed, replica)

    def _forget_attempt(self, routed: Routed, replica: Replica) -> None:
        had = routed.blocks(routed.cached.get(replica.name, 0))
        self.index.truncate(replica.name, routed.hashes, had)

    def learn(self, routed: Routed, replica: Replica, prompt_tokens: int, cached_tokens: int | None) -> Lesson | None:
        """Compare the replica's reported cache hit with the prediction.

        Reported figures are in the replica's own tokens, so they are compared as a fraction
        of the prompt. A replica that held less than predicted has evicted (or restarted and
        lost) blocks the index still lists. Engines evict least recently used first, so
        everything it last used no later than the block it missed is gone too: those entries
        leave the index. This prompt stays: the replica has just computed it.
        """
        if routed.learned or prompt_tokens <= 0:
            return None
        routed.learned = True
        if routed.chars:
            self._reweigh(replica, self.ratio.observe(routed.model, routed.chars, prompt_tokens))
        if cached_tokens is None:
            return None
        fraction = min(max(cached_tokens / prompt_tokens, 0.0), 1.0)
        predicted = routed.cached.get(replica.name, 0)
        actual = int(fraction * routed.prompt_tokens)
        corrected = False
        if actual + routed.block_tokens < predicted and routed.predicted_last_use is not None:
            self.index.forget_older_than(replica.name, routed.predicted_last_use)
            corrected = True
        return Lesson(predicted, actual, corrected)

    def _reweigh(self, replica: Replica, per_char: float) -> None:
        weight = self.hasher.block_chars * per_char
        index = self.index
        if abs(weight - index.block_tokens_of(replica.name)) > REWEIGH_TOLERANCE * weight:
            index.set_block_tokens(replica.name, weight)

    def forget(self, replica: str) -> None:
        self.index.remove_replica(replica)
