"""Whether the traffic sends its answers back: the share of answers recorded in the prefix
index that a later prompt matched to their end.

A conversation's next turn holds the previous answer, so recording answers predicts its
cache (tracker.py `record_answer`). Traffic whose answers never return (one-shot questions,
batch jobs, a trace of unrelated prompts) gains nothing from them, and their blocks still
count against each replica's modelled capacity, pushing prompts that do come back out of the
model early. So answers are recorded while enough of them return, and otherwise one in
`EXPLORE_EVERY`, which keeps measuring.

An answer has returned when a prompt's deepest block held anywhere is the last whole block
of that answer as recorded: the next turn runs exactly through the answer, then diverges
with its new message. Only the last block of each of the latest `MAX_TRACKED` answers is
kept.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_TRACKED = 65_536
DECAY = 0.99  # per answer recorded: the last few hundred answers carry the weight
# Recorded answers must come back at least this often to keep being recorded: a low bar,
# since an answer that returns saves its whole prefill on the next turn, while one that never
# does only pushes the oldest prompts out of the model a little early.
MIN_RETURN_SHARE = 0.1
EXPLORE_EVERY = 8
# The start, as if this many answers had been recorded and had all come back: a conversation's
# next turn comes a think time after its answer, so the first answers of a run return only
# after many more were recorded. About 90 answers with none back bring the share under the bar.
PRIOR_ANSWERS = 10.0


class AnswerReturns:
    def __init__(self) -> None:
        self._ends: OrderedDict[int, None] = OrderedDict()
        self.recorded = PRIOR_ANSWERS
        self.returned = PRIOR_ANSWERS
        self._skipped = 0

    @property
    def share(self) -> float:
        """The decayed share of recorded answers that came back."""
        return self.returned / self.recorded

    def worth_recording(self) -> bool:
        if self.share >= MIN_RETURN_SHARE:
            return True
        self._skipped += 1
        if self._skipped >= EXPLORE_EVERY:
            self._skipped = 0
            return True
        return False

    def recorded_answer(self, last_block: int) -> None:
        self.recorded = self.recorded * DECAY + 1.0
        self.returned *= DECAY
        ends = self._ends
        ends[last_block] = None
        ends.move_to_end(last_block)
        if len(ends) > MAX_TRACKED:
            ends.popitem(last=False)

    def prompt_met(self, deepest_block: int) -> None:
        """A prompt's deepest block held anywhere."""
        ends = self._ends
        if deepest_block in ends:
            del ends[deepest_block]  # one answer returns once
            self.returned += 1.0
