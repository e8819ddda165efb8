"""What a routing policy sees and returns.

A policy is pure: it ranks the replicas it is handed using only the request's features and
each replica's read-only view, with no I/O, no clock and no asyncio. The same policy object
therefore runs in the live proxy, in the offline simulator and in a unit test with a
hand-made fleet. Randomness comes from a `random.Random` the policy owns, seedable in tests.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable


class AdapterSlotsView(Protocol):
    """A replica's LoRA adapter slots as kvlb accounts for them; implemented by
    `balancer.routing.adapters.AdapterSlots`."""

    capacity: int  # adapters resident at once
    load_ms: float  # what loading one into a slot costs
    loading_ms: float  # loads under way there, which stall every request on it meanwhile

    def holds(self, adapter: str) -> bool: ...

    def victim(self) -> str | None:
        """What loading another adapter would evict; None while a slot is free."""
        ...

    def all_busy(self) -> bool:
        """Every slot's adapter has a request running: another adapter must wait."""
        ...

    def eviction_cost(self, adapter: str) -> float:
        """What evicting `adapter` from this replica costs, in loads (0 to 1): the chance
        its next request finds no other copy."""
        ...


@runtime_checkable
class ReplicaView(Protocol):
    """Read-only view of one replica, implemented by `balancer.routing.fleet.Replica`."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def in_flight(self) -> int:
        """Requests routed here and not yet finished, as counted by this balancer."""
        ...

    @property
    def prefill_tokens_queued(self) -> int:
        """Uncached prompt tokens routed here whose first token has not come back yet:
        prefill work the replica still has ahead of it."""
        ...

    @property
    def decoding(self) -> int:
        """Requests routed here that hold (or are about to hold) a slot in its decode batch:
        every unfinished one, since a non-streaming answer shows no first token before its
        last."""
        ...

    @property
    def context_tokens(self) -> int:
        """Prompt tokens of those decoding requests: the context their decode iterations
        attend to."""
        ...

    @property
    def ttft_scale(self) -> float:
        """Observed over predicted time to first token there, fitted online (1.0 until the
        replica has answered; see balancer/routing/latency.py)."""
        ...

    @property
    def ttft_samples(self) -> int:
        """How much has taught `ttft_scale`, in answers (0: nothing known of the replica
        yet); a change confirmed by a run of answers counts as full evidence."""
        ...

    @property
    def itl_samples(self) -> int:
        """The same for `itl_scale`."""
        ...

    @property
    def itl_scale(self) -> float:
        """Observed over predicted time between output tokens there, fitted online the same
        way from streamed answers' decode."""
        ...

    @property
    def ttft_terms(self) -> tuple[float, ...] | None:
        """Its fitted coefficient per term of the predicted time to first token, over the
        profile's, in the order of MODEL_TTFT_PARTS: in its own milliseconds, so in place of
        `ttft_scale`, not on top of it. None until the fitted terms predict its answers well
        (not where its answers carry waits no term explains, as in overload; see
        balancer/routing/term_fit.py)."""
        ...

    @property
    def itl_terms(self) -> tuple[float, ...] | None:
        """The shape of the replica's decode iteration against its profile's, in the order of
        MODEL_ITL_PARTS, each term over their geometric mean (the level is `itl_scale`'s);
        fitted with the stalls of prefills run meanwhile taken out. None likewise."""
        ...

    @property
    def adapter_slots(self) -> AdapterSlotsView:
        """Which LoRA adapters it holds in its GPU slots, by kvlb's account of what it
        routed there, and what loading another costs (balancer/routing/adapters.py)."""
        ...


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What routing may know of a request, parsed once by `balancer.routing.request`."""

    route: str
    model: str | None = None
    stream: bool = False
    # Affinity key: the `x-session-id` header, else the body's `user` field.
    session_key: str | None = None
    # Canonical prompt text; filled only for policies whose `needs_prompt` is true.
    prompt: str | Sequence[int] | None = None
    # Estimated prompt length in tokens, and per replica name the leading tokens of this
    # prompt the prefix index believes that replica holds in its KV cache (absent: none).
    # Filled only for policies whose `needs_prompt` is true.
    prompt_tokens: int = 0
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    # Region the request comes from (header or the balancer's own region), for locality.
    origin_region: str | None = None
    # The body's `max_tokens` (or `max_completion_tokens`): a bound on the output, if named.
    max_tokens: int | None = None
    # The mean output of earlier answers like this one that ended on their own (same model,
    # route and prompt length within a factor of two), if enough have ended
    # (balancer/routing/output_length.py). Filled only for policies whose `needs_prompt` is true.
    expected_output_tokens: float | None = None
    # The LoRA adapter it runs under (its `model` names one that replicas list as an
    # adapter), or None for a base model. Its prefix blocks are keyed by it.
    adapter: str | None = None
    # Requests per second that lately met the same longest cached prefix as this one (the
    # deepest block any replica holds of it): the traffic a copy of that prefix would serve.
    prefix_rate: float = 0.0
    # How much of a replica's decode batch now its answer will still decode beside, 0 to 1,
    # as the answers so far on its model's fleet showed (balancer/routing/batch_persistence.py);
    # None until enough have. Filled only for policies whose `needs_prompt` is true.
    batch_persistence: float | None = None
    # Its time-to-first-token target in ms (its flow-control class's, or the header's), for
    # policies that predict time; None where it has none.
    ttft_target_ms: float | None = None


# The calibrated decode iteration (docs/calibration.md, llama-3.1-8b on an H100), in ms: the
# fixed cost of a decode-only iteration, and what each sequence and each context token of
# the batch add.
DECODE_ITERATION_MS = 8.3
DECODE_MS_PER_SEQ = 0.009
DECODE_MS_PER_CONTEXT_TOKEN = 4.39e-5

# The term in which a policy that predicts time puts its predicted time to first token (ms,
# before any fitted speed): the routing core compares it with the observed time to fit each
# replica's speed (balancer/routing/latency.py).
MODEL_TTFT_TERM = "model_ttft_ms"
# Likewise its predicted time per output token there, which fits each replica's decode speed.
MODEL_ITL_TERM = "model_itl_ms"
# The terms that MODEL_TTFT_TERM and MODEL_ITL_TERM add up (an adapter's load aside), each
# before any fit, in the order of a Choice's `parts`: the routing core fits a coefficient per
# term (balancer/routing/term_fit.py). Time to first token: the engine iterations it waits
# through, the prompt tokens ahead of and in it, their attention. Time per output token: the
# iteration, the context it reads.
MODEL_TTFT_PARTS = ("iteration", "token", "attention")
MODEL_ITL_PARTS = ("iteration", "context")
# Its predicted time to first token there in this fleet's own milliseconds (the fitted speed
# applied): what flow control adds to a queued request's wait to judge its target.
TTFT_TERM = "ttft_ms"
# On a replica where the policy priced loading the request's LoRA adapter into a slot: what
# one such load adds to `cost`, in the cost's own units. The adapter loader counts it once
# more on a replica that must unload another adapter first (that adapter's next request
# loads it again).
LOAD_TERM = "load_cost"


# Not frozen: one is built per replica per request, and frozen dataclasses cost 3x to create.
@dataclass(slots=True)
class Choice:
    """One ranked replica with the terms that put it there (for logs and headers), and, from
    a policy that predicts time, the terms its two predictions add up (`parts`: the
    MODEL_TTFT_PARTS, then the MODEL_ITL_PARTS; kept apart from `terms`, which every
    decision fills for every replica, since only the chosen one's are read)."""

    replica: ReplicaView
    terms: Mapping[str, float] = field(default_factory=dict)
    parts: tuple[float, ...] = ()


class Policy:
    """Base class: subclasses set `name` and implement `rank`."""

    name: ClassVar[str] = ""
    needs_prompt: ClassVar[bool] = False
    # Whether its choices carry TTFT_TERM: a prediction of time, not only an order.
    predicts_time: ClassVar[bool] = False

    def __init__(self, *, seed: int | None = None, **params: Any) -> None:
        if params:
            unknown = ", ".join(sorted(params))
            raise ValueError(f"unknown parameter(s) for policy {self.name!r}: {unknown}")
        self.rng = random.Random(seed)

    def rank(self, request: RequestFeatures, replicas: Sequence[ReplicaView]) -> list[Choice]:
        """Every replica in `replicas`, each once, most preferred first.

        `replicas` holds only eligible replicas (healthy, serving the model, below their
        concurrency cap, except when flow control asks a policy that `predicts_time` for a
        waiting request's prediction) and is never empty. Failover takes the next entry, so
        the whole order matters, not just the head.
        """
        raise NotImplementedError

    def decode_iteration(self) -> tuple[float, float, float]:
        """What a decode iteration of this policy's model costs: fixed ms, ms per sequence
        and ms per context token of the batch (llama-3.1-8b on an H100, docs/calibration.md,
        unless the policy is told its model's), for a choice made outside `rank`."""
        return DECODE_ITERATION_MS, DECODE_MS_PER_SEQ, DECODE_MS_PER_CONTEXT_TOKEN

    def relative_decode_speeds(self, replicas: Sequence[ReplicaView]) -> list[float] | None:
        """Each replica's fitted decode speed over the others' (1.0: as fast as most), for a
        choice made outside `rank` (a disaggregated request's decode replica); None where
        the policy does not rank on fitted speeds or all are alike."""
        return None
