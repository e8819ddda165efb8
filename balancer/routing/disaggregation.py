"""Prefill/decode disaggregation: which pair of replicas serves a request, or whether one does.

A fleet whose replicas carry roles (`role: prefill`, `role: decode`, or `both`) splits a
request in two: a prefill replica computes the prompt's KV cache and hands it to a decode
replica, which streams the answer. The prefill replica is chosen as any request's replica
is, by the model's policy over the prefill pool (its cache hits, its queue: the prefix index
belongs to the prefill pool). The decode replica is chosen here, by what the request will
cost there: the transfer over the link from the chosen prefill replica (closer is faster:
same `host` label, then same `zone`), and the decode iterations it shares with the batch
already decoding there, for its expected output, at that replica's fitted decode speed (the
policy's `relative_decode_speeds`: a streamed answer's time per token after the first fits
it, decode halves included); a replica whose KV memory cannot hold the prompt beside what it
decodes comes last.

Splitting is not always worth it. A prompt mostly cached on the best prefill replica (or a
short one) costs less to prefill where it will decode than to transfer; a pool with nothing
routable leaves no pair; a saturated prefill pool queues longer than a replica that can
serve the request alone would take (with a policy that predicts time: the best prefill
replica's predicted time to first token plus the transfer, `saturated_ratio` times the best
such replica's or more). Then the request runs whole on one replica that can serve it alone
(`both`; with vLLM's protocol any replica, as vLLM's kv_both engines serve plain requests
whatever half kvlb gives them), and each outcome is counted. Sans I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from balancer.config import DisaggregationSettings
from balancer.errors import ClientError
from balancer.routing.core import DEFAULT_OUTPUT_TOKENS, Journey, RoutingCore
from balancer.routing.fleet import Replica
from policies.base import (
    DECODE_ITERATION_MS,
    DECODE_MS_PER_CONTEXT_TOKEN,
    DECODE_MS_PER_SEQ,
    MODEL_ITL_TERM,
    TTFT_TERM,
    Choice,
    RequestFeatures,
)

PREFILL, DECODE, BOTH = "prefill", "decode", "both"

# What a decode replica without room for the prompt's KV costs on top: it would queue or
# preempt, for an unknown time.
NO_ROOM_MS = 1e6

# Outcomes, for the metric kvlb_disaggregation_total{outcome}.
SPLIT = "disaggregated"
COLOCATED_CACHED = "colocated_cached"  # too little uncached prompt to be worth a transfer
COLOCATED_NO_PAIR = "colocated_no_pair"  # one pool had nothing routable
COLOCATED_FASTER = "colocated_faster"  # a replica serving it alone is predicted to answer sooner


@dataclass(frozen=True, slots=True)
class Pools:
    prefill: list[Replica]
    decode: list[Replica]
    # Replicas that can serve a request alone.
    whole: list[Replica]

    @property
    def split(self) -> bool:
        return bool(self.prefill) and bool(self.decode)


def has_roles(replicas: Sequence[Replica]) -> bool:
    return any(r.settings.role != BOTH for r in replicas)


def pools(candidates: Sequence[Replica], protocol: str) -> Pools:
    prefill = [r for r in candidates if r.settings.role == PREFILL]
    decode = [r for r in candidates if r.settings.role == DECODE]
    whole = [r for r in candidates if r.settings.role == BOTH] if protocol == "sglang" else list(candidates)
    return Pools(prefill, decode, whole)


def colocate(pools_: Pools, prompt_tokens: int, best_cached: float, settings: DisaggregationSettings) -> str | None:
    """The reason to run the request on one replica, or None to split it."""
    if not pools_.split:
        return COLOCATED_NO_PAIR
    if pools_.whole and prompt_tokens - best_cached < settings.colocate_below_tokens:
        return COLOCATED_CACHED
    return None


def link_gbps(a: Replica, b: Replica, settings: DisaggregationSettings) -> float:
    host_a, host_b = a.labels.get("host"), b.labels.get("host")
    if host_a is not None and host_a == host_b:
        return settings.same_host_gbps
    zone_a, zone_b = a.labels.get("zone"), b.labels.get("zone")
    if zone_a is not None and zone_a == zone_b:
        return settings.same_zone_gbps
    return settings.other_gbps


def transfer_ms(prompt_tokens: int, gbps: float, settings: DisaggregationSettings) -> float:
    return prompt_tokens * settings.kv_bytes_per_token * 8 / (gbps * 1e6)


def rank_decode(
    decode: Sequence[Replica],
    prefill: Replica,
    prompt_tokens: int,
    output_tokens: float,
    settings: DisaggregationSettings,
    jitter: Sequence[float],
    speeds: Sequence[float] | None = None,
    iteration: tuple[float, float, float] = (DECODE_ITERATION_MS, DECODE_MS_PER_SEQ, DECODE_MS_PER_CONTEXT_TOKEN),
) -> list[Choice]:
    """The decode pool, cheapest first, each with the terms that put it there. `jitter`, one
    number in [0, 1) per replica, breaks ties between equal replicas at random; `speeds`, one
    per replica, how many times slower than the others it decodes (None: all alike);
    `iteration`, the model's decode iteration (`Policy.decode_iteration`)."""
    fixed_ms, per_seq_ms, per_context_ms = iteration
    keyed = []
    for i, r in enumerate(decode):
        moved = transfer_ms(prompt_tokens, link_gbps(prefill, r, settings), settings)
        seqs, context = r.decoding, r.context_tokens
        # Its own tokens in that batch, and the slowdown it adds to every sequence beside it.
        per_token = (fixed_ms + per_seq_ms * (seqs + 1)
                     + per_context_ms * (context + prompt_tokens + output_tokens / 2)) / r.weight
        added = seqs * (per_seq_ms + per_context_ms * (prompt_tokens + output_tokens / 2))
        speed = speeds[i] if speeds is not None else 1.0
        decode_ms = output_tokens * (per_token + added / r.weight) * speed
        capacity = r.kv_capacity_tokens
        room = 0.0 if capacity is None or context + prompt_tokens + output_tokens <= capacity else NO_ROOM_MS
        cost = moved + decode_ms + room
        # The profile's time per token, which the answer's own gaps fit the replica's speed to.
        terms = {"transfer_ms": moved, "decode_ms": decode_ms, "decoding": float(seqs), "cost": cost,
                 MODEL_ITL_TERM: per_token}
        if speed != 1.0:
            terms["decode_speed"] = speed
        keyed.append((cost * (1.0 + 0.01 * jitter[i]), i, Choice(r, terms)))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [c for _, _, c in keyed]


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """What the core decided for a request to a fleet with roles: `journey` over the prefill
    pool and `decode` over the decode pool when split; `journey` over the replicas that can
    serve it whole, and `decode` None, when not. `outcome` names which, for the metric."""

    journey: Journey
    decode: Journey | None
    outcome: str


