"""The routing core: one request's life at the balancer, decided without I/O or a clock.

The core decides; it never sends. Whoever drives it (the proxy with sockets and the event
loop's clock, the offline simulator with virtual time) calls it at each step of a request
and passes the time in:

    admission   try_enter / join / hand_over / withdraw on `core.admission`, or, with flow
                control, arrive / saturated / placed / done / expire on `core.flow`
                (routing/flow.py), each request priced by `flow_cost`
    candidates  `candidates(model, allowed regions, now)`: model, health, room, residency
    plan        `plan(route, features, prompt, candidates, origin region)`: the prediction
                (approximate or precise index), the features, the policy's ranking
    attempt     `next_attempt(journey, now)`: the next ranked replica, never one twice, at
                most `max_attempts`; the load the request puts on it is counted from here
    verdicts    `failed` (the replica's fault), `held_off` (it said when to come back),
                `answered` (an answer relayed, judged by success rate)
    first byte  `first_byte(journey, now)`: its prefill is done; a streamed answer's time
                to first byte, against the policy's prediction, fits the replica's speed
    usage       `learn(journey, prompt tokens, cached tokens)`: the replica's own figures
    output      `learned_output(journey, output tokens, now)`: the answer's length once it
                ended, and, streamed, its time per output token, which fits the replica's
                decode speed against the batch it decoded beside (`Replica.batch_at`)
                and, against the batch it was sent to, the batch's persistence
                (routing/batch_persistence.py) that `plan` hands the policy
    answer      `answered_text(journey, text)`: a whole answer's text (its first `answer_chars`
                characters), which the index records after the prompt on its replica
    finish      `end_attempt(journey, answered, now)`: the load leaves, the index keeps or
                forgets what the attempt recorded

Both drivers run exactly these steps, so a decision taken offline is the decision `kvlb
serve` takes on the same state. The core is the one writer of the load this instance puts on
a replica (`in_flight`, `prefill_tokens_queued`, `decoding`); other instances' share arrives
through `Replica.set_remote_load`.

Timers are the driver's: `call_at(when, callback)` is injected, and the core uses it for
one thing, forgetting a replica's cache and fitted speeds once it has been out (unhealthy
or ejected) for `routing.forget_unhealthy_after_s`, by when it has likely restarted empty.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from balancer.errors import ClientError
from balancer.routing.admission import AdmissionQueue
from balancer.routing.batch_persistence import BatchPersistences
from balancer.routing.breaker import CLOSED
from balancer.routing.fleet import Fleet, Replica
from balancer.routing.flow import FlowController
from balancer.routing.latency import LatencyFit
from balancer.routing.output_length import OutputLengths
from balancer.routing.request import answer_continuation
from balancer.routing.term_fit import ITL_RIDGE, TTFT_RIDGE, TermFit
from balancer.routing.tracker import CacheTracker, Lesson, Routed
from policies.base import (
    MODEL_ITL_PARTS,
    MODEL_ITL_TERM,
    MODEL_TTFT_PARTS,
    MODEL_TTFT_TERM,
    TTFT_TERM,
    Choice,
    Policy,
    RequestFeatures,
)

# Phases of one attempt on one replica.
IDLE, PREFILLING, DECODING = 0, 1, 2

# Without a learned ratio: what a chat body's bytes hold in tokens, roughly, and an answer
# with no max_tokens and no history, for flow control's token shares.
DEFAULT_TOKENS_PER_BYTE = 0.25
DEFAULT_OUTPUT_TOKENS = 256.0
# How often untaught speed fits fade (latency.FADE_AFTER_S): a walk over the fleet, so not
# per request.
FADE_CHECK_S = 1.0

# call_at(when, callback): run callback(now) once the driver's clock reaches `when`.
CallAt = Callable[[float, Callable[[float], None]], Any]


@dataclass(slots=True)
class Journey:
    """One request's routing state: its features and ranking, then the attempt under way."""

    features: RequestFeatures
    ranking: Sequence[Choice]
    routed: Routed | None = None  # the cache prediction, for policies that use one
    attempts: list[str] = field(default_factory=list)
    replica: Replica | None = None  # the attempt under way
    phase: int = IDLE
    uncached: int = 0  # prompt tokens the attempt's replica must compute, by the prediction
    probe: bool = False  # the attempt is its replica's half-open breaker probe
    context: int = 0  # the prompt tokens the attempt adds to its replica's decode context
    sent_at: float = 0.0  # when the attempt started, for the latency fit
    model_ttft_ms: float = 0.0  # the policy's predicted time to first token before the fit, if any
    model_itl_ms: float = 0.0  # and its predicted time per output token
    # Those two predictions' terms (the chosen Choice's `parts`, term_fit.py), where the
    # policy reports them.
    ttft_parts: tuple[float, ...] = ()
    itl_parts: tuple[float, ...] = ()
    first_byte_at: float | None = None  # when the attempt's answer started, for the decode fit
    # Its replica's `prefill_ms_started` then: the prefill started there since stalled its decode.
    stall_mark_ms: float = 0.0
    # Its replica's decode batch (sequences, their context tokens), this attempt's own
    # included, as `model_itl_ms` priced it; and that batch's area when its answer began.
    batch_sent: tuple[int, int] = (0, 0)
    batch_from: tuple[float, float, float] | None = None
    # The candidates' mean decode batch when it was sent, and its replica's less that mean
    # (ms per iteration, its own sequence left out), for the batch's persistence
    # (batch_persistence.py); None where the policy predicts no times.
    batch_mean_sent: float = 0.0
    batch_gap_sent: float | None = None
    batch_weight: float = 1.0  # how much the policy's decode term counted then
    # The attempt found its replica's prefill queue empty: its answer may confirm a change of
    # the replica's speed (latency.py).
    alone: bool = False
    # The LoRA adapter load (ms) the attempt made its replica do, until it answers.
    load_ms: float = 0.0
    max_attempts: int = 3
    _next: int = 0

    @property
    def reads_answer(self) -> bool:
        """Whether the drivers read its answer's token counts back: for the prefix index,
        or for a replica's fitted decode speed (a disaggregated request's decode half,
        routed by no index, still carries the profile's time per token)."""
        return self.routed is not None or self.model_itl_ms > 0


