"""Sliding-window causal mask: token t attends to the last ``window`` tokens including itself,
keys [max(0, t - window + 1), t + 1)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_int, check_seqlen


@dataclass(frozen=True)
class SlidingWindowMask(Mask):
    window: int
    name = "sliding_window"

    def __post_init__(self):
        object.__setattr__(self, "window", check_int(self.window, "sliding_window: window", 1))

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        end = np.arange(1, seqlen + 1, dtype=np.int32)
        ranges_tr2 = np.empty((seqlen, 1, 2), dtype=np.int32)
        ranges_tr2[:, 0, 0] = np.maximum(0, end - min(self.window, seqlen))
        ranges_tr2[:, 0, 1] = end
        return ranges_tr2