def plan_split(
    core: RoutingCore,
    route: str,
    features: RequestFeatures,
    prompt: str | Sequence[int] | None,
    candidates: Sequence[Replica],
    settings: DisaggregationSettings,
    origin_region: str | None = None,
) -> SplitPlan:
    """The pair, or one replica, for a request whose candidates carry roles; the same code
    in `kvlb serve` and the offline simulator. Raises ClientError when neither a pair nor a
    replica that serves alone is routable."""
    split = pools(candidates, settings.protocol)
    why = COLOCATED_NO_PAIR
    journey = None
    if split.split:
        journey = core.plan(route, features, prompt, split.prefill, origin_region)
        # The most any prefill replica holds, not the first choice's: the policy may rank
        # first a replica that would copy a sought-after prefix, and the prompt is no less
        # cached for that.
        best_cached = max((c.terms.get("cached", 0.0) for c in journey.ranking), default=0.0)
        why = colocate(split, journey.features.prompt_tokens, best_cached, settings)
    if why is not None:
        if not split.whole:
            raise ClientError(503, "no replica can serve this request: its model's prefill or decode "
                                   "replicas are all unavailable", "no_replica_pair", type_="upstream_error")
        return SplitPlan(core.plan(route, features, prompt, split.whole, origin_region), None, why)
    assert journey is not None
    planned = journey.features
    output = planned.expected_output_tokens
    if output is None:
        output = float(planned.max_tokens) if planned.max_tokens is not None else DEFAULT_OUTPUT_TOKENS
    policy = core.policy_for(features.model)
    rand = policy.rng.random
    best = journey.ranking[0]
    ranking = rank_decode(split.decode, best.replica, planned.prompt_tokens, output, settings,
                          [rand() for _ in split.decode], policy.relative_decode_speeds(split.decode),
                          policy.decode_iteration())
    prefill_ms = best.terms.get(TTFT_TERM)
    if split.whole and prefill_ms is not None:
        # A saturated prefill pool: where a replica that serves alone would give the first
        # token `saturated_ratio` times sooner than the prefill pool plus the transfer, the
        # request runs there. Not merely sooner: a whole run is always a transfer sooner on
        # an idle fleet, and what splitting buys is the decode batches its prefill spares.
        whole = core.plan(route, features, prompt, split.whole, origin_region)
        whole_ms = whole.ranking[0].terms.get(TTFT_TERM)
        split_ms = prefill_ms + ranking[0].terms["transfer_ms"]
        if whole_ms is not None and whole_ms * settings.saturated_ratio < split_ms:
            return SplitPlan(whole, None, COLOCATED_FASTER)
    return SplitPlan(journey, Journey(planned, ranking, None, max_attempts=journey.max_attempts), SPLIT)
