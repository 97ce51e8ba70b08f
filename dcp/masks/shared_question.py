"""Shared-question mask (one prompt, several sampled answers packed in one sequence).

The first ``Q = max(1, round(question_frac * L))`` tokens (at most L) form the question, causal over
itself. The remaining ``n = L - Q`` tokens are split into ``k = min(num_answers, n)`` answers of
near-equal length (the first ``n % k`` answers get one extra token). An answer token t of the answer
starting at ``a`` attends to the whole question [0, Q) and causally to its own answer [a, t + 1); for
the first answer (a == Q) the two ranges touch and are merged into [0, t + 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_float, check_int, check_seqlen, pack_two_ranges


@dataclass(frozen=True)
class SharedQuestionMask(Mask):
    question_frac: float = 0.2
    num_answers: int = 4
    name = "shared_question"

    def __post_init__(self):
        object.__setattr__(self, "question_frac", check_float(
            self.question_frac, "shared_question: question_frac", 0.0, 1.0, low_open=True, high_open=True))
        object.__setattr__(self, "num_answers", check_int(self.num_answers, "shared_question: num_answers", 1))

    def question_len(self, seqlen: int) -> int:
        return min(seqlen, max(1, round(self.question_frac * seqlen)))

    def answer_lengths(self, seqlen: int) -> list[int]:
        """Lengths of the answers (may be fewer than ``num_answers`` for short sequences)."""
        n = seqlen - self.question_len(seqlen)
        k = min(self.num_answers, n)
        return [n // k + (1 if i < n % k else 0) for i in range(k)] if k else []

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        q_len = self.question_len(seqlen)
        lengths = np.asarray(self.answer_lengths(seqlen), dtype=np.int64)
        starts = (q_len + np.cumsum(lengths) - lengths).astype(np.int32)
        # segment start per token: 0 inside the question, the answer start inside an answer
        seg_start = np.zeros(seqlen, dtype=np.int32)
        seg_start[q_len:] = np.repeat(starts, lengths)
        end = np.arange(1, seqlen + 1, dtype=np.int32)
        in_answer = seg_start > 0
        # question tokens: [0, t+1) ; answer tokens: [0, Q) + [a, t+1) (merged when a == Q)
        return pack_two_ranges(np.zeros(seqlen, dtype=np.int32), np.where(in_answer, np.int32(q_len), end),
                               np.where(in_answer, seg_start, end), end)
