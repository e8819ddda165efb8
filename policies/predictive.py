"""Predictive: each replica priced in predicted milliseconds, this request's and the fleet's.

`cache_aware` counts prefill-token equivalents with fixed weights, which serves one load
and one kind of card. This policy predicts time with the replica's engine model (the
chunked-prefill iteration formula of docs/calibration.md) fed with the load the balancer
has routed there, and two speeds per replica fitted online from what the balancer observes
(`balancer/routing/latency.py`): one from times to first token, one from the time between
output tokens, so a replica slower than its profile claims, at prefill or at decode, loses
its share without anyone re-deriving weights. For replica r (all in ms)::

    batch   = D·d1 + X·d2                    what r's decode batch adds to each iteration
    own     = e + d1 + d2·(p + n/2)          this request's own decode iteration, alone
    model   = (q·b + P + (1.5 + (q + u)/chunk)·(a + batch)) / w + L
    itl     = (own + batch) / w              its predicted time per output token there
    beside  = B̄·w + ρ'·(batch − B̄·w)         the batch the answer is expected to decode beside
    ρ'      = ρ + μ·(1 − ρ) where r would copy the prefix (c < C), else ρ
    μ       = min(1, λ·n·own / 1000 / h / (0.5·D̄))   its share of the holders' batches, over one half
    decode  = (1 − β)² · (decode_weight · n · (beside·s + own·(s − 1))
                          + (prefill_stall_weight · P + avoidable_stall_weight · (P − P_min))·v·D) / w
    fleet   = fleet_weight · β · (P·v + fleet_decode_weight · n·D·(d1 + d2·(p + n/2))·s) / w
    copy    = (1 − β)² · σ · (P − P_C) · v / w   with σ = m / (1 + m), m = λ · copy_horizon_s / (h + 1)
    cost    = model·v + decode + fleet + locality − copy

and, with `ttft_target_weight` set, the excess over the request's time-to-first-token
target where another candidate is predicted to meet it (policies/ttft_target.py); with
P = u·b + k·u·(c + u/2) the request's own prefill there, p the prompt's tokens, c those
r holds cached, u = p − c, q the prefill queued on r, L the LoRA adapter loads under way
there (each stalls the engine's iterations, so whoever comes next waits it out), D the
sequences r decodes and X their context tokens, C the most of the prompt any replica holds
and h how many hold that much, P_C the prefill of the prompt on top of C (and P_min, the
least P among the candidates), λ the requests per
second that lately met that same prefix (balancer/routing/prefix_demand.py), n the expected
output (the learned mean output of answers like it, else `default_output_tokens`, either
bounded by `max_tokens` and `max_output_tokens`), B̄ the candidates' mean batch per unit of
weight, ρ the batch's persistence (how much of a replica's batch at sending the fleet's
answers lately still decoded beside, 0 to 1, learned by the routing core:
balancer/routing/batch_persistence.py; 1 until learned), μ how much of its holders'
batches a copy of a sought-after prefix moves (its requests over the answer's own decode,
n·own ms, per holder, against half the candidates' mean count of decoding sequences D̄:
a prefix that makes up most of what its holders decode thins every batch by spreading,
which no one answer's persistence measures, while a prompt met now and then moves little,
and a replica that would copy it is priced as the fleet's batches persist), w r's weight, v its relative prefill
speed (its fitted time-to-first-token multiplier over the candidates' median; where every
candidate's fitted terms are in use, its terms weighed by this prompt's prefill, over the
same median) and s its relative decode speed (the same for its fitted time-per-output-token
multiplier, times its decode terms' shape where every candidate's are in use). Each is
1.0 while within `speed_tolerance` of the median: replicas of one kind stay equal instead
of ranking on the noise of the loads each happened to see, and an error common to the
fleet, such as a profile a little off, cancels. With s at 1.0 the decode term is the
batch's marginal effect on this request's tokens; a replica that decodes s times slower
adds the rest of its own decode too.

`model` is this request's own time to first token. `decode` is what the batch it joins does
to its own tokens: without it a light load piles onto the few warm replicas, and every
token of every sequence there is slower than on an idle one. It is also what this request's
prefill does to that batch: every sequence decoding there waits out each prefill chunk, so
P ms of prefill costs D sequences P ms each. Without that half, the decode term moved
conversations off the replicas that held them to spread decode, and paid for it in prefill
that stalled the new replica's batch (multi-turn on 4 replicas: hit 0.760 against 0.824). `fleet` is what the placement
costs everyone else: the GPU time of its prefill (nothing on a full hit) and the slowdown
its decode adds to the sequences beside it. β = m / (m + busy_reference_ms), m the shortest
prefill backlog (ms) among the candidates, says how saturated the fleet is: 0 while some
replica is idle, so a light load gets the fastest answer; near 1 when every replica queues,
when each prefill token saved is GPU time given back to everyone waiting, so an overloaded
fleet keeps its cache hits instead of turning into least-load, and the decode term fades
out because prefill, not the batch, is then what every request waits for. `copy` is the
share of a copy's prefill that the requests after it will use: a replica holding less of a
prefix than its holders pays to compute the rest once, and every later request sent there
finds it cached. m is how many of those there will be, by the prefix's recent rate over
copy_horizon_s and shared by the replicas that would hold it; one request's own price cannot
see them. A shared system prompt at 12 requests/s on 8 replicas then spreads over all 8
instead of 6, which lightens every batch; a conversation's history, met once per turn, has
no rate and stays where it is. What the copy buys the requests after it is a thinner batch,
so the credit fades with the decode term as the fleet saturates, when each prefill token is
GPU time taken from everyone queued. A longer horizon copies in a trace's lulls too: at 1 s
the shared trace at 4x (seeds 0-2) lost 0.3 points of hit and 2 % of end-to-end p50, and
fell below a 2 s TTFT SLO for 90 % of requests (89.8 %); at 0.5 s it runs as without.

The hot-spot guard, the near-tie spread, locality and tiers are cache_aware's, in
milliseconds: the load the balancer adds the moment it routes a request (queued prefill, a
decode slot, its context) makes a hot replica's cost grow until a cold one is cheaper;
costs within ``tie_tolerance_ms + tie_tolerance_ratio · cost`` swap at random; replicas
labelled `tier: overflow` compete only once the best committed replica's predicted time to
first token exceeds `overflow_after_ms`.

Each Choice's terms, all floats: ``cached`` (predicted cached tokens there),
``output_tokens`` (n), ``model_ttft_ms`` (`model`: what the routing core compares with the
observed time to fit the replica's multiplier), ``ttft_ms`` (model × the fitted multiplier:
the prediction in this fleet's own milliseconds), ``model_itl_ms`` (`itl`, fitted the same
way against the observed time per output token), ``speed`` (v), ``decode_speed`` (s),
``decode_ms``, ``fleet_ms``, ``copy_credit_ms``, ``locality_ms``, ``busy`` (β),
``persistence`` (ρ' as used), ``cost``,
``wait_ms`` (= ttft_ms, for the overflow decision), ``tier``, ``target_ms`` (what it paid
for its excess over a target, only where it paid), and the terms the two
predictions add up are the Choice's ``parts``, which the routing core fits one by one
(MODEL_TTFT_PARTS and MODEL_ITL_PARTS of policies/base.py). Where the replica's fitted terms are in use,
``ttft_ms`` is those terms applied to the first three instead of the multiplier to
``model_ttft_ms``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from policies.base import (
    DECODE_ITERATION_MS,
    DECODE_MS_PER_CONTEXT_TOKEN,
    DECODE_MS_PER_SEQ,
    LOAD_TERM,
    MODEL_ITL_TERM,
    MODEL_TTFT_TERM,
    TTFT_TERM,
    Choice,
    Policy,
    ReplicaView,
    RequestFeatures,
)
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
from policies.ttft_target import steer_to_target


class PredictivePolicy(Policy):
    """Lowest predicted milliseconds first: this request's wait, its decode, the fleet's work.

    Engine model (defaults: llama-3.1-8b / H100 / TP1, docs/calibration.md):

    iteration_ms (a, ms, >= 0; default 5.3)
        Fixed cost of an engine iteration that prefills.
    prefill_ms_per_token (b, ms, > 0; default 0.0191)
        Linear prefill cost per prompt token (≈ 52 tokens per ms).
    attention_ms_per_token2 (k, ms, >= 0; default 7.4e-7)
        Attention cost of a prefilled token per token before it.
    decode_ms_per_seq (d1, ms, >= 0; default 0.009)
        Iteration cost per decoding sequence.
    decode_ms_per_context_token (d2, ms, >= 0; default 4.39e-5)
        Iteration cost per context token of the decoding sequences.
    decode_iteration_ms (e, ms, >= 0; default 8.3)
        Fixed cost of an iteration that only decodes.
    chunk_tokens (tokens, >= 1; default 8192)
        Prefill tokens one iteration takes (vLLM's max_num_batched_tokens, SGLang's
        chunked_prefill_size): a long queue is that many iterations.

    Weights:

    decode_weight (>= 0; default 0.6)
        Weight of the batch's effect on this request's own decode, at β = 0.
    fleet_weight (>= 0; default 4.0)
        Weight of the fleet's work at β = 1: 4 prices one ms of GPU time spent on this
        request's prefill as four ms of the waits of those queued behind it.
    prefill_stall_weight (>= 0; default 0.2)
        Weight of the stall this request's prefill inflicts on each sequence decoding on
        the replica, at β = 0 (in ms per ms of prefill per sequence). On the shared trace at
        4x (seeds 0-2) the hit is 0.260-0.266 with it, 0.217-0.229 without, and end-to-end
        p50 3.5-3.6 s against 4.9-5.9 s; on 256 tenants of 6,000-token prompts over 4
        replicas in overload, TTFT p50 141 ms against 640.
    avoidable_stall_weight (>= 0; default 0.8)
        Weight, added to prefill_stall_weight, of the stall that the part of this request's
        prefill a cache on another candidate would have saved inflicts on each sequence
        decoding on the replica, at β = 0: what a conversation pays its new replica's batch
        for leaving the one that holds it. With 1,500-token answers (48 conversations of 6
        turns, each 25 s after the last, 8 replicas) the decode term at 0 moved 27 of 240
        follow-up turns to smaller batches, for no gain in time per token: hit 0.869 and
        TTFT p99 225 ms at 0, 0.941 and 36 ms at 0.8, as `cache_aware`. On the shared trace
        at 0.8, over seeds 0-3 at 4x, hit 0.266 to 0.276 and TTFT p99 5.1 to 5.0 s on
        average; at 1x (seed 0) hit 0.323 to 0.333, TTFT p99 2.34 to 2.37 s.
    fleet_decode_weight (>= 0; default 0.0)
        Weight, inside the fleet's work, of the slowdown this request's decode adds to the
        sequences beside it. Off by default: on the shared trace in overload it spread
        decode at the expense of cache hits (hit 0.207 and TTFT p99 12.7 s at 1.0, against
        0.224 and 7.4 s at 0, 4x speed-up on 8 replicas).
    busy_reference_ms (ms, > 0; default 30.0)
        The shortest candidate backlog at which β is one half.
    copy_horizon_s (s, >= 0; default 0.5)
        How far ahead the requests a copy of a prefix will serve are counted (its rate times
        this, over the replicas that would hold it). 0: each request pays its whole copy.
    use_fitted_speed (true or false; default true)
        Rank on each replica's fitted speed; false trusts the profile (and the weights).
    speed_tolerance (fraction, >= 0; default 0.3)
        Fitted prefill speeds within this fraction of the candidates' median count as equal.
    use_fitted_terms (true or false; default true)
        Also price each replica with its coefficient per term of its predictions (the
        iterations waited, the prompt tokens, their attention; the decode iteration, the
        context it reads), fitted apart where they predict its answers well
        (balancer/routing/term_fit.py): a card faster than its profile at long prompts
        but not at short ones is priced so at each length, in the prediction and, past the
        speed tolerances, in the ranking. false: one multiplier on the whole prediction.
        Needs use_fitted_speed.
    learn_batch_persistence (true or false; default true)
        Price each candidate's decode batch in the decode term as the batch the answer is
        expected to decode beside: its distance from the candidates' mean batch scaled by
        how much of a batch the fleet's answers lately still decoded beside
        (balancer/routing/batch_persistence.py; 1 until enough have answered). false: the
        batch as it stands when the request is sent.
    decode_speed_tolerance (fraction, >= 0; default 1.0)
        The same for decode speeds. Wider, because the time between a stream's tokens also
        carries the prefill chunks its replica ran meanwhile, which the fit cannot tell
        from a slow decode: at 0.3 it cost cache hits on the shared trace at 4x.
    default_output_tokens (tokens, >= 0; default 256)
        Expected output when the request names no `max_tokens` and too few answers like it
        have ended on their own to learn from (their mean, bounded by `max_tokens`, wins).
    max_output_tokens (tokens, >= 1; default 2048)
        Cap on the expected output read from `max_tokens` (clients often name a bound far
        above what they get).

    LoRA adapters (a request whose `model` is an adapter):

    adapter_weight (>= 0; default 1.0)
        Weight of what a replica without the adapter in its slots costs: its load time (the
        replica's `lora_load_ms`, part of this request's predicted time to first token),
        half an answer's decode there more when every slot's adapter is in use (it waits
        for one to go idle), and the eviction of the adapter it would push out, priced at a
        load times the chance that adapter's next request finds no other copy (by its share
        of the fleet's latest adapter requests, sure at 5 %, over the replicas holding it:
        balancer/routing/adapters.py), the stall the load puts on
        the replica's decoding sequences (weighed by `prefill_stall_weight`), the load's
        time as the fleet's work (`fleet_weight` · β: in overload everyone queued there
        waits it out; at 40 requests/s on 8 replicas, Zipf 1.0, without it kvlb loaded
        wherever a queue was shorter and its TTFT p99 reached 25 s), and the
        prefill of the prompt where it is not cached (weighed by `fleet_weight`). Any
        request, on an adapter or not, also waits out the loads under way on a replica (L
        above). 0: blind to adapters and their loads.

    A time-to-first-token target (policies/ttft_target.py):

    ttft_target_weight (>= 0; default 0.0: off)
        While some candidate is predicted to meet a request's target, what each ms a
        candidate is predicted past it adds to its cost (10 in docs/routing.md's runs). Off
        by default: it raises the share of requests within their target at moderate load
        and costs end-to-end time where the fleet is saturated.
    ttft_target_ms (ms, >= 0; default 0: none)
        The target of requests that bring none of their own (a flow-control class's
        `ttft_slo_ms` or the `x-kvlb-ttft-slo-ms` header, which win).

    Locality, tiers and ties:

    same_region_penalty_ms (ms, >= 0; default 0.0), other_region_penalty_ms (ms, >=
    same_region_penalty_ms; default 95.0: a cross-region round trip),
    overflow_after_ms (ms, >= 0; default 1000.0), tie_tolerance_ms (ms, >= 0; default 3.0),
    tie_tolerance_ratio (fraction of the cost, 0..1; default 0.01).
    """

    name = "predictive"
    needs_prompt = True
    predicts_time = True

    def __init__(
        self,
        *,
        iteration_ms: float = 5.3,
        prefill_ms_per_token: float = 0.0191,
        attention_ms_per_token2: float = 7.4e-7,
        decode_ms_per_seq: float = DECODE_MS_PER_SEQ,
        decode_ms_per_context_token: float = DECODE_MS_PER_CONTEXT_TOKEN,
        decode_iteration_ms: float = DECODE_ITERATION_MS,
        chunk_tokens: float = 8192,
        decode_weight: float = 0.6,
        fleet_weight: float = 4.0,
        fleet_decode_weight: float = 0.0,
        prefill_stall_weight: float = 0.2,
        avoidable_stall_weight: float = 0.8,
        use_fitted_speed: bool = True,
        use_fitted_terms: bool = True,
        learn_batch_persistence: bool = True,
        speed_tolerance: float = 0.3,
        decode_speed_tolerance: float = 1.0,
        busy_reference_ms: float = BUSY_REFERENCE_MS,
        copy_horizon_s: float = 0.5,
        default_output_tokens: float = 256,
        max_output_tokens: float = 2048,
        same_region_penalty_ms: float = 0.0,
        other_region_penalty_ms: float = 95.0,
        overflow_after_ms: float = 1000.0,
        tie_tolerance_ms: float = 3.0,
        tie_tolerance_ratio: float = 0.01,
        adapter_weight: float = 1.0,
        ttft_target_ms: float = 0.0,
        ttft_target_weight: float = 0.0,
        seed: int | None = None,
        **params: Any,
    ) -> None:
        super().__init__(seed=seed, **params)
        self.iteration_ms = number_param("iteration_ms", iteration_ms, "ms")
        self.prefill_ms_per_token = number_param(
            "prefill_ms_per_token", prefill_ms_per_token, "ms per token", positive=True
        )
        self.attention_ms_per_token2 = number_param(
            "attention_ms_per_token2", attention_ms_per_token2, "ms per token squared"
        )
        self.decode_ms_per_seq = number_param("decode_ms_per_seq", decode_ms_per_seq, "ms per sequence")
        self.decode_ms_per_context_token = number_param(
            "decode_ms_per_context_token", decode_ms_per_context_token, "ms per context token"
        )
        self.decode_iteration_ms = number_param("decode_iteration_ms", decode_iteration_ms, "ms")
        self.chunk_tokens = number_param("chunk_tokens", chunk_tokens, "tokens", positive=True)
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 (tokens), got {chunk_tokens!r}")
        self.decode_weight = number_param("decode_weight", decode_weight, "weight")
        self.fleet_weight = number_param("fleet_weight", fleet_weight, "weight")
        self.fleet_decode_weight = number_param("fleet_decode_weight", fleet_decode_weight, "weight")
        self.prefill_stall_weight = number_param("prefill_stall_weight", prefill_stall_weight, "weight")
        self.avoidable_stall_weight = number_param("avoidable_stall_weight", avoidable_stall_weight, "weight")
        if not isinstance(use_fitted_speed, bool):
            raise ValueError(f"use_fitted_speed must be true or false, got {use_fitted_speed!r}")
        self.use_fitted_speed = use_fitted_speed
        if not isinstance(use_fitted_terms, bool):
            raise ValueError(f"use_fitted_terms must be true or false, got {use_fitted_terms!r}")
        self.use_fitted_terms = use_fitted_terms and use_fitted_speed
        if not isinstance(learn_batch_persistence, bool):
            raise ValueError(f"learn_batch_persistence must be true or false, got {learn_batch_persistence!r}")
        self.learn_batch_persistence = learn_batch_persistence
        self.speed_tolerance = number_param("speed_tolerance", speed_tolerance, "fraction")
        self._speed_band = 1.0 + self.speed_tolerance
        self.decode_speed_tolerance = number_param("decode_speed_tolerance", decode_speed_tolerance, "fraction")
        self._decode_speed_band = 1.0 + self.decode_speed_tolerance
        self.busy_reference_ms = number_param(
            "busy_reference_ms", busy_reference_ms, "ms", positive=True
        )
        self.copy_horizon_s = number_param("copy_horizon_s", copy_horizon_s, "s")
        self.default_output_tokens = number_param("default_output_tokens", default_output_tokens, "tokens")
        self.max_output_tokens = number_param("max_output_tokens", max_output_tokens, "tokens", positive=True)
        self.same_region_penalty_ms, self.other_region_penalty_ms = region_penalties(
            "ms", same_region_penalty_ms, other_region_penalty_ms, "ms"
        )
        self.overflow_after_ms = number_param("overflow_after_ms", overflow_after_ms, "ms")
        self.tie_tolerance_ms = number_param("tie_tolerance_ms", tie_tolerance_ms, "ms")
        self.tie_tolerance_ratio = fraction_param("tie_tolerance_ratio", tie_tolerance_ratio, "fraction of the cost")
        self.adapter_weight = number_param("adapter_weight", adapter_weight, "weight")
        self.ttft_target_ms = number_param("ttft_target_ms", ttft_target_ms, "ms")
        self.ttft_target_weight = number_param("ttft_target_weight", ttft_target_weight, "weight")

    def expected_output(self, request: RequestFeatures) -> float:
        wanted = request.max_tokens
        bound = self.max_output_tokens if wanted is None or wanted < 0 else min(float(wanted), self.max_output_tokens)
        learned = request.expected_output_tokens
        if learned is not None:
            return min(learned, bound)
        return self.default_output_tokens if wanted is None or wanted < 0 else bound

    def _relative_speeds(self, fits: list[float], band: float) -> list[float] | None:
        """Each replica's fitted multiplier over the candidates' median, 1.0 inside the
        tolerance; None when every one is inside it.

        Relative, because the ranking needs only who is slower than whom: an error common
        to the whole fleet (a profile a little off, a network in front) cancels. The
        tolerance keeps replicas of one kind equal: their fits differ by the noise of the
        loads each happened to see, and ranking on that noise would cost cache hits."""
        median = statistics.median(fits)
        low, high = median / band, median * band
        if min(fits) >= low and max(fits) <= high:
            return None
        return [1.0 if low <= f <= high else f / median for f in fits]

    def decode_iteration(self) -> tuple[float, float, float]:
        return self.decode_iteration_ms, self.decode_ms_per_seq, self.decode_ms_per_context_token

    def relative_decode_speeds(self, replicas: Sequence[ReplicaView],
                               reference: tuple[float, ...] | None = None) -> list[float] | None:
        """`reference`: the shares of a decode iteration's terms (MODEL_ITL_PARTS, summing
        to 1) to weigh each replica's fitted decode terms by; None: the multiplier alone."""
        if not self.use_fitted_speed or not replicas:
            return None
        fits = _trusted_fits([r.itl_scale for r in replicas], [r.itl_samples for r in replicas])
        if reference is not None and self.use_fitted_terms:
            shapes = [r.itl_terms for r in replicas]
            if None not in shapes:
                # Each multiplier (the level, stalls included) times its decode terms' shape
                # at this iteration's mix: a card that reads context faster than it iterates
                # is priced so where the batch's context is what an iteration spends on.
                z0, z1 = reference
                fits = [f * (t[0] * z0 + t[1] * z1) for f, t in zip(fits, shapes, strict=True)]
        return self._relative_speeds(fits, self._decode_speed_band) if min(fits) != max(fits) else None

    def _copy_share(self, rate: float, holders: int) -> float:
        """σ: the share of a copy's prefill that the requests after it will use, for a prefix
        met `rate` times a second and held by `holders` candidates."""
        later = rate * self.copy_horizon_s / (holders + 1)
        return later / (1.0 + later)

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        prompt = request.prompt_tokens
        if prompt < 0:
            prompt = 0
        cached_of = request.cached_tokens.get
        origin = request.origin_region
        a = self.iteration_ms
        b = self.prefill_ms_per_token
        k = self.attention_ms_per_token2
        d1 = self.decode_ms_per_seq
        d2 = self.decode_ms_per_context_token
        inv_chunk = 1.0 / self.chunk_tokens
        n = self.expected_output(request)
        # What one more sequence of this request's length adds to each iteration it shares.
        own_context = d2 * (prompt + n / 2)  # what this sequence's context adds to an iteration
        per_seq_added = d1 + own_context
        own_decode = self.decode_iteration_ms + per_seq_added
        decode_w = self.decode_weight
        fleet_decode_w = self.fleet_decode_weight
        same_pen = self.same_region_penalty_ms
        other_pen = self.other_region_penalty_ms
        tol_abs = self.tie_tolerance_ms
        tol_rel = self.tie_tolerance_ratio
        rand = self.rng.random
        fitted = self.use_fitted_speed
        adapter = request.adapter if self.adapter_weight > 0 else None
        adapter_w = self.adapter_weight
        sees_loads = adapter_w > 0  # blind to adapters is blind to their loads too

        fits = _trusted_fits([r.ttft_scale for r in replicas], [r.ttft_samples for r in replicas])
        scales = self._relative_speeds(fits, self._speed_band) if fitted and min(fits) != max(fits) else None
        shaped = self.use_fitted_terms
        shapes = [r.ttft_terms for r in replicas] if shaped else None
        if shapes is not None and shapes.count(None) == len(shapes):
            shapes = None
        # The decode, an iteration beside the candidates' average batch.
        reference = None
        if shaped and all(r.itl_terms is not None for r in replicas):
            iteration = self.decode_iteration_ms + d1 * (1 + sum(r.decoding for r in replicas) / len(replicas))
            context = own_context + d2 * sum(r.context_tokens for r in replicas) / len(replicas)
            reference = (iteration / (iteration + context), context / (iteration + context))
        decode_scales = self.relative_decode_speeds(replicas, reference)
        # β from the shortest backlog: some idle replica means the fleet is not saturated.
        shortest = math.inf
        for j, r in enumerate(replicas):
            backlog = r.prefill_tokens_queued * b * (scales[j] if scales else 1.0) / r.weight
            if sees_loads:
                backlog += r.adapter_slots.loading_ms
            if backlog < shortest:
                shortest = backlog
        busy = saturation(shortest, self.busy_reference_ms)
        fleet_w = self.fleet_weight * busy
        # The batch a request joins matters to its own tokens while the fleet has room; once
        # every replica is queueing, GPU time spent on prefill is what everyone waits for.
        # What a batch costs (its own decode, a prefill's stall, a copy's thinning) fades alike.
        light = (1.0 - busy) ** 2
        if shapes is not None and None not in shapes:
            # Every candidate's terms predict it well: each is ranked on its speed at this
            # request's own prefill, whole and alone, its terms weighed by that prefill's (the
            # iterations, the tokens, their attention). Only where all have earned it: a fit
            # in the replicas' own milliseconds beside a multiplier on the profile's would set
            # replicas of one kind apart by how each happened to be fitted (on the shared
            # trace at 4x, where terms are trusted only in lulls, that mix cost 2.6 s of TTFT
            # p99 on seed 0).
            whole = ((1.5 + prompt * inv_chunk) * a, prompt * b, k * prompt * prompt * 0.5)
            total = whole[0] + whole[1] + whole[2]
            z0, z1, z2 = whole[0] / total, whole[1] / total, whole[2] / total
            fits_ranked = [t[0] * z0 + t[1] * z1 + t[2] * z2 for t in shapes]
            scales = (self._relative_speeds(fits_ranked, self._speed_band)
                      if min(fits_ranked) != max(fits_ranked) else None)
        decode_w *= light
        # The batch the answer will decode beside: the mean's, plus the share of each
        # candidate's difference from it that persists over an answer.
        persistence = request.batch_persistence if self.learn_batch_persistence else None
        mean_batch = mean_decoding = 0.0
        if persistence is not None and persistence < 1.0 and replicas:
            for r in replicas:
                mean_batch += (r.decoding * d1 + r.context_tokens * d2) / r.weight
                mean_decoding += r.decoding
            mean_batch /= len(replicas)
            mean_decoding /= len(replicas)
        else:
            persistence = 1.0
        stall_w = self.prefill_stall_weight * light
        avoid_w = self.avoidable_stall_weight * light
        # The most of the prompt any candidate holds (C), how many hold that much (h) and the
        # prefill on top of it (P_C, also the least any candidate needs, P_min), where a copy
        # credit or the avoidable stall asks for them.
        copy_share = beyond_ms = 0.0
        deepest = holders = 0
        copies = request.prefix_rate > 0.0 and self.copy_horizon_s > 0.0
        if copies or avoid_w > 0.0:
            for r in replicas:
                have = min(max(cached_of(r.name, 0), 0), prompt)
                if have > deepest:
                    deepest, holders = have, 1
                elif have == deepest:
                    holders += 1
            rest = prompt - deepest
            beyond_ms = rest * b + k * rest * (deepest + rest * 0.5)
            if copies and deepest > 0:
                copy_share = self._copy_share(request.prefix_rate, holders)
        e = self.decode_iteration_ms
        # How much of a would-be copy's batch counts as it stands: the share of its holders'
        # batches that the prefix's own requests make up (its rate over one answer's decode,
        # per holder, against the candidates' mean batch), all of it from COPY_MOVES_BATCH.
        moved = 0.0
        if copy_share > 0.0 and persistence < 1.0:
            own_sequences = request.prefix_rate * n * own_decode * 1e-3 / holders
            moved = min(1.0, own_sequences / (COPY_MOVES_BATCH * mean_decoding)) if mean_decoding > 0 else 1.0
        copy_share *= light

        choices: list[Choice] = []
        keys: list[float] = []
        overflow: list[int] = []
        best_committed_wait = math.inf
        i = 0
        for r in replicas:
            cached = cached_of(r.name, 0)
            if cached > prompt:
                cached = prompt
            elif cached < 0:
                cached = 0
            uncached = prompt - cached
            queued = r.prefill_tokens_queued
            decoding = r.decoding
            speed = scales[i] if scales else 1.0
            decode_speed = decode_scales[i] if decode_scales else 1.0
            inv_w = 1.0 / r.weight
            batch = decoding * d1 + r.context_tokens * d2
            tokens_ms = uncached * b
            attention_ms = k * uncached * (cached + uncached * 0.5)
            waited_ms = (1.5 + (queued + uncached) * inv_chunk) * (a + batch) * inv_w
            queue_ms = (queued * b + tokens_ms) * inv_w
            model_ttft = waited_ms + queue_ms + attention_ms * inv_w
            itl_iteration = (e + d1 * (decoding + 1)) * inv_w
            itl_context = (own_context + r.context_tokens * d2) * inv_w
            own_prefill = tokens_ms + attention_ms
            # The prediction in the replica's own milliseconds: its fitted terms, where they
            # have earned trust.
            terms = shapes[i] if shapes is not None else None
            if terms is not None:
                # Its fitted terms are its own milliseconds: no multiplier on top.
                s_wait, s_token, s_attention = terms
                shaped_ttft = s_wait * waited_ms + s_token * queue_ms + s_attention * attention_ms * inv_w
                level = 1.0
            else:
                shaped_ttft = model_ttft
                level = fits[i]
            if sees_loads:
                model_ttft += r.adapter_slots.loading_ms
                shaped_ttft += r.adapter_slots.loading_ms
            adapter_ms = evict_ms = 0.0
            if adapter is not None:
                slots = r.adapter_slots
                if not slots.holds(adapter):
                    adapter_ms = slots.load_ms
                    # The load stalls the iteration: every sequence decoding there waits it
                    # out, weighed as a prefill's stall is. And an adapter loaded where its
                    # prompts are not cached costs their prefill too, priced as the fleet's
                    # work at its full weight, whatever the load: without it, reloads scatter
                    # an adapter's prompts over every replica it passes through.
                    evict_ms = (stall_w * slots.load_ms * decoding + fleet_w * slots.load_ms
                                + self.fleet_weight * own_prefill * speed * inv_w)
                    victim = slots.victim()
                    if victim is not None:
                        if slots.all_busy():
                            adapter_ms += 0.5 * n * (own_decode + batch) * inv_w
                        evict_ms += slots.load_ms * slots.eviction_cost(victim)
                    model_ttft += adapter_w * adapter_ms
                    shaped_ttft += adapter_w * adapter_ms
            ttft = shaped_ttft * level
            held = persistence + moved * (1.0 - persistence) if cached < deepest else persistence
            if held == 1.0:
                beside = batch
            else:
                beside = mean_batch * r.weight + held * (batch - mean_batch * r.weight)
            decode = (decode_w * n * (beside * decode_speed + own_decode * (decode_speed - 1.0))
                      + (stall_w * own_prefill + avoid_w * (own_prefill - beyond_ms)) * speed * decoding) * inv_w
            fleet = (own_prefill * speed + fleet_decode_w * n * decoding * per_seq_added * decode_speed) * inv_w * fleet_w
            labels = r.labels
            near = 0.0 if origin is None else locality(labels, origin, same_pen, other_pen)
            copy = copy_share * (own_prefill - beyond_ms) * speed * inv_w if cached < deepest else 0.0
            cost = model_ttft * speed + decode + fleet + near + adapter_w * evict_ms - copy
            choices.append(
                Choice(
                    r,
                    {
                        "cached": cached + 0.0,
                        "output_tokens": n,
                        TTFT_TERM: ttft,
                        MODEL_TTFT_TERM: model_ttft,
                        MODEL_ITL_TERM: (own_decode + batch) * inv_w,
                        "decode_ms": decode,
                        "fleet_ms": fleet,
                        "copy_credit_ms": copy,
                        "locality_ms": near,
                        "adapter_ms": adapter_ms,
                        "evict_ms": evict_ms,
                        "busy": busy,
                        "persistence": held,
                        "speed": speed,
                        "decode_speed": decode_speed,
                        "cost": cost,
                        "wait_ms": ttft,
                        "tier": 0.0,
                    },
                    (waited_ms, queue_ms, attention_ms * inv_w, itl_iteration, itl_context),
                )
            )
            if adapter_ms:
                choices[-1].terms[LOAD_TERM] = adapter_w * r.adapter_slots.load_ms * speed
            keys.append(cost + rand() * (tol_abs + tol_rel * cost))
            if labels.get("tier") == OVERFLOW_TIER:
                overflow.append(i)
            elif ttft < best_committed_wait:
                best_committed_wait = ttft
            i += 1
        target = request.ttft_target_ms if request.ttft_target_ms is not None else self.ttft_target_ms
        if target:
            steer_to_target(choices, keys, target, self.ttft_target_weight)
        return rank_with_tiers(choices, keys, overflow, best_committed_wait, self.overflow_after_ms)


