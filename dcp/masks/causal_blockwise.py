"""Causal blockwise mask (block-sparse causal attention with a global first block).

Token t in block ``b = t // block`` attends causally to its own block and the ``num_prev`` previous
blocks, [max(block, (b - num_prev) * block), t + 1), plus the first block [0, block). When the two
touch or overlap (``b <= num_prev + 1``, including block 0 itself) they form the single range [0, t + 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.base import Mask, check_int, check_seqlen, pack_two_ranges


@dataclass(frozen=True)
class CausalBlockwiseMask(Mask):
    block: int = 256
    num_prev: int = 2
    name = "causal_blockwise"

    def __post_init__(self):
        object.__setattr__(self, "block", check_int(self.block, "causal_blockwise: block", 1))
        object.__setattr__(self, "num_prev", check_int(self.num_prev, "causal_blockwise: num_prev", 0))

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        block = min(self.block, seqlen)  # a block >= L behaves like block = L: everything in block 0
        t = np.arange(seqlen, dtype=np.int32)
        end = t + 1
        # start of the num_prev-blocks window, at least the second block: max(block, (b - num_prev) * block)
        first_window_block = t // block - min(self.num_prev, seqlen)
        single = first_window_block <= 1  # b <= num_prev + 1: the window touches the first block
        window_start = np.where(single, end, first_window_block * block)  # empty second range when single
        first_end = np.where(single, end, block)
        return pack_two_ranges(np.zeros(seqlen, dtype=np.int32), first_end, window_start, end)
