"""Tokens per character of prompt text, learned per model from the replicas' own counts.

The approximate index hashes text in blocks of characters but prices prompts and caches in
tokens. How many tokens a character is depends on the model's tokenizer and on the text:
English prose is near 0.25, code and other languages differ, and a chat template adds its
own tokens to every message. A wrong ratio misprices every prompt and fills the model of
each replica's cache too early or too late, so the ratio is learned from every answer's
`usage.prompt_tokens` against the prompt's length in characters.

Per model, a decayed sum of tokens over a decayed sum of characters: long prompts weigh
more, as they should (a short one is mostly template). The configured ratio starts each
model as a prior worth `PRIOR_CHARS` characters. One sample moves the estimate at most by
`MAX_SAMPLE_FACTOR` either way, so a garbled usage figure cannot swing it; a real change
still wins within a few dozen answers. Sans I/O, and bounded in models.
"""

from __future__ import annotations

from collections import OrderedDict

PRIOR_CHARS = 4096.0
DECAY = 0.97  # per sample: the last ~30 answers carry most of the weight
MAX_SAMPLE_FACTOR = 2.0
MIN_CHARS = 64  # shorter prompts are mostly template and teach little
RATIO_BOUNDS = (0.01, 4.0)
MAX_MODELS = 1024


class TokenRatio:
    def __init__(self, initial: float, *, learn: bool = True) -> None:
        if not initial > 0:
            raise ValueError("tokens_per_char must be positive")
        self.initial = initial
        self.learn = learn
        # model -> [decayed tokens, decayed characters]; least recently taught first.
        self._sums: OrderedDict[str, list[float]] = OrderedDict()

    def of(self, model: str | None) -> float:
        sums = self._sums.get(model or "")
        return self.initial if sums is None else sums[0] / sums[1]

    def observe(self, model: str | None, chars: int, tokens: int) -> float:
        """One answer's prompt: `chars` characters that the replica counted as `tokens`.
        Returns the model's ratio after it."""
        key = model or ""
        if not self.learn or chars < MIN_CHARS or tokens <= 0:
            return self.of(key)
        sums = self._sums.get(key)
        if sums is None:
            sums = self._sums[key] = [self.initial * PRIOR_CHARS, PRIOR_CHARS]
            if len(self._sums) > MAX_MODELS:
                self._sums.popitem(last=False)
        else:
            self._sums.move_to_end(key)
        current = sums[0] / sums[1]
        low, high = RATIO_BOUNDS
        sample = min(max(tokens / chars, current / MAX_SAMPLE_FACTOR, low), current * MAX_SAMPLE_FACTOR, high)
        sums[0] = sums[0] * DECAY + sample * chars
        sums[1] = sums[1] * DECAY + chars
        return sums[0] / sums[1]

    def models(self) -> dict[str, float]:
        """Each taught model's ratio, for metrics."""
        return {model: sums[0] / sums[1] for model, sums in self._sums.items()}
