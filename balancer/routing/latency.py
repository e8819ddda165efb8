"""Each replica's speeds, learned from what the balancer sees of it.

A latency-predicting policy (policies/predictive.py) prices every replica with a model of
its engine: the calibrated iteration formula of the replica's profile, fed with the load the
balancer has routed there. A real fleet departs from that model: a newer card is faster, a
bigger model slower, an engine with a noisy neighbour or a throttled GPU slower than its
profile claims. One multiplier per replica absorbs that: the ratio of the time to first
token observed to the one the model predicted, fitted online.

The fit is a moving average of log ratios, so a replica twice too slow and one twice too
fast are equally far from 1.0 and ten answers move it most of the way. Each sample's pull
is clipped (a timeout, a cold start or a paging stall is one sample, not a verdict), the
multiplier stays inside [MIN_SCALE, MAX_SCALE], and only streamed answers teach it: a
non-streaming answer's first byte comes after its last token, not after its prefill.

Each replica has two: one on its time to first token (prefill and the queue ahead of it),
one on its time per output token once the answer streams (the decode batch), fitted the
same way when a streamed answer ends, from its length and the time since its first byte.
A card can be faster at one than the other (an H200 has an H100's compute and more memory
bandwidth: much the same prefill, faster decode).

A single EMA step is slow to follow a real change: a replica that turns five times slower
needs a dozen answers to be priced so, and each of them is a request served five times
slower. So a run of `SHIFT_RUN` answers in a row, each more than `SHIFT_FACTOR` from the
fit on the same side, counts as a confirmed change rather than outliers: the fit jumps to
the run's median and counts as fully taught (`evidence`), so the policy trusts it at once.
One stalled answer, or two, still moves it by a bounded step only. Only answers to requests
that found the replica's prefill queue empty can confirm (`confirmable`): there the
prediction is the replica's own prefill, which the model knows well, while an overloaded
fleet departs from the model everywhere at once (requests waiting for KV memory, which the
model does not see), and jumping on those errors misranked replicas of one kind (shared
trace at 4x on 8 replicas: TTFT p99 13.3 s against 5.9 s without jumps). For the same
reason the other answers teach at a quarter of the weight and by small steps (`queued`).

Beside each multiplier, `term_fit.py` fits the same answers term by term (the shape of the
replica's speed, not only its level).

Sans I/O: the routing core reports each first byte and each end with the time it measured,
so the same fits run live and in the simulator.
"""

from __future__ import annotations

import math

MIN_SCALE = 0.05
MAX_SCALE = 20.0
# Weight of one sample in the moving average: about ten answers to follow a step change.
ALPHA = 0.2
# One sample moves the log of the multiplier by at most this (a factor of 1.5 at ALPHA 0.2).
MAX_STEP = math.log(1.5)
# Below this predicted time the ratio is noise (the network, not the engine): not learned.
MIN_PREDICTED_MS = 1.0

# An answer that waited behind other prompts' prefill teaches at this weight, by at most
# this step (a factor of 1.1): its error mixes the replica's speed with waits the model does
# not see, KV memory above all, which shift from moment to moment on replicas of one kind.
# At the full weight, 256 chat tenants on 4 replicas in overload had identical replicas'
# fits swinging between 1x and 16x within seconds (live) and were ranked on that noise
# (offline, seed 0: TTFT p99 1,249 ms against 854 at this weight); congestion that lasts (a
# replica behind long prompts on the shared trace at 4x) still moves its price, over a few
# dozen answers.
QUEUED_ALPHA = 0.05
QUEUED_MAX_STEP = math.log(1.1)

