"""The computation blocks of a batch: every non-empty tile under a layout, uniform or grouped.

Takes a ``BatchSpec`` and a ``BlockLayout`` (``dcp.layout.blocks``), returns a ``TileSet``; grouped layouts
(pieces of several sequences sharing a block) are counted by ``dcp.layout.pieces``.
"""
from __future__ import annotations

import numpy as np

from dcp.layout.blocks import BlockLayout, TileSet, nothing_to_attend, tile_flops
from dcp.layout.pieces import enumerate_grouped_tiles
from dcp.spec import BatchSpec


def enumerate_tiles(spec: BatchSpec, layout: BlockLayout) -> TileSet:
    """All non-empty tiles of the batch under ``layout`` (grouped layouts: ``dcp.layout.pieces``)."""
    if layout.grouped:
        return enumerate_grouped_tiles(spec, layout)
    q_parts, k_parts, c_parts = [], [], []
    for seq in range(spec.num_seqs):
        bounds = layout.seq_bounds(seq)
        counts = spec.block_pair_counts(seq, bounds)
        qi, ki = np.nonzero(counts)
        base = layout.seq_tb_ptr[seq]
        q_parts.append(qi + base)
        k_parts.append(ki + base)
        c_parts.append(counts[qi, ki])
    q_tb = np.concatenate(q_parts).astype(np.int32)
    kv_tb = np.concatenate(k_parts).astype(np.int32)
    unmasked = np.concatenate(c_parts)
    if q_tb.size == 0:
        raise nothing_to_attend()
    full = unmasked == layout.tb_len[q_tb].astype(np.int64) * layout.tb_len[kv_tb]
    nhb = layout.n_head_blocks
    # expand over head blocks: tile id = (pair index) * nhb + hb keeps (q block, hb, kv block) grouping
    # per q block because pairs are sorted by q block already
    order = np.lexsort((kv_tb, q_tb))
    q_tb, kv_tb, unmasked, full = q_tb[order], kv_tb[order], unmasked[order], full[order]
    n_pairs = q_tb.size
    hb = np.tile(np.arange(nhb, dtype=np.int32), n_pairs)
    rep = lambda a: np.repeat(a, nhb)  # noqa: E731
    q_rep, kv_rep, um_rep, full_rep = rep(q_tb), rep(kv_tb), rep(unmasked), rep(full)
    # regroup to (q block, head block, kv block) order
    order = np.lexsort((kv_rep, hb, q_rep))
    q_rep, kv_rep, hb, um_rep, full_rep = q_rep[order], kv_rep[order], hb[order], um_rep[order], full_rep[order]
    return TileSet(q_rep, kv_rep, hb, um_rep, full_rep, *tile_flops(spec, layout, um_rep))