@dataclass(slots=True)
class CoreSettings:
    max_attempts: int = 3
    region: str | None = None  # the balancer's own, for requests that name none
    forget_unhealthy_after_s: float = 30.0


class RoutingCore:
    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        tracker: CacheTracker | None,
        admission: AdmissionQueue[Any],
        settings: CoreSettings,
        call_at: CallAt,
        flow: FlowController | None = None,
        model_policies: Mapping[str, Policy] | None = None,
        model_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.fleet = fleet
        # With flow control, it takes the admission line's place (routing/flow.py).
        self.flow = flow
        self.policy = policy
        # Models with a policy of their own (`per_model`); every other model gets `policy`.
        self.model_policies = dict(model_policies or {})
        self._models_need_prompt = any(p.needs_prompt for p in self.model_policies.values())
        # Models with a bound of their own on requests at once, and their requests now.
        self.model_limits = dict(model_limits or {})
        self._model_in_flight: dict[str, int] = {}
        self.tracker = tracker
        self.admission = admission
        self.settings = settings
        self._call_at = call_at
        self.output_lengths = OutputLengths()
        self.batch_persistence = BatchPersistences()
        self._faded_at = 0.0  # when the fits last faded (latency.py): at most once a second
        for replica in fleet.replicas:
            self.joined(replica)

    def model_entry(self, model: str | None, table: Mapping[str, Any]) -> str | None:
        """The `per_model` entry of `table` that `model` falls under: its own, else, for a
        LoRA adapter, its base model's, since it runs on that model's fleet."""
        if model is None or not table:
            return None
        if model in table:
            return model
        base = self.fleet.base_of(model)
        return base if base in table else None

    def policy_for(self, model: str | None) -> Policy:
        entry = self.model_entry(model, self.model_policies)
        return self.policy if entry is None else self.model_policies[entry]

    @property
    def needs_prompt(self) -> bool:
        """Whether requests must be parsed for their prompt: some model's policy reads it."""
        return self.policy.needs_prompt or self._models_need_prompt

    def enter_model(self, model: str | None) -> str | None:
        """A request for `model` begins; raises 429 when its entry (its own, or its base
        model's for an adapter) is at its bound. The entry it counts against, if any: the
        driver then calls `leave_model` with it."""
        model = self.model_entry(model, self.model_limits)
        if model is None:
            return None
        limit = self.model_limits[model]
        running = self._model_in_flight.get(model, 0)
        if running >= limit:
            raise ClientError(429, f"model {model!r} has its limit of {limit} requests at once in flight; retry shortly",
                              "model_at_capacity", type_="rate_limit_error", retry_after=1)
        self._model_in_flight[model] = running + 1
        return model

    def leave_model(self, model: str) -> None:
        left = self._model_in_flight.get(model, 0) - 1
        if left > 0:
            self._model_in_flight[model] = left
        else:
            self._model_in_flight.pop(model, None)

    # -- the fleet changes ---------------------------------------------------------------

    def joined(self, replica: Replica) -> None:
        if self.tracker is not None:
            self.tracker.index.set_capacity(replica.name, replica.kv_capacity_tokens)

    def capacity_reported(self, replica: Replica, tokens: int) -> None:
        """The replica's own KV capacity, where config gave none."""
        if self.tracker is not None and replica.kv_capacity_tokens is None:
            self.tracker.index.set_capacity(replica.name, tokens)

    def left(self, replica: Replica) -> None:
        if self.tracker is not None:
            self.tracker.forget(replica.name)

    def cache_flushed(self, replica: Replica) -> None:
        """The replica emptied its prefix cache on request: what kvlb believed it held goes.
        (Precise mode's exact index hears it from the engine's own events.)"""
        if self.tracker is not None:
            self.tracker.forget(replica.name)

    def went_out(self, replica: Replica, now: float) -> None:
        """`replica` failed its health checks or was ejected: if it is still out after a
        while, it has probably restarted, lost its cache, and may run elsewhere at another
        speed."""
        self._call_at(now + self.settings.forget_unhealthy_after_s, lambda later: self._forget_if_out(replica, later))

    def _forget_if_out(self, replica: Replica, now: float) -> None:
        if replica.healthy and replica.breaker.state(now) == CLOSED:
            return
        if self.tracker is not None:
            self.tracker.forget(replica.name)
        replica.latency = LatencyFit()
        replica.decode_latency = LatencyFit()
        replica.ttft_terms_fit = TermFit(TTFT_RIDGE)
        replica.itl_terms_fit = TermFit(ITL_RIDGE)
        replica.adapter_slots.forget()

    # -- one request ---------------------------------------------------------------------

    def candidates(self, model: str | None, allowed_regions: frozenset[str] | None, now: float) -> list[Replica]:
        """The replicas that may take the request, or the ClientError saying why none."""
        if now - self._faded_at >= FADE_CHECK_S:
            self._faded_at = now
            for replica in self.fleet.replicas:
                if replica.latency.fade(now):
                    replica.ttft_terms_fit.fade()
                if replica.decode_latency.fade(now):
                    replica.itl_terms_fit.fade()
        return self.fleet.candidates(model, allowed_regions, now)

    def flow_cost(self, features: RequestFeatures, body_bytes: int) -> float:
        """A request's tokens for fair sharing before it is planned: its prompt estimated
        from the body, plus the output expected of requests like it (at most `max_tokens`)."""
        ratio = self.tracker.ratio.of(features.model) if self.tracker is not None else DEFAULT_TOKENS_PER_BYTE
        prompt = body_bytes * ratio
        expected = self.output_lengths.expect(features.model, features.route, int(prompt))
        limit = features.max_tokens
        if expected is None:
            output = float(limit) if limit is not None else DEFAULT_OUTPUT_TOKENS
        else:
            output = min(expected, limit) if limit is not None else expected
        return prompt + output

    def predicted_ttft_s(self, route: str, features: RequestFeatures, prompt: str | Sequence[int] | None,
                         allowed_regions: frozenset[str] | None, now: float,
                         origin_region: str | None = None) -> float | None:
        """The policy's predicted time to first token on the replica it would choose now,
        room or not: for flow control, what a request that must wait adds to its wait. None
        when the policy predicts no times or nothing could serve the request."""
        policy = self.policy_for(features.model)
        if not policy.predicts_time:
            return None
        replicas = self.fleet.routable(features.model, allowed_regions, now)
        if not replicas:
            return None
        ranking = self.plan(route, features, prompt, replicas, origin_region).ranking
        ms = ranking[0].terms.get(TTFT_TERM) if ranking else None
        return None if ms is None else ms / 1000.0

    def plan(
        self,
        route: str,
        features: RequestFeatures,
        prompt: str | Sequence[int] | None,
        candidates: Sequence[Replica],
        origin_region: str | None = None,
    ) -> Journey:
        """Predict the prompt's cache hits, then rank `candidates` by the policy."""
        routed = None
        if self.tracker is not None and prompt is not None:
            adapter = self.fleet.adapter_of(features.model)
            routed = self.tracker.predict(prompt, features.model, adapter)
            features = RequestFeatures(
                route=route,
                model=features.model,
                stream=features.stream,
                session_key=features.session_key,
                prompt=prompt,
                prompt_tokens=routed.prompt_tokens,
                cached_tokens=routed.cached,
                origin_region=origin_region or self.settings.region,
                max_tokens=features.max_tokens,
                expected_output_tokens=self.output_lengths.expect(features.model, route, routed.prompt_tokens),
                adapter=adapter,
                prefix_rate=routed.prefix_rate,
                batch_persistence=self.batch_persistence.slope(self._persistence_key(features.model)),
                ttft_target_ms=features.ttft_target_ms,
            )
        ranking = self.policy_for(features.model).rank(features, candidates)
        return Journey(features, ranking, routed, max_attempts=self.settings.max_attempts)

    def next_attempt(self, journey: Journey, now: float) -> Replica | None:
        """The next replica to send the request to, or None when the ranking is spent."""
        assert journey.replica is None, "end_attempt first"
        turn = journey._next
        if turn >= journey.max_attempts or turn >= len(journey.ranking):
            return None
        choice = journey.ranking[turn]
        # Policies rank the fleet's own replicas, seen through their read-only view.
        replica = cast(Replica, choice.replica)
        journey._next = turn + 1
        journey.replica = replica
        journey.attempts.append(replica.name)
        journey.probe = replica.breaker.started(now)
        routed = journey.routed
        tracker = self.tracker
        uncached = 0
        if routed is not None and tracker is not None:
            uncached = tracker.uncached(routed, replica)
            tracker.start(routed, replica)
        journey.uncached = uncached
        journey.phase = PREFILLING
        journey.sent_at = now
        terms = choice.terms
        journey.model_ttft_ms = terms.get(MODEL_TTFT_TERM, 0.0)
        journey.model_itl_ms = terms.get(MODEL_ITL_TERM, 0.0)
        parts = choice.parts
        split = len(MODEL_TTFT_PARTS)
        if len(parts) == split + len(MODEL_ITL_PARTS):
            journey.ttft_parts, journey.itl_parts = parts[:split], parts[split:]
        else:
            journey.ttft_parts = journey.itl_parts = ()
        journey.first_byte_at = None
        queued = replica.prefill_tokens_queued
        journey.alone = queued == 0
        parts = journey.ttft_parts
        if parts and queued + uncached > 0:
            # This attempt's own prefill, by the prediction: the stall it will put on every
            # sequence decoding there (the token term also holds the queue ahead of it).
            replica.prefill_ms_started += parts[1] * uncached / (queued + uncached) + parts[2]
        context = journey.context = journey.features.prompt_tokens
        self._note_batch_sent(journey, replica, choice.terms)
        replica.batch_at(now)
        replica.context_tokens += context
        if journey.features.adapter is not None:
            load = journey.load_ms = replica.adapter_slots.started(journey.features.adapter)
            if load:
                replica.adapter_slots.load_began(load)
        replica.in_flight += 1
        replica.prefill_tokens_queued += uncached
        # It holds a batch slot from now on: a non-streaming answer's first byte is its last,
        # so waiting for it to count the request as decoding would miss its whole decode.
        replica.decoding += 1
        journey.batch_sent = (replica.decoding, replica.context_tokens)
        journey.batch_from = None
        return replica

    def first_byte(self, journey: Journey, now: float | None = None) -> float | None:
        """The replica has answered: its prefill is done. Later calls change nothing.

        With `now`, a streamed answer's time to first byte also teaches the replica's
        latency fit; returns the prediction's error (observed over predicted) when it did."""
        replica = journey.replica
        if replica is None or journey.phase != PREFILLING:
            return None
        replica.prefill_tokens_queued -= journey.uncached
        if journey.load_ms:
            replica.adapter_slots.load_over(journey.load_ms)
            journey.load_ms = 0.0
        journey.phase = DECODING
        journey.first_byte_at = now
        journey.batch_from = replica.batch_at(now)
        journey.stall_mark_ms = replica.prefill_ms_started
        tracker = self.tracker
        if journey.routed is not None and tracker is not None:
            tracker.first_byte(journey.routed, replica)
        if now is None or not journey.features.stream or journey.model_ttft_ms <= 0:
            return None
        fit = replica.latency
        observed_ms = (now - journey.sent_at) * 1000.0
        prior = self._median_fit(False) if fit.samples == 0 else None
        parts = journey.ttft_parts
        model_ms = journey.model_ttft_ms
        terms = replica.ttft_terms_fit
        trusted = terms.trusted
        unshaped_ms = model_ms - sum(parts)  # what no term holds: an adapter's load
        # The policy's own prediction there: the replica's fitted terms where they have
        # earned trust, else the profile's times its multiplier.
        predicted_ms = (unshaped_ms + sum(t * p for t, p in zip(trusted, parts, strict=True))
                        if parts and trusted is not None else 0.0)
        if parts and journey.alone:
            # Only an answer that waited for no one else's prefill shows the terms of the
            # replica's own: behind a queue the waits the model does not see (KV memory,
            # the queue's order) would be read as a slow term.
            terms.observe(observed_ms, parts, unshaped_ms)
        error = fit.observe(observed_ms, model_ms, prior, journey.alone, now, queued=not journey.alone)
        if error is not None and predicted_ms > 0:
            return observed_ms / predicted_ms
        return error

    def transferred(self, prefill: Journey, decode: Journey) -> None:
        """A disaggregated request's decode half has its KV: its replica now holds the prompt."""
        if prefill.routed is not None and decode.replica is not None and self.tracker is not None:
            self.tracker.transferred(prefill.routed, decode.replica)

    def learn(self, journey: Journey, prompt_tokens: int, cached_tokens: int | None) -> Lesson | None:
        """The replica's own token figures for this prompt, against the prediction; at most
        one lesson per request. Without `cached_tokens` (the engine does not report them) the
        prompt count still teaches tokens per character, and there is no lesson."""
        replica = journey.replica
        if journey.routed is None or replica is None or self.tracker is None:
            return None
        return self.tracker.learn(journey.routed, replica, prompt_tokens, cached_tokens)

    def learned_output(self, journey: Journey, output_tokens: int, now: float | None = None) -> float | None:
        """The answer ended with `output_tokens` generated; one cut at its `max_tokens` says
        only that the model would have written more, and teaches no length.

        With `now`, a streamed answer's time per output token after the first also fits the
        replica's decode speed; returns that prediction's error (observed over predicted)
        when it did."""
        features = journey.features
        self.output_lengths.observe(features.model, features.route, features.prompt_tokens,
                                    output_tokens, features.max_tokens)
        replica, started = journey.replica, journey.first_byte_at
        if (now is None or replica is None or started is None or not features.stream
                or output_tokens < 2 or journey.model_itl_ms <= 0):
            return None
        per_token_ms = (now - started) * 1000.0 / (output_tokens - 1)
        decoded = self._price_batch_decoded(journey, replica, now)
        if decoded is not None and journey.batch_gap_sent is not None:
            sequences, context = decoded
            beside_ms = _batch_ms(self.policy_for(features.model), sequences - 1,
                                  context - features.prompt_tokens, replica.weight)
            self.batch_persistence.observe(self._persistence_key(features.model), journey.batch_gap_sent,
                                           beside_ms - journey.batch_mean_sent, journey.batch_weight)
        fit = replica.decode_latency
        prior = self._median_fit(True) if fit.samples == 0 else None
        if journey.itl_parts:
            # Each prefill started there meanwhile stalled every token of this answer's
            # decode by its length: not a term of the decode iteration, so not fitted as one.
            # (The multiplier does carry them.)
            stalls_ms = (replica.prefill_ms_started - journey.stall_mark_ms) / (output_tokens - 1)
            replica.itl_terms_fit.observe(per_token_ms, journey.itl_parts,
                                          journey.model_itl_ms - sum(journey.itl_parts) + stalls_ms)
        return fit.observe(per_token_ms, journey.model_itl_ms, prior, now=now)

    def answer_chars(self, journey: Journey) -> int:
        """How many characters of the attempt's answer the index takes (0: none), for the
        drivers to collect as it passes."""
        routed, tracker = journey.routed, self.tracker
        if routed is None or tracker is None or not routed.chars:
            return 0
        return tracker.answer_chars if answer_continuation(journey.features.route, "") is not None else 0

    def answered_text(self, journey: Journey, text: str) -> None:
        """The attempt's answer ended whole, and `text` is its first choice's (at most
        `answer_chars` of it): its replica holds the prompt and the answer after it."""
        routed, replica, tracker = journey.routed, journey.replica, self.tracker
        if routed is None or replica is None or tracker is None:
            return
        continuation = answer_continuation(journey.features.route, text)
        if continuation is not None:
            tracker.record_answer(routed, replica, continuation)

    def _persistence_key(self, model: str | None) -> str | None:
        """An adapter's answers decode on its base model's fleet: they teach its fit."""
        return self.fleet.base_of(model) or model

    def _note_batch_sent(self, journey: Journey, replica: Replica, terms: Mapping[str, float]) -> None:
        """The decode batch the attempt's replica has before it joins, against the mean
        of the candidates it was ranked among, for a streamed answer of a policy that
        predicts time: the start of its sample of the batch's persistence, weighed as the
        policy's decode term was then (it fades as the fleet saturates, by `busy`)."""
        journey.batch_gap_sent = None
        journey.batch_weight = (1.0 - min(1.0, max(0.0, terms.get("busy", 0.0)))) ** 2
        policy = self.policy_for(journey.features.model)
        if not journey.features.stream or not policy.predicts_time:
            return
        ranking = journey.ranking
        mean = sum(_batch_ms(policy, c.replica.decoding, c.replica.context_tokens, c.replica.weight)
                   for c in ranking) / len(ranking)
        journey.batch_mean_sent = mean
        journey.batch_gap_sent = _batch_ms(policy, replica.decoding, replica.context_tokens, replica.weight) - mean

    def _price_batch_decoded(self, journey: Journey, replica: Replica, now: float) -> tuple[float, float] | None:
        """Reprice the answer's time per token at the batch it decoded beside, on average,
        rather than the one its replica had when it was sent: a batch that grew or drained
        meanwhile is the model's to predict, not the replica's speed. Fitted against the
        batch at the start, replicas of one kind in a fleet filling up (256 chat tenants on
        4 replicas, offline) were set more than 2x apart by when each answer happened to be
        sent, and requests fled the replicas that held their prompts. Returns that batch
        (sequences, context tokens, its own included), where the replica kept it."""
        area, start = replica.batch_at(now), journey.batch_from
        if area is None or start is None or not area[0] > start[0]:
            return None
        elapsed = area[0] - start[0]
        sequences = (area[1] - start[1]) / elapsed
        context = (area[2] - start[2]) / elapsed
        _fixed, per_seq_ms, per_context_ms = self.policy_for(journey.features.model).decode_iteration()
        sent_sequences, sent_context = journey.batch_sent
        iteration_ms = per_seq_ms * (sequences - sent_sequences) / replica.weight
        context_ms = per_context_ms * (context - sent_context) / replica.weight
        parts = journey.itl_parts
        if len(parts) == 2:
            parts = (parts[0] + iteration_ms, parts[1] + context_ms)
            if min(parts) <= 0:
                return sequences, context
            journey.itl_parts = parts
        elif journey.model_itl_ms + iteration_ms + context_ms <= 0:
            return sequences, context
        journey.model_itl_ms += iteration_ms + context_ms
        return sequences, context

    def _median_fit(self, decode: bool) -> float | None:
        """The median of the fleet's fitted multipliers, where some replica has one: where a
        replica's first sample starts (`LatencyFit.observe`)."""
        fits = [fit.scale for fit in (r.decode_latency if decode else r.latency for r in self.fleet.replicas)
                if fit.samples]
        return statistics.median(fits) if fits else None

    def failed(self, journey: Journey, now: float) -> bool:
        """The attempt failed by the replica's fault; True when that ejects it."""
        replica = journey.replica
        assert replica is not None
        ejected = replica.breaker.failed(now)
        if ejected:
            self.went_out(replica, now)
        return ejected

    def held_off(self, journey: Journey, now: float, wait_s: float) -> None:
        """The replica asked to be left alone for `wait_s` (Retry-After)."""
        assert journey.replica is not None
        journey.replica.breaker.hold_off(now, wait_s)

    def answered(self, journey: Journey, now: float, ok: bool, client: str | None) -> bool:
        """An answer was relayed whole; `ok` unless it was a 5xx. True when the replica's
        success rate ejects it."""
        replica = journey.replica
        assert replica is not None
        ejected = replica.breaker.answered(now, ok, client)
        if ejected:
            self.went_out(replica, now)
        return ejected

    def end_attempt(self, journey: Journey, *, answered: bool, now: float | None = None) -> Replica:
        """The attempt is over, however it ended. Returns its replica. `now`, where the
        driver has it, times the batch's change (`Replica.batch_at`)."""
        replica = journey.replica
        assert replica is not None
        phase = journey.phase
        if phase == PREFILLING:
            replica.prefill_tokens_queued -= journey.uncached
            if journey.load_ms:
                replica.adapter_slots.load_over(journey.load_ms)
                journey.load_ms = 0.0
        replica.batch_at(now)
        replica.decoding -= 1
        replica.in_flight -= 1
        replica.context_tokens -= journey.context
        journey.context = 0
        if journey.probe and replica.breaker.probe_in_flight:
            replica.breaker.abandoned()
        tracker = self.tracker
        if journey.routed is not None and tracker is not None:
            tracker.finish(journey.routed, replica, answered=answered, prefilled=phase == DECODING)
        if journey.features.adapter is not None:
            replica.adapter_slots.ended(journey.features.adapter)
        journey.replica = None
        journey.phase = IDLE
        self.fleet.released(replica)
        return replica


def _batch_ms(policy: Policy, sequences: float, context_tokens: float, weight: float) -> float:
    """What a decode batch adds to each iteration of a replica of `weight`, by the policy's
    own decode model."""
    _fixed, per_seq_ms, per_context_ms = policy.decode_iteration()
    return (per_seq_ms * sequences + per_context_ms * context_tokens) / weight
