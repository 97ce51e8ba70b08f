"""Lambda (attention-sink + sliding window) mask.

Token t attends to the first ``sink`` tokens, [0, min(sink, t + 1)), and causally to the last ``window``
tokens, [max(min(sink, t + 1), t - window + 1), t + 1). The two ranges are merged when they touch, so
every token uses 1 or 2 slots (always 2 slots in the array; an unused second slot is (0, 0)).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_int, check_seqlen, pack_two_ranges


@dataclass(frozen=True)
class LambdaMask(Mask):
    sink: int = 64
    window: int = 4096
    name = "lambda"

    def __post_init__(self):
        object.__setattr__(self, "sink", check_int(self.sink, "lambda: sink", 0))
        object.__setattr__(self, "window", check_int(self.window, "lambda: window", 1))

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        end = np.arange(1, seqlen + 1, dtype=np.int32)  # t + 1
        sink_end = np.minimum(min(self.sink, seqlen), end)
        window_start = np.maximum(sink_end, end - min(self.window, seqlen))
        return pack_two_ranges(np.zeros_like(end), sink_end, window_start, end)