# Answers in a row, each this far from the fit on one side, that confirm a change.
SHIFT_RUN = 3
SHIFT_FACTOR = 2.0
# The evidence a confirmed change counts as, in answers: enough for a policy to trust it in
# full (policies/predictive.py trusts a fit of 16 answers).
CONFIRMED_EVIDENCE = 16
# A fit nothing has taught for this long loses half its evidence, and again each time as
# long: a replica priced out as slow gets no answers to show it recovered, so its fit must
# fade toward the fleet's until it is tried again (about 2.5 minutes from full evidence).
FADE_AFTER_S = 30.0

_LOG_MIN, _LOG_MAX = math.log(MIN_SCALE), math.log(MAX_SCALE)
_LOG_SHIFT = math.log(SHIFT_FACTOR)


class LatencyFit:
    """One replica's fitted multiplier on its profile's predicted time to first token."""

    __slots__ = ("_log_scale", "scale", "samples", "evidence", "last_error", "_run", "taught_at")

    def __init__(self) -> None:
        self._log_scale = 0.0
        # Kept beside its log: policies read it for every replica of every decision.
        self.scale = 1.0
        self.samples = 0
        # How much the fit can be trusted, in answers: `samples`, or CONFIRMED_EVIDENCE once
        # a run of answers has confirmed a change.
        self.evidence = 0
        self.last_error = 1.0
        # Log ratios of the latest answers in a row that lay beyond SHIFT_FACTOR on one side.
        self._run: list[float] = []
        # When an answer last taught it (or its evidence last faded), by the core's clock.
        self.taught_at: float | None = None

    def fade(self, now: float) -> bool:
        """Halve the evidence of a fit untaught for FADE_AFTER_S; True when it did."""
        if self.evidence and self.taught_at is not None and now - self.taught_at >= FADE_AFTER_S:
            self.evidence //= 2
            self.taught_at = now
            return True
        return False

    def observe(self, observed_ms: float, model_ms: float, prior: float | None = None,
                confirmable: bool = False, now: float | None = None, queued: bool = False) -> float | None:
        """One sample: `model_ms` is the profile's prediction before the multiplier.
        Returns observed over the prediction with the multiplier as it was (the error), or
        None when the sample teaches nothing.

        `prior`, for a replica's first sample, is where its fit starts instead of 1.0: the
        fleet's median fit. An error the whole fleet shares (replicas sped up for a test, a
        network in front) then costs a newcomer nothing, where from 1.0 the clipped steps
        would take a dozen answers to catch up while the replicas already fitted looked
        that much faster and kept the traffic that could teach it.

        `confirmable`: the sample may count toward a run that confirms a change (see the
        module's text); any other sample ends a run. `queued`: the answer waited behind
        other prompts' prefill, and teaches at QUEUED_ALPHA."""
        if not (model_ms >= MIN_PREDICTED_MS and observed_ms > 0) or not math.isfinite(observed_ms):
            return None
        if self.samples == 0 and prior is not None and MIN_SCALE <= prior <= MAX_SCALE:
            self._log_scale = math.log(prior)
        log_ratio = math.log(observed_ms / model_ms)
        off = log_ratio - self._log_scale
        error = math.exp(off)
        self.samples += 1
        self.evidence += 1
        self.taught_at = now
        run = self._run
        if confirmable and abs(off) > _LOG_SHIFT:
            if run and (run[-1] > self._log_scale) != (off > 0):
                run.clear()  # the other side: a new run starts
            run.append(log_ratio)
        else:
            run.clear()
        if len(run) >= SHIFT_RUN:
            log_scale = sorted(run)[len(run) // 2]
            run.clear()
            self.evidence = max(self.evidence, CONFIRMED_EVIDENCE)
        else:
            alpha, most = (QUEUED_ALPHA, QUEUED_MAX_STEP) if queued else (ALPHA, MAX_STEP)
            step = alpha * off
            if step > most:
                step = most
            elif step < -most:
                step = -most
            log_scale = self._log_scale + step
        self._log_scale = min(_LOG_MAX, max(_LOG_MIN, log_scale))
        self.scale = math.exp(self._log_scale)
        self.last_error = error
        return error
