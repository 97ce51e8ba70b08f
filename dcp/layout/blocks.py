"""Data blocks and computation blocks of a batch.

A *token block* is a contiguous run of tokens of one sequence; all heads of a token block share one home
device. Query heads are cut into *head blocks* of ``head_block_size`` heads; head block ``h`` reads the KV
heads its query heads map to under GQA. A *tile* is a (q token block, kv token block, head block) triple
of one sequence whose mask area is non-empty; it is *full* when every (q, kv) pair is unmasked.

Counting the unmasked pairs of every tile is exact and vectorized (``dcp.masks.box_counts``): each KV range
of each query token adds its overlap with every KV block it spans, or, for masks of many ranges per
token, a cached bitmap index of the mask answers any block boundaries in O(tokens x blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dcp.errors import InvalidBatchError, InvalidConfigError
from dcp.masks.box_counts import box_counts
from dcp.spec import BatchSpec


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Token blocks (arrays indexed by token block id) and head blocks.

    ``tb_seq[b]``: sequence of block b; ``tb_start[b]``: first token, as a row of the packed batch;
    ``tb_len[b]``: tokens; ``seq_tb_ptr[s]:seq_tb_ptr[s+1]``: the blocks of sequence s, in token order.
    """

    tb_seq: np.ndarray
    tb_start: np.ndarray
    tb_len: np.ndarray
    seq_tb_ptr: np.ndarray
    head_block_size: int
    n_head_blocks: int
    kv_heads_per_block: int
    group_size: int = 1  # query heads per KV head (GQA)
    #: a grouped layout (``dcp.layout.pieces``): the ordinary layout of its pieces, and each piece's block
    pieces: "BlockLayout | None" = None
    piece_block: np.ndarray | None = None

    @property
    def grouped(self) -> bool:
        """Blocks are groups of pieces of several sequences (``dcp.layout.pieces``)."""
        return self.pieces is not None

    @property
    def n_token_blocks(self) -> int:
        return int(self.tb_len.size)

    def seq_bounds(self, seq: int) -> np.ndarray:
        """Block boundaries of sequence ``seq`` in local token positions: int64 ``[n_blocks + 1]``."""
        lo, hi = self.seq_tb_ptr[seq], self.seq_tb_ptr[seq + 1]
        first = self.tb_start[lo]
        return np.concatenate([self.tb_start[lo:hi] - first, [self.tb_start[hi - 1] + self.tb_len[hi - 1] - first]])

    def kv_head_range(self, hb: int) -> tuple[int, int]:
        """KV heads [lo, hi) read by head block ``hb``: from its first query head's KV head on (a head
        block smaller than a GQA group reads that group's single KV head)."""
        lo = hb * self.head_block_size // self.group_size
        return lo, lo + self.kv_heads_per_block


def head_blocking(spec: BatchSpec, head_block_size: int | None) -> tuple[int, int, int]:
    """(query heads per head block, number of head blocks, kv heads per head block)."""
    hqb = spec.num_heads if head_block_size is None else head_block_size
    g = spec.group_size
    if not isinstance(hqb, (int, np.integer)) or hqb <= 0 or spec.num_heads % hqb:
        raise InvalidConfigError(f"head_block_size={head_block_size} must be a positive divisor of "
                                 f"num_heads={spec.num_heads}")
    if hqb % g:
        # fewer query heads than one KV group per block: the KV head is replicated to each block
        if g % hqb:
            raise InvalidConfigError(f"head_block_size={hqb} must be a multiple or a divisor of the GQA "
                                     f"group size {g}")
        return int(hqb), spec.num_heads // hqb, 1
    return int(hqb), spec.num_heads // hqb, hqb // g


def uniform_cuts(seqlen: int, block_size: int) -> np.ndarray:
    """Boundaries ``[0, B, 2B, ..., seqlen]``: the last block keeps the remainder (no padding)."""
    return np.append(np.arange(0, seqlen, block_size, dtype=np.int64), seqlen)


def make_layout(spec: BatchSpec, bounds_per_seq: Sequence[np.ndarray], head_block_size: int | None) -> BlockLayout:
    """Layout from explicit block boundaries of every sequence (each ``[0, ..., seqlen]``, increasing)."""
    hqb, nhb, kvb = head_blocking(spec, head_block_size)
    cu = spec.cu_seqlens
    starts, lens, seqs, ptr = [], [], [], [0]
    for s, bounds in enumerate(bounds_per_seq):
        bounds = np.asarray(bounds, dtype=np.int64)
        if bounds[0] != 0 or bounds[-1] != spec.seqlens[s] or (np.diff(bounds) <= 0).any():
            raise InvalidConfigError(f"block boundaries of sequence {s} must increase from 0 to {spec.seqlens[s]}")
        starts.append(cu[s] + bounds[:-1])
        lens.append(np.diff(bounds))
        seqs.append(np.full(bounds.size - 1, s, dtype=np.int32))
        ptr.append(ptr[-1] + bounds.size - 1)
    return BlockLayout(np.concatenate(seqs), np.concatenate(starts), np.concatenate(lens).astype(np.int32),
                       np.asarray(ptr, dtype=np.int32), hqb, nhb, kvb, spec.group_size)


def uniform_layout(spec: BatchSpec, block_size: int, head_block_size: int | None = None) -> BlockLayout:
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size <= 0:
        raise InvalidConfigError(f"block_size must be a positive int, got {block_size!r}")
    return make_layout(spec, [uniform_cuts(n, block_size) for n in spec.seqlens], head_block_size)


@dataclass(frozen=True, eq=False)
class TileSet:
    """Computation blocks, arrays indexed by tile id (sorted by q block, head block, kv block).

    ``unmasked``: exact count of attended (q, kv) pairs per head; ``fwd_flops``/``bwd_flops``: FLOPs of the
    tile over its head block (forward 4·pairs·D·heads: QKᵀ and PV; backward 2.5× that: five matmuls).
    """

    q_tb: np.ndarray
    kv_tb: np.ndarray
    hb: np.ndarray
    unmasked: np.ndarray
    full: np.ndarray
    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    #: grouped tiles only (``dcp.layout.pieces``): sequences taking part, and the moments of their pairs
    sub_n: np.ndarray | None = None
    sub_wq: np.ndarray | None = None
    sub_wk: np.ndarray | None = None
    sub_wqk: np.ndarray | None = None

    @property
    def n_tiles(self) -> int:
        return int(self.q_tb.size)


def pair_counts(ranges_tr2: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Unmasked pair counts between the blocks of one sequence: int64 ``[n_blocks, n_blocks]`` (q, kv).

    Exact (``dcp.masks.box_counts``): one pass over the ranges for masks of few ranges per query; for
    masks of many (strided, dilated) a bitmap index of the mask, built once per ``BatchSpec`` array and
    cached, so that a planner trying dozens of layouts pays O(queries x blocks) per layout, not O(ranges).
    """
    return box_counts(ranges_tr2, bounds, bounds)


def tile_flops(spec: BatchSpec, layout: BlockLayout, unmasked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) FLOPs of tiles with ``unmasked`` pairs per head over a head block
    (``TileSet``: 4·pairs·D·heads, backward 2.5× that)."""
    fwd = 4.0 * unmasked * spec.head_dim * layout.head_block_size
    return fwd, 2.5 * fwd


def nothing_to_attend() -> InvalidBatchError:
    """The error of a batch whose masks leave no (query, key) pair."""
    return InvalidBatchError("the masks leave no (query, key) pair to attend in any sequence: nothing to plan")
