"""A continuous-batching engine in model time: vLLM's scheduler, reduced to its timing.

The engine is a discrete-event object. It never sleeps and never reads a clock: the caller
passes `now` in, and `step(now)` plans one iteration, applies its effects, and returns it with
its duration. Tokens of that iteration count as produced at `iteration.end`, and the caller
must not step again before then. The HTTP server drives it in real time (scaled); the
offline fleet simulator drives many engines in virtual time with the same calls.

Per iteration, like vLLM V1 with chunked prefill:
1. running sequences in admission order: one decode token each, or the next chunk of a
   prompt still being prefilled, within `max_batched_tokens` prefill tokens; a decode that
   needs a new KV block when none is free preempts the most recently admitted sequence,
   whose blocks return to the cache and which is recomputed later (its cached blocks
   usually make that cheap);
2. then, if nothing was preempted, waiting sequences first come first served, while the
   prompt's uncached blocks fit in free KV space (evicting unreferenced cache), fewer than
   `max_running` sequences run, and prefill budget is left. A head that does not fit blocks
   the queue: it waits rather than fails.
Its duration comes from the profile's calibrated formula.

LoRA adapters (`max_loras` > 0): a sequence may name an adapter, which keys its block hashes
(`tokens.adapter_root`) and must sit in one of `max_loras` GPU slots while it runs. A waiting
sequence whose adapter is not resident loads it into a free slot, or into the slot of the
least recently used adapter no running sequence uses; each load adds `lora_load_s` to the
iteration. When every slot serves running sequences it is passed over, keeping its place,
and the sequences behind it may still be admitted, as vLLM's scheduler skips a request that
would put more than `max_loras` adapters in the batch.

Disaggregated decode (`submit(..., kv_transferred=True)`): the prompt's KV was computed by a
prefill server and copied here, so admission makes every prompt block resident at once (the
full ones enter the prefix cache as if computed) and the sequence decodes in the same
iteration: no prefill is computed or timed for it, and its first token costs one decode step.
Preempted, it is recomputed here like any other sequence.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from loadtest.replica.cache import CacheListener, PrefixCache
from loadtest.replica.profiles import Profile
from loadtest.replica.tokens import FILLER_WORDS, adapter_root, block_hashes, chain_hash

FILLER_COUNT = len(FILLER_WORDS)


class ContextLengthError(ValueError):
    """Prompt plus output cannot fit in the context limit or in the whole KV cache."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the server answers 503."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    profile: Profile
    kv_capacity_tokens: int | None = None  # None: the profile's calibrated capacity
    block_size: int = 16
    max_running: int = 256
    max_batched_tokens: int = 8192
    max_waiting: int = 4096
    context_limit: int = 131072
    max_loras: int = 0  # adapters resident in GPU slots at once; 0: LoRA off
    lora_load_s: float = 0.0  # model seconds to load an adapter into a slot

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "max_running",
            "max_batched_tokens",
            "max_waiting",
            "context_limit",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if self.max_loras < 0:
            raise ValueError("max_loras must not be negative")
        if self.lora_load_s < 0:
            raise ValueError("lora_load_s must not be negative")

    @property
    def capacity_tokens(self) -> int:
        return self.kv_capacity_tokens or self.profile.kv_capacity_tokens


