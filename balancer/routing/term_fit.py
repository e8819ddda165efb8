"""Each term of a replica's predicted time, fitted apart: the shape of its speed.

`latency.py` fits one multiplier per replica on its whole predicted time. A card can differ
from its profile in shape, not only in level: by the calibration an H200 prefills a short
prompt no faster than an H100 (its cost per token is even a tenth higher) but a 32k-token
one a quarter faster (its attention term is a quarter of the H100's), and decodes a long
context faster than a short one relative to an H100 (it reads memory faster; its fixed cost
per iteration differs less); an engine fallen back to a slower attention kernel is slow
only at long prompts. One multiplier fitted over both ends sits at their average and
mispredicts each end.

So beside the multiplier, each replica keeps a coefficient per term of its prediction (time
to first token: the iterations waited, the tokens, the attention; time per output token: the
iteration, the context read), each over the profile's. For a sample with the prediction's
terms x (ms by the profile), the observed time y and any part of it this fit does not model
(an adapter's load, the stalls of prefills run during a decode) o, it fits

    y − o ≈ Σ θ_j · x_j

by ridge regression with exponential forgetting, in relative terms (the sample divided by
Σ x_j, so a 30 ms answer and a 1 s one count alike), pulled toward one level for all terms (the mean of y − o over Σ x in
the same memory) with the weight of a few samples (TTFT_RIDGE, ITL_RIDGE): where the traffic
does not tell the terms apart (every prompt of one length) they sit at that level, which is
what one multiplier would say of these answers.

A fit is used only once it predicts the replica's answers well (`earned`): in overload the
answers carry waits no term explains, and terms fitted to that noise would move choices for
nothing.

Bounded and robust: each θ_j within [MIN_SHAPE, MAX_SHAPE]; each sample's target clipped to
within CLIP of what the fit predicted before it (a stall or a timeout is one sample, not a
verdict); the memory fades by FORGET per sample (about 50 samples' worth), and by half when
the replica's multiplier fades for want of answers (`fade`).

Sans I/O and cheap: a sample is a solve of at most 3 x 3.
"""

from __future__ import annotations

import math

MIN_SHAPE = 0.05
MAX_SHAPE = 20.0
# Weight of the prior (θ = one level for all) per term, in samples' worth of that term
# alone. Answers share out their time by the terms' sizes, so a term that is a tenth of most
# answers needs about ten answers to outweigh even a small prior: the token and attention
# terms of a prefill are told apart by the prompts' lengths within a few dozen answers. The
# iterations a prefill waits through carry the one in progress when it arrived (a whole one
# or none), and a time per output token is an answer's average over a batch that changed
# under it, so those take more evidence before they move.
TTFT_RIDGE = (0.5, 0.05, 0.05)
ITL_RIDGE = (1.0, 1.0)
# Each sample's weight decays by this per later sample: a memory of about 1 / (1 - FORGET).
FORGET = 0.98
# A sample's target is clipped to within this factor of the fit's prediction before it.
CLIP = 2.0
# Below this predicted time the sample is noise (the network, not the engine).
MIN_PREDICTED_MS = 1.0
# When the fitted terms are used (`earned`): after this many answers, once their error
# (squared log ratio of each answer before it taught them, decayed like the fit's memory) is
# at most this, a typical miss of about 10 %. An overloaded replica's answers carry waits no
# term explains (for KV memory, behind prefills that came after them): there the terms fit
# noise (errors of 0.04-0.13 on the shared trace at 4x, trusted in its lulls at a bar of
# 0.02, where they cost TTFT p99 6.2-7.6 s against 4.9 on seed 0; at 0.01 it runs as without).
EARN_SAMPLES = 16
EARN_ERROR = 0.01


