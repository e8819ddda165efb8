"""How long answers run, learned per model, route and prompt length from the replicas' counts.

A request's decode holds a batch slot and slows every sequence beside it for as many
iterations as it generates, so the predictive policy prices it by its expected output.
`max_tokens` bounds that but is usually far above what the model writes; many clients name
none at all. So every answer that ended on its own (below its `max_tokens`, or with none)
teaches the mean output of its (model, route, prompt length within a factor of two). An
answer cut at `max_tokens` says only that the model would have written at least that much,
and teaches nothing: counting it would pull the mean toward whatever bounds clients chose.

Lookups fall back from the prompt-length bucket to the whole (model, route), then to
nothing (the policy's own default). Decayed means, so a change of traffic shows within a
few dozen answers; sans I/O, and bounded in keys.
"""

from __future__ import annotations

from collections import OrderedDict

DECAY = 0.95  # per answer: the last ~20 carry most of the weight
MIN_WEIGHT = 3.0  # answers before a mean is trusted
MAX_KEYS = 4096

# (model, route, prompt-length bucket or -1 for the whole route)
_Key = tuple[str, str, int]


def _bucket(prompt_tokens: int) -> int:
    return max(prompt_tokens, 1).bit_length()


class OutputLengths:
    def __init__(self) -> None:
        # key -> [decayed output tokens, decayed answers]; least recently taught first.
        self._means: OrderedDict[_Key, list[float]] = OrderedDict()

    def expect(self, model: str | None, route: str, prompt_tokens: int) -> float | None:
        """The mean output of answers like this one, or None when too few have ended."""
        if not self._means:
            return None
        name = model or ""
        get = self._means.get
        sums = get((name, route, _bucket(prompt_tokens)))
        if sums is None or sums[1] < MIN_WEIGHT:
            sums = get((name, route, -1))
            if sums is None or sums[1] < MIN_WEIGHT:
                return None
        return sums[0] / sums[1]

    def observe(self, model: str | None, route: str, prompt_tokens: int, output_tokens: int,
                max_tokens: int | None) -> None:
        if output_tokens < 0 or (max_tokens is not None and output_tokens >= max_tokens):
            return
        name = model or ""
        for key in ((name, route, _bucket(prompt_tokens)), (name, route, -1)):
            sums = self._means.get(key)
            if sums is None:
                sums = self._means[key] = [0.0, 0.0]
                if len(self._means) > MAX_KEYS:
                    self._means.popitem(last=False)
            else:
                self._means.move_to_end(key)
            sums[0] = sums[0] * DECAY + output_tokens
            sums[1] = sums[1] * DECAY + 1.0

    def __len__(self) -> int:
        return len(self._means)