@dataclass(slots=True, eq=False)
class EngineSequence:
    """One request inside the engine. Fields are read by drivers, written by the engine."""

    seq_id: int
    request_id: str
    tokens: list[str]  # the prompt, then each generated word as it is produced
    prompt_tokens: int
    max_tokens: int
    arrival_time: float
    hashes: list[int]  # chained hashes of the full blocks of `tokens`
    owner: Any = None  # the driver's handle (a stream, a future); never read here
    adapter: str | None = None  # the LoRA adapter serving it; None: the base model
    kv_transferred: bool = False  # its prompt's KV arrives from a prefill server
    status: Status = Status.WAITING
    num_generated: int = 0
    cached_tokens: int = 0  # prompt tokens found in cache at first admission
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    # KV bookkeeping
    num_computed: int = 0  # tokens whose KV is in the cache
    num_blocks: int = 0  # blocks held: the first `num_shared` by hash, the rest private
    num_shared: int = 0
    prefill_end: int = 0  # num_computed at which the current prefill is done
    admitted: bool = False

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_end

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(slots=True)
class Iteration:
    """One engine iteration, planned at `start`; its tokens exist at `end`."""

    start: float
    duration: float
    prefill_tokens: int
    decode_seqs: int
    decode_context: int
    # Sequences that produced exactly one token in this iteration; `seq.num_generated` is
    # the count including it. Finished ones are also listed in `finished`.
    emitted: list[EngineSequence] = field(default_factory=list)
    finished: list[EngineSequence] = field(default_factory=list)
    preempted: list[EngineSequence] = field(default_factory=list)
    lora_loads: int = 0  # adapters loaded into a slot; each adds `lora_load_s` to `duration`

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counts, as the metrics endpoints report them."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    iterations: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    # Prompt tokens whose KV came from a prefill server (some may have been cached here too).
    transferred_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.cache = PrefixCache(config.capacity_tokens, config.block_size)
        self.block_size = config.block_size
        self.counters = EngineCounters()
        self._waiting: OrderedDict[int, EngineSequence] = OrderedDict()
        self._running: dict[int, EngineSequence] = {}  # admission order
        self._waiting_tokens = 0
        self._busy_until = 0.0
        self._ids = itertools.count()
        # Resident adapters, least recently used first, and the running sequences using each.
        self._adapters: OrderedDict[str, int] = OrderedDict()

    # -- state a driver or a metrics page reads ------------------------------------------

    @property
    def max_sequence_tokens(self) -> int:
        """Longest prompt plus output accepted: the context limit, or all of the KV cache."""
        return min(self.config.context_limit, self.cache.capacity_tokens)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_tokens(self) -> int:
        return self._waiting_tokens

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def busy_until(self) -> float:
        return self._busy_until

    def next_step_time(self) -> float | None:
        """When `step` should next be called; None while there is nothing to do."""
        return self._busy_until if (self._running or self._waiting) else None

    def running(self) -> list[EngineSequence]:
        return list(self._running.values())

    def waiting(self) -> list[EngineSequence]:
        return list(self._waiting.values())

    def resident_adapters(self) -> list[str]:
        """The adapters in GPU slots, least recently used first."""
        return list(self._adapters)

    def adapter_users(self) -> dict[str, int]:
        """The adapters in GPU slots, least recently used first, with how many running
        sequences use each."""
        return dict(self._adapters)

    # -- requests in and out -------------------------------------------------------------

    def submit(
        self,
        tokens: list[str],
        max_tokens: int,
        now: float,
        *,
        request_id: str = "",
        owner: Any = None,
        hashes: list[int] | None = None,
        adapter: str | None = None,
        kv_transferred: bool = False,
    ) -> EngineSequence:
        """Queue a request. The engine keeps `tokens` and appends generated words to it.

        `adapter` names the LoRA adapter to serve it (None: the base model); `hashes`, when
        given, must be keyed by it as `tokens.adapter_root` keys them. `kv_transferred`: the
        prompt's KV came from a prefill server; it is made resident, not computed.
        """
        if adapter is not None:
            if not self.config.max_loras:
                raise ValueError(f"adapter {adapter!r} requested but LoRA is off (max_loras 0)")
            if not adapter:
                raise ValueError("an adapter name must not be empty")
        if not tokens:
            raise ValueError("a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        total = len(tokens) + max_tokens
        if total > self.max_sequence_tokens:
            raise ContextLengthError(
                f"{len(tokens)} prompt tokens plus {max_tokens} output tokens exceed the "
                f"limit of {self.max_sequence_tokens} tokens"
            )
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        if hashes is None:
            hashes = block_hashes(tokens, self.block_size, parent=adapter_root(adapter))
        seq = EngineSequence(
            seq_id=next(self._ids),
            request_id=request_id,
            tokens=tokens,
            prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            arrival_time=now,
            hashes=hashes,
            owner=owner,
            adapter=adapter,
            kv_transferred=kv_transferred,
        )
        self._waiting[seq.seq_id] = seq
        self._waiting_tokens += len(tokens)
        if not self._running and len(self._waiting) == 1:
            # An idle engine starts the next iteration on arrival, not at the end of the
            # last one, which may lie far in the past.
            self._busy_until = max(self._busy_until, now)
        return seq

    def abort(self, seq: EngineSequence) -> None:
        """The client left: free the sequence's blocks. Safe to call in any state."""
        if seq.status is Status.WAITING:
            if self._waiting.pop(seq.seq_id, None) is not None:
                self._waiting_tokens -= len(seq.tokens)
        elif seq.status is Status.RUNNING:
            self._release(seq)
            del self._running[seq.seq_id]
        else:
            return
        seq.status = Status.ABORTED
        self.counters.requests_aborted += 1

    # -- one iteration -------------------------------------------------------------------

    def step(self, now: float) -> Iteration | None:
        """Plan and apply one iteration starting at `now`; None when there is nothing to run."""
        if now < self._busy_until - 1e-9:
            raise ValueError(f"step at {now} before the last iteration ends at {self._busy_until}")
        # This runs once per iteration, hundreds of times a second in a real-time replica,
        # and mostly as a pure decode of a few sequences: the common path stays short.
        block_size = self.block_size
        budget = self.config.max_batched_tokens
        prefill_tokens = 0
        prefill_attention = 0.0
        decode_context = 0
        prefills: list[tuple[EngineSequence, int]] = []
        decodes: list[EngineSequence] = []
        preempted: list[EngineSequence] = []

        order = list(self._running.values())
        i = 0
        while i < len(order):
            seq = order[i]
            i += 1
            computed = seq.num_computed
            if computed < seq.prefill_end:
                if budget:
                    chunk = min(seq.prefill_end - computed, budget)
                    budget -= chunk
                    prefill_tokens += chunk
                    prefill_attention += chunk * (computed + chunk / 2)
                    prefills.append((seq, chunk))
                continue
            if computed + 1 > seq.num_blocks * block_size:
                if not self._grow(seq, order, preempted):
                    continue
            decode_context += computed + 1
            decodes.append(seq)

        loads = 0
        if self._waiting and (not preempted or not (prefills or decodes)):
            running_decodes = len(decodes)
            budget, prefill_tokens, prefill_attention, loads = self._admit(
                budget, prefill_tokens, prefill_attention, prefills, decodes
            )
            # Sequences whose KV was transferred decode from their first iteration.
            for seq in decodes[running_decodes:]:
                decode_context += seq.num_computed + 1

        if not prefills and not decodes:
            return None
        duration = self.profile.iteration_seconds(
            prefill_tokens, prefill_attention, len(decodes), decode_context
        )
        if loads:
            duration += loads * self.config.lora_load_s
        if self._adapters:
            self._touch_adapters()
        iteration = Iteration(
            start=now,
            duration=duration,
            prefill_tokens=prefill_tokens,
            decode_seqs=len(decodes),
            decode_context=decode_context,
            preempted=preempted,
            lora_loads=loads,
        )
        end = iteration.end
        for seq, chunk in prefills:
            seq.num_computed += chunk
            self._commit_full_blocks(seq)
            if seq.num_computed == seq.prefill_end:
                self._emit(seq, end, iteration)
        for seq in decodes:
            seq.num_computed += 1
            # A decode step completes a block only when it fills the block's last slot.
            if seq.num_computed % block_size == 0:
                self._commit_full_blocks(seq)
            self._emit(seq, end, iteration)
        counters = self.counters
        counters.iterations += 1
        counters.prompt_tokens += prefill_tokens
        counters.generation_tokens += len(iteration.emitted)
        self._busy_until = end
        return iteration

    # -- plain decode runs, for the offline simulator -------------------------------------

    def decode_run(self) -> int:
        """How many of the coming iterations are plain decodes of an unchanging batch: every
        running sequence decodes one token, none finishes, none needs a block that is not
        there, and nothing waiting could join. Between two such iterations nothing a client
        sees happens, so a simulator may apply them in one `advance_decode` instead of one
        `step` each. 0 when the next iteration must go through `step`.
        """
        running = self._running
        if not running:
            return 0
        # A waiting head might be admitted at the next iteration; only a full batch keeps
        # it out for sure (free KV space only shrinks while nothing finishes).
        if self._waiting and len(running) < self.config.max_running:
            return 0
        seqs = running.values()
        for seq in seqs:
            if seq.num_computed < seq.prefill_end:
                return 0
        # The last token of the soonest-finishing sequence goes through `step`, which
        # knows how to finish it.
        run = min(seq.max_tokens - seq.num_generated for seq in seqs) - 1
        block_size = self.block_size
        while run > 0:
            needed = sum(
                max(0, -(-(seq.num_computed + run) // block_size) - seq.num_blocks) for seq in seqs
            )
            if self.cache.can_allocate(needed):
                return run
            run //= 2
        return 0

    def decode_run_times(self, now: float, run: int, until: float | None = None) -> tuple[int, float]:
        """(iterations, end) of the first `run` plain-decode iterations from `now`, stopping
        before the first that would start after `until`. The sum is taken iteration by
        iteration, as `step` would, so both paths land on the same instants."""
        decode_seqs = len(self._running)
        context = sum(seq.num_computed + 1 for seq in self._running.values())
        iteration_seconds = self.profile.iteration_seconds
        done = 0
        end = now
        while done < run:
            if until is not None and end > until:
                break
            end += iteration_seconds(0, 0.0, decode_seqs, context)
            context += decode_seqs
            done += 1
        return done, end

    def advance_decode(self, now: float, iterations: int, end: float) -> None:
        """Apply `iterations` plain-decode iterations (at most `decode_run()`) that start at
        `now` and end at `end` (from `decode_run_times`)."""
        block_size = self.block_size
        cache = self.cache
        for seq in self._running.values():
            generated = seq.num_generated
            tokens = seq.tokens
            tokens.extend(FILLER_WORDS[(generated + i) % FILLER_COUNT] for i in range(iterations))
            seq.num_generated = generated + iterations
            hashes = seq.hashes
            full = len(tokens) // block_size
            if full > len(hashes):
                parent = hashes[-1] if hashes else adapter_root(seq.adapter)
                hashes.extend(block_hashes(tokens, block_size, len(hashes), parent))
            seq.num_computed += iterations
            blocks = -(-seq.num_computed // block_size)
            if blocks > seq.num_blocks:
                if not cache.allocate(blocks - seq.num_blocks):  # pragma: no cover - decode_run checked
                    raise RuntimeError("advance_decode beyond decode_run")
                seq.num_blocks = blocks
            self._commit_full_blocks(seq)
        if self._adapters:
            self._touch_adapters()
        counters = self.counters
        counters.iterations += iterations
        counters.generation_tokens += iterations * len(self._running)
        self._busy_until = end

    def _grow(self, seq: EngineSequence, order: list[EngineSequence], preempted: list[EngineSequence]) -> bool:
        """Give a decoding `seq` the new block its next token needs, preempting the most
        recently admitted sequences (the tail of `order`) while none is free. False when
        `seq` itself had to go."""
        cache = self.cache
        while not cache.allocate(1):
            victim = order.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        seq.num_blocks += 1
        return True

    def _admit(
        self,
        budget: int,
        prefill_tokens: int,
        prefill_attention: float,
        prefills: list[tuple[EngineSequence, int]],
        decodes: list[EngineSequence],
    ) -> tuple[int, int, float, int]:
        block_size = self.block_size
        cache = self.cache
        waiting = self._waiting
        adapters = self._adapters
        loads = 0
        passed_over: list[EngineSequence] = []
        while waiting and budget and len(self._running) < self.config.max_running:
            seq = next(iter(waiting.values()))
            adapter = seq.adapter
            load = evict = None
            if adapter is not None and adapter not in adapters:
                load = adapter
                if len(adapters) >= self.config.max_loras:
                    evict = next((name for name, users in adapters.items() if not users), None)
                    if evict is None:
                        # Out of the queue for this pass only: it goes back in front below.
                        del waiting[seq.seq_id]
                        passed_over.append(seq)
                        continue
            length = len(seq.tokens)
            hashes = seq.hashes
            transferred = seq.kv_transferred
            if transferred:
                # Nothing is computed: every full prompt block may be found here, and the
                # blocks taken hold the prompt and the first decoded token.
                total_blocks = length // block_size + 1
                lookup = hashes
            else:
                total_blocks = -(-length // block_size)
                # At least the last prompt token is computed, to produce the first output.
                hit_limit = (length - 1) // block_size
                lookup = hashes if len(hashes) <= hit_limit else hashes[:hit_limit]
            matched, unreferenced = cache.match(lookup)
            new_blocks = total_blocks - matched
            if not cache.can_allocate(new_blocks, unreferenced):
                break  # first come, first served: the head waits for space
            if adapter is not None:
                if load is not None:
                    if evict is not None:
                        del adapters[evict]
                        self.counters.lora_evictions += 1
                    adapters[load] = 0
                    self.counters.lora_loads += 1
                    loads += 1
                adapters[adapter] += 1
            cache.acquire(hashes[:matched])
            cache.allocate(new_blocks)
            del waiting[seq.seq_id]
            self._waiting_tokens -= length
            seq.status = Status.RUNNING
            seq.num_shared = matched
            seq.num_blocks = total_blocks
            seq.num_computed = matched * block_size
            seq.prefill_end = length
            if not seq.admitted:
                seq.admitted = True
                seq.cached_tokens = seq.num_computed
                self.counters.prefix_queries_tokens += length
                self.counters.prefix_hits_tokens += seq.num_computed
            self._running[seq.seq_id] = seq
            if transferred:
                seq.num_computed = length
                self._commit_full_blocks(seq)  # the copied blocks join the prefix cache
                self.counters.transferred_tokens += length
                decodes.append(seq)
                continue
            chunk = min(length - seq.num_computed, budget)
            budget -= chunk
            prefill_tokens += chunk
            prefill_attention += chunk * (seq.num_computed + chunk / 2)
            prefills.append((seq, chunk))
        for seq in reversed(passed_over):
            waiting[seq.seq_id] = seq
            waiting.move_to_end(seq.seq_id, last=False)
        return budget, prefill_tokens, prefill_attention, loads

    def _touch_adapters(self) -> None:
        """The adapters of this iteration's sequences become the most recently used, in
        their order, as vLLM touches each active adapter at every step."""
        adapters = self._adapters
        for name in [name for name, users in adapters.items() if users]:
            adapters.move_to_end(name)

    def _emit(self, seq: EngineSequence, end: float, iteration: Iteration) -> None:
        """`seq` produced its next token in `iteration`, which ends at `end`."""
        tokens = seq.tokens
        generated = seq.num_generated
        tokens.append(FILLER_WORDS[generated % FILLER_COUNT])  # tokens.output_word
        seq.num_generated = generated = generated + 1
        if seq.first_token_time is None:
            seq.first_token_time = end
        if len(tokens) % self.block_size == 0:
            self._hash_last_block(seq)
        iteration.emitted.append(seq)
        if generated >= seq.max_tokens:
            self._release(seq)
            del self._running[seq.seq_id]
            seq.status = Status.FINISHED
            seq.finish_time = end
            self.counters.requests_finished += 1
            iteration.finished.append(seq)

    def _hash_last_block(self, seq: EngineSequence) -> None:
        """The token just appended filled a block: chain its hash to the sequence's (all
        blocks before it are hashed already)."""
        hashes = seq.hashes
        parent = hashes[-1] if hashes else adapter_root(seq.adapter)
        hashes.append(chain_hash(seq.tokens[-self.block_size :], parent))

    def _commit_full_blocks(self, seq: EngineSequence) -> None:
        hashes = seq.hashes
        start = seq.num_shared
        end = min(len(hashes), seq.num_computed // self.block_size)
        if end > start:
            parent = hashes[start - 1] if start else None
            self.cache.commit(hashes[start:end], parent, seq.tokens, start, seq.adapter)
            seq.num_shared = end

    def _release(self, seq: EngineSequence) -> None:
        """Its blocks back to the cache and its use of its adapter's slot ended: a finish,
        an abort or a preemption."""
        self.cache.release(seq.hashes[: seq.num_shared], seq.num_blocks - seq.num_shared)
        seq.num_shared = seq.num_blocks = 0
        if seq.adapter is not None:
            self._adapters[seq.adapter] -= 1

    def _preempt(self, seq: EngineSequence) -> None:
        """Recompute later, as vLLM V1 does: its whole context becomes the next prefill."""
        self._release(seq)
        del self._running[seq.seq_id]
        seq.num_computed = seq.prefill_end = 0
        seq.kv_transferred = False  # the copy is gone with its blocks: recompute here
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.counters.preemptions += 1
        self._waiting[seq.seq_id] = seq
        self._waiting.move_to_end(seq.seq_id, last=False)
        self._waiting_tokens += len(seq.tokens)

    def clear_cache(self) -> None:
        self.cache.clear()

    def drop_adapter(self, adapter: str) -> bool:
        """Free an adapter's slot (it was unregistered). False if it is not resident, or if
        running sequences still use it: it then stays, to be evicted like any idle one."""
        users = self._adapters.get(adapter)
        if users is None or users:
            return False
        del self._adapters[adapter]
        return True

    def set_cache_listener(self, listener: CacheListener | None) -> None:
        """Watch the prefix cache's hashed blocks (the replica's KV events); the hashes are
        the chained ones of `tokens.block_hashes` and the tokens are words."""
        self.cache.listener = listener


def run_until_idle(
    engine: Engine,
    arrivals: SequenceOf[tuple[float, list[str], int]] = (),
    start: float = 0.0,
    decode_runs: bool = False,
) -> tuple[list[EngineSequence], list[Iteration], float]:
    """Drive `engine` in virtual time: submit `(time, tokens, max_tokens)` arrivals as their
    times come and step until nothing is left. Returns the sequences, every iteration and the
    final time. With `decode_runs`, plain decode runs are applied in one go (and then are not
    in the list of iterations), as the fleet simulator does. For tests and quick studies; a
    fleet simulator keeps its own event queue.
    """
    pending = sorted(arrivals, key=lambda arrival: arrival[0])
    sequences: list[EngineSequence] = []
    iterations: list[Iteration] = []
    now = start
    index = 0
    while index < len(pending) or engine.has_work:
        next_step = engine.next_step_time()
        next_arrival = pending[index][0] if index < len(pending) else None
        if next_arrival is not None and (next_step is None or next_arrival <= next_step):
            now = max(now, next_arrival)
            at, tokens, max_tokens = pending[index]
            sequences.append(engine.submit(tokens, max_tokens, now, request_id=str(index)))
            index += 1
            continue
        assert next_step is not None
        now = max(now, next_step)
        run = engine.decode_run() if decode_runs else 0
        if run > 1:
            done, end = engine.decode_run_times(now, run, until=next_arrival)
            engine.advance_decode(now, done, end)
            now = end
            continue
        iteration = engine.step(now)
        if iteration is None:
            raise RuntimeError("engine has work but schedules nothing")
        iterations.append(iteration)
    return sequences, iterations, now