# The share of its holders' batches a prefix's own requests must make up for a copy of it
# to count as moving them: then spreading it thins every batch, which no one answer's
# persistence measures, and a replica that would copy it keeps its batch as it stands. At 1
# (the whole batch), one 8k system prompt at 12 requests/s on 8 replicas stopped at 6 of them
# and its TTFT p50 was 15.5 ms against random's 14.8; at 0.5 it spreads to all 8 (15.0 ms).
COPY_MOVES_BATCH = 0.5

# A fit of n answers counts for n / (n + FIT_CONFIDENCE) of its distance from the fleet's
# median; from TRUSTED_SAMPLES answers on, for all of it.
FIT_CONFIDENCE = 2
TRUSTED_SAMPLES = 16


def _trusted_fits(fits: list[float], samples: list[int]) -> list[float]:
    """Each replica's fit, drawn toward the median of the fitted ones by how little has
    taught it; a replica nothing has taught yet counts as that median.

    The fit decides the traffic that teaches it, so trusting a young fit feeds back on
    itself: a replica that answered one request slowly by chance would get no more and
    stay slow on paper, and one fitted alone (at a tenth of its profile, say, on replicas
    sped up for a test) would look ten times faster than replicas not yet measured and keep
    every request (199 of 200 in `make demo`). Drawn in, one unlucky answer stays inside
    `speed_tolerance`, while a replica five times slower is out of it from its second."""
    if min(samples) >= TRUSTED_SAMPLES:
        return fits
    known = [f for f, n in zip(fits, samples, strict=True) if n]
    if not known:
        # Nothing trusted (a fleet not yet taught, or whose fits have all faded): all alike.
        return [statistics.median(fits)] * len(fits)
    median = statistics.median(known)
    trusted = []
    for f, n in zip(fits, samples, strict=True):
        if n >= TRUSTED_SAMPLES:
            trusted.append(f)
        elif n == 0:
            trusted.append(median)
        else:
            trusted.append(median * (f / median) ** (n / (n + FIT_CONFIDENCE)))
    return trusted
