"""How much of a replica's decode batch, as it stands when a request is sent, the request's
answer will still decode beside.

A policy that prices the decode batch a request joins sees a snapshot: the answers running
there now. Over the answer's own life those finish and others start, and the router itself
sends the next requests away from a crowded replica, so the batch an answer actually decodes
beside lies between the snapshot and the fleet's average. How far is the workload's: short
answers behind long-running ones keep the snapshot; 200-token conversational turns beside
answers a few seconds from their end meet another batch entirely.

Each streamed answer is one sample: x, its replica's batch at sending less the candidates'
mean batch then; y, the batch it decoded beside on average, from its first byte to its last
and without its own sequence, less the same mean (both in the policy's milliseconds per
decode iteration). The slope of y on x, a weighted least-squares fit with an intercept (a
fleet filling or draining moves every answer's batch alike, which the intercept takes), is
the persistence: 1 keeps the snapshot, 0 sees every replica's batch as the fleet's mean.
Policies scale each candidate's batch around the candidates' mean by it. Each answer counts
as much as the policy's decode term counted when it was sent (`predictive` fades that term
as the fleet saturates): persistence is a property of the load, and on the shared trace at
4x the batch persisted wholly in the lulls, where that term ranks, and by half in the
bursts, where it hardly does.

Sans I/O and clock; one fit per model, at most MAX_MODELS of them.
"""

from __future__ import annotations

from collections import OrderedDict

# Each sample's weight fades by this per later sample: about the latest 1 / (1 - FADE) count.
FADE = 0.995
# Answers, and their weight (faded), before a slope is given; until then policies keep the
# snapshot (persistence 1).
MIN_SAMPLES = 64
MIN_WEIGHT = 32.0
MAX_MODELS = 1024


class BatchPersistence:
    """One model's fit: the slope of the batch decoded beside on the batch at sending."""

    __slots__ = ("samples", "_w", "_x", "_y", "_xx", "_xy")

    def __init__(self) -> None:
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, sent_gap_ms: float, decoded_gap_ms: float, weight: float = 1.0) -> None:
        """One answer; `weight` (0 to 1) is how much the policy's decode term counted when it
        was sent: the fit is of the answers whose batch the ranking weighed."""
        f = FADE
        w = min(1.0, max(0.0, weight))
        self._w = self._w * f + w
        self._x = self._x * f + w * sent_gap_ms
        self._y = self._y * f + w * decoded_gap_ms
        self._xx = self._xx * f + w * sent_gap_ms * sent_gap_ms
        self._xy = self._xy * f + w * sent_gap_ms * decoded_gap_ms
        self.samples += 1

    @property
    def slope(self) -> float | None:
        """The persistence, 0 to 1; None before MIN_SAMPLES answers of full weight, or while
        the batches sent to have not differed enough to tell."""
        if self.samples < MIN_SAMPLES or self._w < MIN_WEIGHT:
            return None
        spread = self._w * self._xx - self._x * self._x
        # Below a part in a million of the mean square, x has been one value: no slope.
        if spread <= 1e-6 * self._w * self._xx or spread <= 0.0:
            return None
        slope = (self._w * self._xy - self._x * self._y) / spread
        return min(1.0, max(0.0, slope))


class BatchPersistences:
    """The fits by model (None: requests that name none)."""

    __slots__ = ("_fits",)

    def __init__(self) -> None:
        self._fits: OrderedDict[str | None, BatchPersistence] = OrderedDict()

    def observe(self, model: str | None, sent_gap_ms: float, decoded_gap_ms: float, weight: float = 1.0) -> None:
        fit = self._fits.get(model)
        if fit is None:
            fit = self._fits[model] = BatchPersistence()
            if len(self._fits) > MAX_MODELS:
                self._fits.popitem(last=False)
        else:
            self._fits.move_to_end(model)
        fit.observe(sent_gap_ms, decoded_gap_ms, weight)

    def slope(self, model: str | None) -> float | None:
        fit = self._fits.get(model)
        return None if fit is None else fit.slope

    def slopes(self) -> dict[str | None, float]:
        """Each model's persistence, where learned."""
        return {model: slope for model, fit in self._fits.items() if (slope := fit.slope) is not None}
