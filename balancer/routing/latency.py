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

_LOG_MIN, _LOG_MAX = math.log(MIN_SCALE), math.log(MAX_SCALE)


class LatencyFit:
    """One replica's fitted multiplier on its profile's predicted time to first token."""

    __slots__ = ("_log_scale", "scale", "samples", "last_error")

    def __init__(self) -> None:
        self._log_scale = 0.0
        # Kept beside its log: policies read it for every replica of every decision.
        self.scale = 1.0
        self.samples = 0
        # The last observed / predicted ratio with the multiplier applied (1.0 is exact).
        self.last_error = 1.0

    def observe(self, observed_ms: float, model_ms: float, prior: float | None = None) -> float | None:
        """One sample: `model_ms` is the profile's prediction before the multiplier.
        Returns observed over the prediction with the multiplier as it was (the error), or
        None when the sample teaches nothing.

        `prior`, for a replica's first sample, is where its fit starts instead of 1.0: the
        fleet's median fit. An error the whole fleet shares (replicas sped up for a test, a
        network in front) then costs a newcomer nothing, where from 1.0 the clipped steps
        would take a dozen answers to catch up while the replicas already fitted looked
        that much faster and kept the traffic that could teach it."""
        if not (model_ms >= MIN_PREDICTED_MS and observed_ms > 0) or not math.isfinite(observed_ms):
            return None
        if self.samples == 0 and prior is not None and MIN_SCALE <= prior <= MAX_SCALE:
            self._log_scale = math.log(prior)
        log_ratio = math.log(observed_ms / model_ms)
        error = math.exp(log_ratio - self._log_scale)
        step = ALPHA * (log_ratio - self._log_scale)
        if step > MAX_STEP:
            step = MAX_STEP
        elif step < -MAX_STEP:
            step = -MAX_STEP
        self._log_scale = min(_LOG_MAX, max(_LOG_MIN, self._log_scale + step))
        self.scale = math.exp(self._log_scale)
        self.samples += 1
        self.last_error = error
        return error