class TermFit:
    """One replica's fitted coefficient on each term of one prediction, over its profile's
    (`shape`; all 1.0 until it has answered, then from its first answer's level)."""

    __slots__ = ("shape", "samples", "_gram", "_moment", "_n", "_ridge", "_level", "error", "earned", "trusted",
                 "trusted_shape")

    def __init__(self, ridge: tuple[float, ...]) -> None:
        terms = len(ridge)
        self._n = terms
        self._ridge = ridge
        self.shape: tuple[float, ...] = (1.0,) * terms
        self.samples = 0
        # Decayed Σ z zᵀ and Σ z·t of the samples' relative terms z and targets t.
        self._gram = [[0.0] * terms for _ in range(terms)]
        self._moment = [0.0] * terms
        self._level = 1.0  # where the prior holds the terms: the answers' mean ratio
        # The fit's error on each answer before it taught it (squared log ratio, decayed).
        self.error = 0.0
        # Whether the fitted terms predict this replica well enough to use (EARN_*), and,
        # kept beside it because policies read them for every replica of every decision,
        # the terms where they have (else None), and their shape alone (each over their
        # geometric mean, so the level stays the replica's multiplier's).
        self.earned = False
        self.trusted: tuple[float, ...] | None = None
        self.trusted_shape: tuple[float, ...] | None = None

    def observe(self, observed_ms: float, parts: tuple[float, ...] | list[float], offset_ms: float = 0.0) -> bool:
        """One answer: `parts` are the prediction's terms by the profile, `offset_ms` any
        part of the observed time this fit does not model. Returns whether it taught
        anything."""
        n = self._n
        if len(parts) != n or not (observed_ms > 0 and math.isfinite(observed_ms)):
            return False
        total = 0.0
        for p in parts:
            if not (p >= 0.0) or not math.isfinite(p):
                return False
            total += p
        if total < MIN_PREDICTED_MS:
            return False
        target = (observed_ms - offset_ms) / total
        if not target > 0:
            return False
        if self.samples == 0:
            # The first answer sets where the terms start, as one level: clipped against the
            # profile's 1.0, a fleet sped up tenfold would take a dozen answers to get there.
            self._level = min(MAX_SHAPE, max(MIN_SHAPE, target))
            self.shape = (self._level,) * n
        z = [p / total for p in parts]
        before = sum(r * zi for r, zi in zip(self.shape, z, strict=True))
        if before > 0:
            target = min(before * CLIP, max(before / CLIP, target))
            self.error = self.error * FORGET + math.log(target / before) ** 2 * (1 - FORGET)
        gram, moment = self._gram, self._moment
        for i in range(n):
            row = gram[i]
            zi = z[i]
            for j in range(n):
                row[j] = row[j] * FORGET + zi * z[j]
            moment[i] = moment[i] * FORGET + zi * target
        self.samples += 1
        # The level the prior holds the terms at: a mean over the fit's memory, from the first
        # answer on (a fleet sped up tenfold for a test sits at 0.1, not at the profile's 1).
        self._level += (min(MAX_SHAPE, max(MIN_SHAPE, target)) - self._level) / min(self.samples, 1 / (1 - FORGET))
        self._solve()
        return True

    def fade(self) -> None:
        """Halve what the fit has learned: it leans back toward the multiplier until answers
        teach it again."""
        for row in self._gram:
            for j in range(self._n):
                row[j] *= 0.5
        self._moment = [m * 0.5 for m in self._moment]
        self._solve()

    def _solve(self) -> None:
        n = self._n
        # (G + λI) θ = m + λ·level, by Gaussian elimination with partial pivoting.
        ridge, level = self._ridge, self._level
        rows = [[*(self._gram[i][j] + (ridge[i] if i == j else 0.0) for j in range(n)),
                 self._moment[i] + ridge[i] * level] for i in range(n)]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
            rows[col], rows[pivot] = rows[pivot], rows[col]
            lead = rows[col][col]
            for r in range(col + 1, n):
                factor = rows[r][col] / lead
                if factor:
                    for c in range(col, n + 1):
                        rows[r][c] -= factor * rows[col][c]
        shape = [0.0] * n
        for i in range(n - 1, -1, -1):
            value = rows[i][n] - sum(rows[i][j] * shape[j] for j in range(i + 1, n))
            shape[i] = value / rows[i][i]
        self.shape = tuple(min(MAX_SHAPE, max(MIN_SHAPE, s)) for s in shape)
        self.earned = self.samples >= EARN_SAMPLES and self.error <= EARN_ERROR
        if self.earned:
            level = math.prod(self.shape) ** (1.0 / n)
            self.trusted = self.shape
            self.trusted_shape = tuple(s / level for s in self.shape)
        else:
            self.trusted = self.trusted_shape = None
