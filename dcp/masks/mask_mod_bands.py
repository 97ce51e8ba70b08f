"""Assembling a blockwise mask_mod evaluation into KV ranges, one row *band* (stripe) at a time.

The blockwise evaluation (``dcp.masks.mask_mod_blocks``) classifies the coarse blocks of a band of rows.
Every coarse block it can decide for the whole band — empty, full, or a *pattern* whose columns are each
constant over the band's rows (a strided or dilated mask, ``kv % 8 == 0``, far from the diagonal) — leaves
the same keys in every row of the band. Those columns form the band's *shared* state; the columns of
the coarse blocks that had to be split *vary* by row, and their keys come as per-row segments (sub-block
squares and patterns, exact leaf runs).

A row's ranges are then the maximal runs of the shared columns, which every row of the band holds, plus
its own ranges over the varying columns. Shared runs that touch a varying column could merge with a
row's own range, so they are handed to every row as segments too; the others never touch anything and are
written once per band by broadcasting — without a per-row copy, a sort or a scatter of what may be
thousands of ranges per row (4,025 for ``causal & (window | sink | kv % 8 == 0)`` on 32K tokens).

``Band`` holds what a band writes; ``write_bands`` allocates the output once, at its final width.
``bands_index`` builds the same mask's ``dcp.masks.box_counts.RangesIndex`` from the bands at little cost
(shared columns are one bit row broadcast over the band), so that planning on a mask of many ranges need
not rebuild it from the ranges.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.masks.box_counts import WORD, RangesIndex, keys_before_words, paint_bits

SHARED_EMPTY, SHARED_FULL, VARIES = 0, 1, 2


@dataclass(frozen=True, eq=False)
class Band:
    """The ranges of rows ``s0 .. s1`` (exclusive). Shared runs, int32 ``[*, 2]``: ``head`` sits in slots
    ``0 .. len(head)-1`` of every row; ``tail`` follows it in the rows ``tail_rows`` (int64), shifted right
    by ``tail_shift`` (int64: the row's own ranges, which all come before it). Everything else — the rows'
    own ranges, and the tail in rows where own ranges fall inside it — is ``row``/``slot``/``start``/``end``
    (int64 ``[n]``). ``counts`` int64 ``[s1 - s0]``: ranges per row. ``shared_full`` bool ``[L]`` and
    ``own`` (rows, starts, ends of the own ranges, merged and sorted) describe the band's keys for
    ``bands_index``."""

    s0: int
    s1: int
    head: np.ndarray
    tail: np.ndarray
    tail_rows: np.ndarray
    tail_shift: np.ndarray
    row: np.ndarray
    slot: np.ndarray
    start: np.ndarray
    end: np.ndarray
    counts: np.ndarray
    shared_full: np.ndarray
    own: tuple[np.ndarray, np.ndarray, np.ndarray]


def _runs(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of True in a bool vector: (starts, ends) int64."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], flags, [False]]).astype(np.int8)))
    return edges[0::2], edges[1::2]


def sort_segments(row_off: np.ndarray, start: np.ndarray, seqlen: int, cell: int) -> np.ndarray:
    """Order of segments by (row, start), for segments that are sorted by start within every (row, cell)
    where ``cell`` groups ``cell`` consecutive keys (the generators emit them so). Two stable radix sorts
    on 16-bit keys (cell, then row) where the keys fit; else one comparison sort."""
    n_cells = -(-seqlen // cell)
    if n_cells <= 1 << 16 and (row_off.size == 0 or int(row_off.max()) < 1 << 16):
        by_cell = np.argsort((start // cell).astype(np.uint16), kind="stable")
        return by_cell[np.argsort(row_off[by_cell].astype(np.uint16), kind="stable")]
    return np.argsort(row_off * (seqlen + 1) + start, kind="stable")


def assemble_band(seqlen: int, s0: int, s1: int, shared: np.ndarray, row: np.ndarray, start: np.ndarray,
                  end: np.ndarray, cell: int) -> Band:
    """The ``Band`` of rows ``s0 .. s1`` from the shared column states (int8 ``[L]``: SHARED_EMPTY,
    SHARED_FULL or VARIES) and the per-row segments over the varying columns (int64 ``[n]`` each, sorted
    by start within each (row, ``cell``-key cell), touching allowed)."""
    rows = s1 - s0
    full = shared == SHARED_FULL
    runs_s, runs_e = _runs(full)
    varies = shared == VARIES
    touching = (varies[np.minimum(runs_e, seqlen - 1)] & (runs_e < seqlen)) | \
        (varies[np.maximum(runs_s - 1, 0)] & (runs_s > 0))
    # shared runs next to a varying column become every row's own segments (they may merge there)
    t_s, t_e = runs_s[touching], runs_e[touching]
    keep_s, keep_e = runs_s[~touching], runs_e[~touching]
    if t_s.size:
        band_rows = np.arange(s0, s1, dtype=np.int64)
        row = np.concatenate([row, np.repeat(band_rows, t_s.size)])
        start = np.concatenate([start, np.tile(t_s, rows)])
        end = np.concatenate([end, np.tile(t_e, rows)])
    order = sort_segments(row - s0, start, seqlen, cell)
    row, start, end = row[order], start[order], end[order]
    new = np.ones(row.size, dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], row.size)[: first.size] - 1
    v_row, v_start, v_end = row[first], start[first], end[last]
    own = (v_row, v_start, v_end)
    v_off = v_row - s0
    own_counts = np.bincount(v_off, minlength=rows)
    rank = np.arange(v_row.size) - np.repeat(np.cumsum(own_counts) - own_counts, own_counts)
    m = keep_s.size
    # a row's own range v follows the shared runs that start before it
    before = np.searchsorted(keep_s, v_start)
    v_slot = before + rank
    # shared runs 0 .. a-1 precede every own range of every row: the same slots in all rows
    a = int(before[rank == 0].min()) if v_row.size else m
    runs = np.stack([keep_s, keep_e], axis=1).astype(np.int32)
    tail_rows = tail_shift = np.zeros(0, dtype=np.int64)
    if a < m:
        # rows whose own ranges all come before shared run a hold the rest shifted by their count
        ends_at = np.cumsum(own_counts) - 1
        last_before = np.where(own_counts > 0, before[np.maximum(ends_at, 0)], -1)
        simple = last_before <= a
        tail_rows, tail_shift = s0 + np.flatnonzero(simple), own_counts[simple]
        hard = np.flatnonzero(~simple)
        if hard.size:  # the others: slot j + (own ranges of the row before shared run j)
            width = m - a + 1
            pick = np.isin(v_off, hard)
            local = np.searchsorted(hard, v_off[pick])
            cnt = np.cumsum(np.bincount(local * width + (before[pick] - a), minlength=hard.size * width)
                            .reshape(hard.size, width), axis=1)[:, :-1]
            j = np.arange(a, m, dtype=np.int64)
            v_row = np.concatenate([v_row, np.repeat(s0 + hard, m - a)])
            v_slot = np.concatenate([v_slot, (j[None, :] + cnt).reshape(-1)])
            v_start = np.concatenate([v_start, np.tile(keep_s[a:], hard.size)])
            v_end = np.concatenate([v_end, np.tile(keep_e[a:], hard.size)])
    return Band(s0, s1, runs[:a], runs[a:], tail_rows, tail_shift, v_row, v_slot, v_start, v_end,
                own_counts + m, full, own)


def write_bands(seqlen: int, bands: list[Band]) -> np.ndarray:
    """The KV ranges ``[L, R, 2]`` int32 of bands that cover rows ``0 .. L``; ``R`` is the most ranges of a
    row (at least 1). Allocated once, zeroed lazily by the OS, so pages of padding stay untouched."""
    slots = max([1] + [int(b.counts.max()) for b in bands if b.counts.size])
    out = np.zeros((seqlen, slots, 2), dtype=np.int32)
    pairs = out.view(np.int64).reshape(-1)  # one int64 per (start, end) pair: one scatter writes both
    for b in bands:
        a, t = b.head.shape[0], b.tail.shape[0]
        if a:
            out[b.s0: b.s1, :a] = b.head[None]
        if t and b.tail_rows.size:
            for shift in np.unique(b.tail_shift).tolist():  # rows of one shift: one block write
                rows = b.tail_rows[b.tail_shift == shift]
                out[rows, a + shift: a + shift + t] = b.tail[None]
        if b.row.size:
            packed = np.empty((b.row.size, 2), dtype=np.int32)
            packed[:, 0], packed[:, 1] = b.start, b.end
            pairs[b.row * slots + b.slot] = packed.view(np.int64).reshape(-1)
    return out


def bands_index(seqlen: int, bands: list[Band], used_ranges: int) -> RangesIndex:
    """The ``RangesIndex`` of the mask the bands write (see ``dcp.masks.box_counts``)."""
    n_words = seqlen // WORD + 1
    bits = np.zeros((n_words, seqlen), dtype=np.uint64)
    shared = np.zeros(n_words * WORD, dtype=bool)
    for b in bands:
        shared[:seqlen] = b.shared_full
        bits[:, b.s0: b.s1] = np.packbits(shared, bitorder="little").view(np.uint64)[:, None]
        if b.own[0].size:  # sorted, disjoint; where they cover shared full columns, OR-ing changes nothing
            paint_bits(bits, *b.own)
    return RangesIndex(bits, keys_before_words(bits), used_ranges)


def bands_profile(seqlen: int, bands: list[Band]) -> tuple[np.ndarray, np.ndarray]:
    """``dcp.masks.box_counts.range_profile`` of the mask the bands write, without reading it: (keys per
    query int64 ``[L]``, ranges starting or ending at each key int64 ``[L + 1]``)."""
    work = np.zeros(seqlen, dtype=np.int64)
    at, times = [], []  # range edges, and how many rows hold each
    for b in bands:
        for runs, holders in ((b.head, slice(b.s0, b.s1)), (b.tail, b.tail_rows)):
            if runs.size:
                s, e = runs[:, 0].astype(np.int64), runs[:, 1].astype(np.int64)
                work[holders] += int((e - s).sum())
                n_rows = b.s1 - b.s0 if isinstance(holders, slice) else holders.size
                at += [s, e]
                times += [np.full(2 * s.size, n_rows, dtype=np.float64)]
        if b.row.size:
            work[b.s0: b.s1] += np.bincount(b.row - b.s0, weights=b.end - b.start,
                                            minlength=b.s1 - b.s0).astype(np.int64)
            at += [b.start, b.end]
            times += [np.ones(2 * b.row.size)]
    if not at:
        return work, np.zeros(seqlen + 1, dtype=np.int64)
    edges = np.bincount(np.concatenate(at), weights=np.concatenate(times), minlength=seqlen + 1)
    return work, np.rint(edges).astype(np.int64)  # float weights: exact below 2**53
