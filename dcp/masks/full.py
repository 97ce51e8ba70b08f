"""Full (bidirectional) mask: every query token attends to every key, [0, L)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_seqlen


@dataclass(frozen=True)
class FullMask(Mask):
    name = "full"

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        ranges_tr2 = np.zeros((seqlen, 1, 2), dtype=np.int32)
        ranges_tr2[:, 0, 1] = seqlen
        return ranges_tr2
