"""Cache aware: the replica that will return the first token soonest, judged in tokens.

Every eligible replica gets a cost in *prefill-token equivalents* (one unit = the time one
GPU replica of weight 1.0 takes to prefill one uncached prompt token, about 23 µs for
llama-3.1-8b on an H100 at 43 tokens/ms, see ``loadtest/replica/profiles.py``)::

    cost = uncached + queued + decode + locality

    uncached = (prompt_tokens - cached_tokens[r]) * prefill_weight / r.weight
    queued   = r.prefill_tokens_queued            * queue_weight   / r.weight
    decode   = r.decoding                         * decode_tokens_per_seq / r.weight
    locality = 0 when the request's origin region or the replica's `region` label is unknown,
               same_region_penalty_tokens when they are equal, other_region_penalty_tokens
               when they differ

Lowest cost first, so a long cached prefix wins until the replica holding it has so much
prefill queued that a cold replica would answer first. Dividing the work terms by the
replica's weight reads `weight` as relative speed: a replica of weight 2.0 gets through the
same tokens in half the time, so at equal cost it takes twice the work.

Why the queue term is also the hot-spot guard: the balancer adds a request's uncached tokens
to `prefill_tokens_queued` the moment it routes it, not when the replica reports back. When
every request shares one system prompt and only one replica holds it yet, that replica wins
only until its queue is as long as the prefix is worth; the next request goes elsewhere,
warms that replica, and a busy fleet spreads (see tests/policies/test_cache_aware.py). At light load
the prefix stays on the few warm replicas that can carry the traffic, each with a backlog
never longer than the prefix is worth: no request waits longer than it would cold, but the
other replicas stay idle (and cold) until the load rises. That is the myopic optimum for each
request's first token; it is not a deliberate warm-up of the whole fleet.

Tiers: replicas labelled ``tier: overflow`` (paid-per-use capacity) are ranked after every
committed replica (any other tier, or none) unless the committed replica with the shortest
estimated wait would still make this request wait more than `overflow_after_ms`; then every
replica competes on cost alone. The estimated wait of a replica in ms is
``(prefill_tokens_queued + this request's uncached tokens there) / (prefill_tokens_per_ms *
weight)``. Demoted overflow replicas stay in the list, in cost order, for failover.

Near-ties spread: each cost is compared with a uniform random jitter of up to
``tie_tolerance_tokens + tie_tolerance_ratio * cost`` added, so replicas closer than that swap
places at random (an idle fleet spreads its misses over every replica, and several balancer
instances with slightly stale counts do not herd), while a clearly better replica always wins.

Each Choice's terms, all floats: ``cached`` (predicted cached leading tokens there, a raw
count, for explanation), ``uncached``, ``queued``, ``decode``, ``locality`` (the four cost
contributions above, in prefill-token equivalents; with the default weights on a weight-1.0
replica the first three equal the raw token and sequence-token counts), ``cost`` (their sum),
``wait_ms`` (the estimated wait used for the overflow decision) and ``tier`` (0.0 = ranked by
cost with everyone, 1.0 = overflow replica held back behind the committed ones).

Zones: the request carries only its origin region, so zone labels are not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from policies.base import LOAD_TERM, Choice, Policy, ReplicaView, RequestFeatures
from policies.costs import (
    BUSY_REFERENCE_MS,
    OVERFLOW_TIER,
    fraction_param,
    locality,
    number_param,
    rank_with_tiers,
    region_penalties,
    saturation,
)


class CacheAwarePolicy(Policy):
    """Lowest estimated time to first token first, counted in prefill-token equivalents.

    Parameters (defaults from the llama-3.1-8b / H100 / TP1 profile in loadtest/replica/profiles.py):

    prefill_weight (cost tokens per uncached prompt token, > 0; default 1.0)
        The unit of the cost: one token this request must prefill on that replica.
    queue_weight (cost tokens per queued prefill token, >= 0; default 1.0)
        Prefill already routed there runs before this request's (FIFO admission), so one
        queued token delays the first token as much as one of its own. 0 disables the load
        term and with it the hot-spot guard.
    decode_tokens_per_seq (tokens per decoding sequence, >= 0; default 32.0)
        Each decoding sequence adds d1 + d2·ctx to every engine iteration: at a 4k context
        (0.0090 + 4.39e-5·4096) ms ≈ 0.19 ms ≈ 10 prefill tokens (at b = 0.0191 ms/token).
        A request spends about three iterations between arrival and first token (the one in
        progress, a chunk of queued prefill, its own chunk), so ≈ 30, rounded to 32.
    same_region_penalty_tokens (tokens, >= 0; default 0.0)
        Added when the replica's `region` label equals the request's origin region.
    other_region_penalty_tokens (tokens, >= same_region_penalty_tokens; default 4096.0)
        Added when they differ: roughly the prefill tokens a cross-region round trip is
        worth (a 60–100 ms RTT at 43 tokens/ms ≈ 2.6k–4.3k tokens).
    overflow_after_ms (ms, >= 0; default 1000.0)
        Overflow replicas compete on cost only once the best committed replica's estimated
        wait exceeds this: an interactive time-to-first-token target.
    prefill_tokens_per_ms (tokens per ms per unit of weight, > 0; default 43.0)
        Prefill speed for the wait estimate: 4,096 tokens in ≈ 95 ms on llama-3.1-8b / H100.
    tie_tolerance_tokens (tokens, >= 0; default 128.0)
        Absolute width of the random tie-break: about 3 ms of prefill, well inside the
        model's ±15–25 % error.
    tie_tolerance_ratio (fraction of the cost, 0..1; default 0.05)
        Relative width of the random tie-break, added to the absolute one.
    adapter_weight (>= 0; default 1.0)
        For a request on a LoRA adapter, weight of what a replica without it in its slots
        costs, in the prefill tokens of that time (at `prefill_tokens_per_ms`): the
        replica's `lora_load_ms`, and a load more times the chance that the adapter it
        would evict is asked for again with no other copy (balancer/routing/adapters.py).
        Any request, on an adapter or not, also counts the loads under way on a replica
        (the engine stalls while it loads) as that much prefill queued there.
        0: blind to adapters and their loads.
    overload_load_weight (>= 0; default 4.0)
        In overload a load stalls its engine for everyone queued there, not only for this
        request: the load's price is multiplied by 1 + this × β, where β is the shortest
        candidate backlog over itself plus 30 ms of prefill (0 while some replica is idle,
        near 1 when all are queueing), as `predictive` prices a load as the fleet's work.
        Without it, at 40 requests/s on 8 replicas with 4 adapter slots (Zipf 1.0) a load
        beside a slightly shorter queue looked cheap: TTFT p99 7.8 s against the
        adapter-blind policy's 7.0 s; with it, 2.3 s. 0: a load costs its time alone.
    """

    name = "cache_aware"
    needs_prompt = True

    def __init__(
        self,
        *,
        prefill_weight: float = 1.0,
        queue_weight: float = 1.0,
        decode_tokens_per_seq: float = 32.0,
        same_region_penalty_tokens: float = 0.0,
        other_region_penalty_tokens: float = 4096.0,
        overflow_after_ms: float = 1000.0,
        prefill_tokens_per_ms: float = 43.0,
        tie_tolerance_tokens: float = 128.0,
        tie_tolerance_ratio: float = 0.05,
        adapter_weight: float = 1.0,
        overload_load_weight: float = 4.0,
        seed: int | None = None,
        **params: Any,
    ) -> None:
        super().__init__(seed=seed, **params)
        self.prefill_weight = number_param(
            "prefill_weight",
            prefill_weight,
            "cost tokens per uncached prompt token",
            positive=True,
        )
        self.queue_weight = number_param(
            "queue_weight", queue_weight, "cost tokens per queued prefill token"
        )
        self.decode_tokens_per_seq = number_param(
            "decode_tokens_per_seq", decode_tokens_per_seq, "tokens per decoding sequence"
        )
        self.same_region_penalty_tokens, self.other_region_penalty_tokens = region_penalties(
            "tokens", same_region_penalty_tokens, other_region_penalty_tokens, "tokens"
        )
        self.overflow_after_ms = number_param("overflow_after_ms", overflow_after_ms, "ms")
        self.prefill_tokens_per_ms = number_param(
            "prefill_tokens_per_ms", prefill_tokens_per_ms, "tokens per ms", positive=True
        )
        self.tie_tolerance_tokens = number_param("tie_tolerance_tokens", tie_tolerance_tokens, "tokens")
        self.tie_tolerance_ratio = fraction_param("tie_tolerance_ratio", tie_tolerance_ratio, "fraction of the cost")
        self.adapter_weight = number_param("adapter_weight", adapter_weight, "weight")
        self.overload_load_weight = number_param("overload_load_weight", overload_load_weight, "weight")

    def _busy(self, replicas: Sequence[ReplicaView]) -> float:
        """β: the shortest candidate backlog (queued prefill and loads under way, in
        tokens) over itself plus BUSY_REFERENCE_MS of prefill."""
        rate = self.prefill_tokens_per_ms
        shortest = min((r.prefill_tokens_queued + r.adapter_slots.loading_ms * rate) / r.weight for r in replicas)
        return saturation(shortest, BUSY_REFERENCE_MS * rate)

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        prompt = request.prompt_tokens
        if prompt < 0:
            prompt = 0
        cached_of = request.cached_tokens.get
        origin = request.origin_region
        prefill_w = self.prefill_weight
        queue_w = self.queue_weight
        decode_w = self.decode_tokens_per_seq
        same_pen = self.same_region_penalty_tokens
        other_pen = self.other_region_penalty_tokens
        inv_rate = 1.0 / self.prefill_tokens_per_ms
        tol_abs = self.tie_tolerance_tokens
        tol_rel = self.tie_tolerance_ratio
        rand = self.rng.random
        adapter = request.adapter if self.adapter_weight > 0 else None
        sees_loads = self.adapter_weight > 0  # blind to adapters is blind to their loads too
        # Adapter loads in prefill tokens of the same time.
        adapter_tokens_per_ms = self.adapter_weight * self.prefill_tokens_per_ms
        if adapter is not None and self.overload_load_weight > 0 and replicas:
            adapter_tokens_per_ms *= 1.0 + self.overload_load_weight * self._busy(replicas)

        # One pass: cost, wait and jittered sort key of each replica. Overflow replicas are
        # only noted here; whether to hold them back is known once the best committed wait is.
        choices: list[Choice] = []
        keys: list[float] = []
        overflow: list[int] = []
        add_choice = choices.append
        add_key = keys.append
        best_committed_wait = math.inf
        i = 0
        for r in replicas:
            cached = cached_of(r.name, 0)
            if cached > prompt:
                cached = prompt
            elif cached < 0:
                cached = 0
            uncached_tokens = prompt - cached
            queued_tokens = r.prefill_tokens_queued
            if sees_loads:
                # A LoRA adapter load under way stalls the engine: as much prefill as fits in it.
                queued_tokens += r.adapter_slots.loading_ms * self.prefill_tokens_per_ms
            inv_w = 1.0 / r.weight
            uncached = uncached_tokens * prefill_w * inv_w
            queued = queued_tokens * queue_w * inv_w
            decode = r.decoding * decode_w * inv_w
            labels = r.labels
            near = 0.0 if origin is None else locality(labels, origin, same_pen, other_pen)
            cost = uncached + queued + decode + near
            wait_ms = (queued_tokens + uncached_tokens) * inv_w * inv_rate
            adapter_cost = 0.0
            if adapter is not None:
                slots = r.adapter_slots
                if not slots.holds(adapter):
                    victim = slots.victim()
                    load_ms = slots.load_ms * (1.0 + (slots.eviction_cost(victim) if victim is not None else 0.0))
                    adapter_cost = load_ms * adapter_tokens_per_ms
                    cost += adapter_cost
                    wait_ms += slots.load_ms
            add_choice(
                Choice(
                    r,
                    {
                        "cached": cached + 0.0,  # a float, cheaper than float()
                        "uncached": uncached,
                        "queued": queued,
                        "decode": decode,
                        "locality": near,
                        "adapter": adapter_cost,
                        "cost": cost,
                        "wait_ms": wait_ms,
                        "tier": 0.0,
                    },
                )
            )
            if adapter_cost:
                choices[-1].terms[LOAD_TERM] = slots.load_ms * adapter_tokens_per_ms
            add_key(cost + rand() * (tol_abs + tol_rel * cost))
            if labels.get("tier") == OVERFLOW_TIER:
                overflow.append(i)
            elif wait_ms < best_committed_wait:
                best_committed_wait = wait_ms
            i += 1

        return rank_with_tiers(choices, keys, overflow, best_committed_wait, self.overflow_after_ms)

