"""The limit beside the result: each request's TTFT on an ideal fleet.

Ideal means an idle replica of the fleet's profile whose cache holds every prompt the
workload sent before this one, without bound. Such a replica computes only the tokens beyond
the longest prefix seen earlier anywhere. No router can beat that figure. How far a policy's
TTFT sits above it shows how much is left to win, and whether the loss is in queueing or in
prefill.

Computed with the simulated replica's own engine model (`loadtest.replica.engine`): one engine
with an unbounded cache, fed the workload in arrival order, one request at a time, each
asking for one token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loadtest.client.workloads import ROUTE_CHAT, WorkRequest
from loadtest.replica.engine import ContextLengthError, Engine, EngineConfig
from loadtest.replica.parsing import ApiError, parse_chat, parse_completion
from loadtest.replica.profiles import Profile
from loadtest.simulator.fleetspec import FleetPlan

# Room for every distinct block of a long trace: the ideal cache never evicts.
UNBOUNDED_TOKENS = 1 << 40


def ideal_ttfts(requests: Iterable[WorkRequest], profile: Profile, model: str, *,
                block_size: int = 16, max_batched_tokens: int = 8192,
                context_limit: int = 131072) -> dict[int, float]:
    """Per request index, its TTFT in seconds on the ideal replica; requests the replica
    would refuse (too long, malformed) are left out."""
    engine = Engine(EngineConfig(
        profile=profile, kv_capacity_tokens=UNBOUNDED_TOKENS, block_size=block_size,
        max_batched_tokens=max_batched_tokens, context_limit=context_limit,
    ))
    ideal: dict[int, float] = {}
    now = 0.0
    for request in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        payload = request.payload(model, stream=True)
        try:
            parsed = (parse_chat if request.route == ROUTE_CHAT else parse_completion)(payload)
            seq = engine.submit(parsed.tokens, 1, now, request_id=str(request.index))
        except (ApiError, ContextLengthError):
            continue
        started = now
        while seq.first_token_time is None:
            iteration = engine.step(now)
            assert iteration is not None, "a submitted request always runs on an idle engine"
            now = iteration.end
        ideal[request.index] = seq.first_token_time - started
    return ideal


def fleet_ideal_ttfts(requests: Sequence[WorkRequest], fleet: FleetPlan, model: str) -> dict[int, float]:
    """The ideal on the fastest profile among the replicas serving each request's model (a
    request or replica that names none: `model`), so it bounds every replica that could serve
    it. Each model's requests are an ideal replica's of their own: models share no cache."""
    by_model: dict[str, list[WorkRequest]] = {}
    for request in requests:
        by_model.setdefault(request.model or model, []).append(request)
    best: dict[int, float] = {}
    for name, theirs in by_model.items():
        seen: set[str] = set()
        for plan in fleet.replicas:
            if (plan.model or model) != name or plan.profile.name in seen:
                continue
            seen.add(plan.profile.name)
            found = ideal_ttfts(theirs, plan.profile, model, max_batched_tokens=plan.max_batched_tokens,
                                context_limit=plan.context_limit)
            for index, ttft in found.items():
                if index not in best or ttft < best[index]:
                    best[index] = ttft
    return best
