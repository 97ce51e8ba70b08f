"""Causal mask: query token t attends to keys [0, t + 1)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_seqlen


@dataclass(frozen=True)
class CausalMask(Mask):
    name = "causal"

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        ranges_tr2 = np.zeros((seqlen, 1, 2), dtype=np.int32)
        ranges_tr2[:, 0, 1] = np.arange(1, seqlen + 1, dtype=np.int32)
        return ranges_tr2
