"""Prefix-LM mask: a bidirectional prefix followed by causal tokens.

The prefix length P is ``prefix_len`` if given, else ``round(prefix_frac * L)``, clipped to [1, L].
Token t < P attends to [0, P); token t >= P attends to [0, t + 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_float, check_int, check_seqlen


@dataclass(frozen=True)
class PrefixLMMask(Mask):
    prefix_frac: float = 0.5
    prefix_len: int | None = None
    name = "prefix_lm"

    def __post_init__(self):
        object.__setattr__(self, "prefix_frac",
                           check_float(self.prefix_frac, "prefix_lm: prefix_frac", 0.0, 1.0))
        if self.prefix_len is not None:
            object.__setattr__(self, "prefix_len", check_int(self.prefix_len, "prefix_lm: prefix_len", 1))

    def prefix_length(self, seqlen: int) -> int:
        p = self.prefix_len if self.prefix_len is not None else round(self.prefix_frac * seqlen)
        return min(seqlen, max(1, p))

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        p = self.prefix_length(seqlen)
        ranges_tr2 = np.zeros((seqlen, 1, 2), dtype=np.int32)
        ranges_tr2[:, 0, 1] = np.maximum(np.arange(1, seqlen + 1), p)
        return ranges_tr2
