"""Shard blocks: token blocks made of contiguous *pieces* of several sequences.

A static baseline at hundreds of devices cuts every sequence into one chunk per device, so a 1M-token
batch of 137 sequences over 1,024 devices has 140K chunks and ~10^8 (q chunk, kv chunk) pairs -- far too
many rows for a plan. Real ring attention does not run them one by one: each device holds its chunk of
every sequence as one shard, sends the shard as one message per ring step, and runs one varlen kernel call
per step over all sequences. A *grouped* layout says exactly that: its token blocks (``BlockLayout``
with ``pieces`` set) are groups of pieces -- contiguous per-sequence blocks of an ordinary layout
(``pieces``) -- all homed on one device; a tile is a (q block, kv block, head block) triple of the
grouped blocks whose pieces share at least one attended pair, and its ``unmasked`` count is the sum over
sequences. Planners, the validator, the serializer and the simulator read grouped plans as they are; an
executor runs the equivalent plan over the pieces (``dcp.ir.expand``).

Grouped tiles carry, for the cost model, how many sequences take part (``sub_n``) and three moments of
their pairs: with p_s the attended pairs of sequence s in the tile and q_s / k_s its tokens in the q / kv
block, ``sub_wq`` = sum p_s / q_s, ``sub_wk`` = sum p_s / k_s, ``sub_wqk`` = sum p_s / (q_s k_s). The cost
model's efficiency is a product of q/(q + h_q) and k/(k + h_k), so the time of the per-sequence sub-tiles
(as the varlen call runs them), sum p_s (1 + h_q/q_s)(1 + h_k/k_s), follows from the moments exactly.

``grouped_pair_counts`` runs in C++ (``dcp._C.grouped_pair_counts``, csrc/pieces.cpp) when the extension
is built: q block by q block, with a difference array over the pieces of each sequence and one row of
block accumulators -- no pieces x pieces matrix per sequence (a 1M-token batch cut into 1,024 ring or
2,048 zigzag chunks per sequence takes well under a second). ``grouped_pair_counts_reference`` defines
the semantics; both give identical counts and moments (tests/test_pieces_native.py compares them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidConfigError
from dcp.layout.blocks import BlockLayout, TileSet, nothing_to_attend, tile_flops
from dcp.spec import BatchSpec

try:  # the C++ counts, when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE = hasattr(_C, "grouped_pair_counts")
except ImportError:
    _C, _NATIVE = None, False


@dataclass(frozen=True, eq=False)
class GroupedCounts:
    """Sparse counts between grouped blocks, sorted by (q block, kv block); one row per pair of blocks
    with at least one attended (q, kv) pair. ``unmasked``: attended pairs per head; ``area``: the sum over
    the sequences taking part of (their q tokens) x (their kv tokens) in the two blocks; ``sub_n``: those
    sequences; ``sub_wq``/``sub_wk``/``sub_wqk``: float64 moments (module docstring)."""

    q_block: np.ndarray
    kv_block: np.ndarray
    unmasked: np.ndarray
    area: np.ndarray
    sub_n: np.ndarray
    sub_wq: np.ndarray
    sub_wk: np.ndarray
    sub_wqk: np.ndarray


def check_grouping(pieces, piece_block: np.ndarray) -> tuple[np.ndarray, int]:
    """``piece_block`` as int64 with the number of grouped blocks; every block 0..n-1 must hold a piece."""
    pb = np.asarray(piece_block)
    if pb.ndim != 1 or pb.size != pieces.n_token_blocks or (pb.size and pb.dtype.kind not in "iu"):
        raise InvalidConfigError(f"piece_block must be one int per piece ({pieces.n_token_blocks}), got "
                                 f"shape {pb.shape} {pb.dtype}")
    pb = pb.astype(np.int64)
    n = int(pb.max()) + 1 if pb.size else 0
    if pb.size and (pb.min() < 0 or (np.bincount(pb, minlength=n) == 0).any()):
        raise InvalidConfigError("piece_block must name blocks 0..n-1, each holding at least one piece")
    return pb, n


def group_layout(pieces, piece_block: np.ndarray):
    """The grouped ``BlockLayout`` whose block b holds the pieces with ``piece_block == b``.

    Its ``tb_len`` is the block's tokens; ``tb_start`` its first piece's row; ``tb_seq`` is -1 (a block
    may span sequences) and ``seq_tb_ptr`` all zeros: per-sequence views go through ``pieces``."""
    if pieces.pieces is not None:
        raise InvalidConfigError("the pieces of a grouped layout must be an ordinary (ungrouped) layout")
    pb, n = check_grouping(pieces, piece_block)
    lens = np.bincount(pb, weights=pieces.tb_len, minlength=n).astype(np.int32)
    start = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(start, pb, pieces.tb_start.astype(np.int64))
    return BlockLayout(np.full(n, -1, dtype=np.int32), start, lens,
                       np.zeros(pieces.seq_tb_ptr.size, dtype=np.int32), pieces.head_block_size,
                       pieces.n_head_blocks, pieces.kv_heads_per_block, pieces.group_size,
                       pieces=pieces, piece_block=pb.astype(np.int32))


def grouped_pair_counts_reference(spec: BatchSpec, pieces, piece_block: np.ndarray) -> GroupedCounts:
    """``GroupedCounts`` sequence by sequence: ``dcp.layout.blocks.pair_counts`` between the pieces of each
    sequence, folded onto their blocks. Defines the semantics of the native path."""
    pb, n = check_grouping(pieces, piece_block)
    keys, cols, moments = [], [], []
    for seq in range(spec.num_seqs):
        lo, hi = int(pieces.seq_tb_ptr[seq]), int(pieces.seq_tb_ptr[seq + 1])
        counts = spec.block_pair_counts(seq, pieces.seq_bounds(seq))
        qi, ki = np.nonzero(counts)
        if qi.size == 0:
            continue
        blk = pb[lo:hi]
        # this sequence's tokens in each of its blocks
        seq_tokens = np.bincount(blk, weights=pieces.tb_len[lo:hi], minlength=n).astype(np.int64)
        key = blk[qi] * n + blk[ki]
        ukey, inv = np.unique(key, return_inverse=True)
        um = np.bincount(inv, weights=counts[qi, ki], minlength=ukey.size).astype(np.int64)
        qb, kb = ukey // n, ukey % n
        keys.append(ukey)
        tq, tk = seq_tokens[qb], seq_tokens[kb]
        cols.append(np.stack([um, tq * tk, np.ones_like(um)], axis=1))
        moments.append(np.stack([um / tq, um / tk, um / (tq * tk)], axis=1))
    if not keys:
        raise nothing_to_attend()
    key = np.concatenate(keys)
    ukey, inv = np.unique(key, return_inverse=True)
    vals = np.zeros((ukey.size, 3), dtype=np.int64)
    np.add.at(vals, inv, np.concatenate(cols))
    mom = np.zeros((ukey.size, 3), dtype=np.float64)
    np.add.at(mom, inv, np.concatenate(moments))
    return GroupedCounts((ukey // n).astype(np.int32), (ukey % n).astype(np.int32), *vals.T, *mom.T)


def grouped_pair_counts(spec: BatchSpec, pieces, piece_block: np.ndarray,
                        native: bool | None = None) -> GroupedCounts:
    """``GroupedCounts`` of a grouped layout, as ``grouped_pair_counts_reference`` defines them;
    ``native``: force (True) or forbid (False) the C++ path (None: use it when built)."""
    use = _NATIVE if native is None else native
    if not use:
        return grouped_pair_counts_reference(spec, pieces, piece_block)
    import torch

    pb, n = check_grouping(pieces, piece_block)
    ns = spec.num_seqs
    ranges = [spec.kv_ranges(seq) for seq in range(ns)]
    rows = np.array([r.shape[0] * r.shape[1] for r in ranges], dtype=np.int64)
    flat = np.concatenate([r.reshape(-1, 2) for r in ranges]) if ns else np.zeros((0, 2), dtype=np.int32)
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt))  # noqa: E731
    out = _C.grouped_pair_counts(
        t(pieces.seq_tb_ptr[:ns + 1], np.int64), t(pieces.tb_start, np.int64), t(pieces.tb_len, np.int64),
        t(pb, np.int64), int(n), t(flat, np.int32), t(np.concatenate([[0], np.cumsum(rows)]), np.int64),
        t([r.shape[1] for r in ranges], np.int64))
    q, kv, um, area, sub_n, wq, wk, wqk = (c.numpy() for c in out)
    if q.size == 0:
        raise nothing_to_attend()
    return GroupedCounts(q.astype(np.int32), kv.astype(np.int32), um, area, sub_n, wq, wk, wqk)


def enumerate_grouped_tiles(spec: BatchSpec, layout):
    """All non-empty tiles of a grouped layout, in ``enumerate_tiles`` order (q block, head block, kv
    block), with the grouped fields set."""
    c = grouped_pair_counts(spec, layout.pieces, layout.piece_block)
    nhb = layout.n_head_blocks
    # pairs are sorted by (q, kv): the q block's m pairs from s on become, in (q, hb, kv) order, its tiles
    # nhb*s + hb*m + j (pair s + j, head block hb) -- built directly, no sort
    n_pairs = c.q_block.size
    first = np.flatnonzero(np.r_[True, c.q_block[1:] != c.q_block[:-1]]) if n_pairs else np.zeros(0, np.int64)
    size = np.diff(np.r_[first, n_pairs])
    out = np.arange(n_pairs * nhb, dtype=np.int64)
    grp = np.repeat(np.arange(first.size), size * nhb)
    rel = out - nhb * first[grp]
    hb = (rel // size[grp]).astype(np.int32)
    pair = first[grp] + rel % size[grp]
    um = c.unmasked[pair]
    return TileSet(c.q_block[pair], c.kv_block[pair], hb, um, um == c.area[pair], *tile_flops(spec, layout, um),
                   sub_n=c.sub_n[pair].astype(np.int32), sub_wq=c.sub_wq[pair], sub_wk=c.sub_wk[pair],
                   sub_wqk=c.sub_wqk[pair])
