"""A tile table rewritten as a few fused *varlen* attention calls (flash-attention's packed interface).

Flash kernels take packed sequences (``cu_seqlens``) and one sliding window per call, aligned to the
bottom-right corner of each sequence: with ``n`` query rows and ``s`` keys, row ``t`` sees keys
``j`` with ``t + s - n - left <= j <= t + s - n + right`` (``-1`` = unbounded), clipped to ``[0, s)``.
A dcp tile's rows instead carry arbitrary key ranges. This module cuts every tile's rows into *pieces*
that are exactly such sequences, then groups the pieces by window into calls:

* full tiles of a q segment: one piece over all their keys (``window (-1, -1)``);
* a partial tile, per range slot, per run of rows whose range ends move by ``(dlo, dhi)`` in
  ``{0, 1}^2`` from row to row: ``(0, 0)`` full, ``(0, 1)`` causal ``(-1, 0)``, ``(1, 1)`` sliding
  ``(W - 1, 0)`` with ``W = hi - lo``, ``(1, 0)`` causal on reversed rows and keys; anything else (and
  single rows) ends the run.

So the call count of a table is the number of distinct windows (typically: full, causal, and one per
sliding-window width), independent of the tile count. Rows that appear in several pieces (a q block's
diagonal tile next to its full tiles, or a lambda mask's sink and window) are merged afterwards by
log-sum-exp. Everything here is index arithmetic in numpy on CPU tables; ``VarlenSchedule.to(device)``
moves the indices once and is cached.
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from dcp.kernels.tiles import TileTable

FULL = (-1, -1)
CAUSAL = (-1, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class VarlenCall:
    """One fused varlen call: ``n_seq`` packed sequences sharing one window.

    ``q_index [Nq]`` / ``k_index [Nk]`` (int64) pick the packed rows from the q / kv buffers;
    ``cu_q [n_seq+1]`` / ``cu_k [n_seq+1]`` (int32) are the packed sequence offsets;
    ``window = (left, right)`` in flash-attention's bottom-right convention.
    """

    window: tuple[int, int]
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    n_pairs: int  # (q row, key) pairs this call computes: its exact attention area

    @property
    def n_seq(self) -> int:
        return int(self.cu_q.numel()) - 1

    @property
    def causal(self) -> bool:
        return self.window == CAUSAL

    def to(self, device: torch.device) -> "VarlenCall":
        return dataclasses.replace(self, q_index=self.q_index.to(device), k_index=self.k_index.to(device),
                                   cu_q=self.cu_q.to(device), cu_k=self.cu_k.to(device))


@dataclasses.dataclass(frozen=True, eq=False)
class VarlenSchedule:
    """The calls of one tile table plus what the output merge needs.

    ``row_index [N]`` (int64) is the q-buffer row of every packed output row, calls concatenated in
    order; ``rows_unique`` says no row appears twice (then outputs are scattered, not merged).
    """

    calls: tuple[VarlenCall, ...]
    row_index: torch.Tensor
    rows_unique: bool
    tq: int
    tk: int

    @property
    def n_pairs(self) -> int:
        return sum(c.n_pairs for c in self.calls)

    def to(self, device: torch.device) -> "VarlenSchedule":
        if self.row_index.device == device:
            return self
        return dataclasses.replace(self, calls=tuple(c.to(device) for c in self.calls),
                                   row_index=self.row_index.to(device))


# ------------------------------------------------------------------------------------- pieces
@dataclasses.dataclass
class _Pieces:
    """Flat arrays over pieces (one entry each) and their key spans (several for merged full tiles)."""

    q_start: list = dataclasses.field(default_factory=list)   # first q-buffer row
    n: list = dataclasses.field(default_factory=list)         # rows
    left: list = dataclasses.field(default_factory=list)
    right: list = dataclasses.field(default_factory=list)
    reverse: list = dataclasses.field(default_factory=list)   # rows and keys in reverse order
    span_piece: list = dataclasses.field(default_factory=list)
    span_start: list = dataclasses.field(default_factory=list)
    span_len: list = dataclasses.field(default_factory=list)

    def cat(self) -> dict[str, np.ndarray]:
        return {f.name: (np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in getattr(self, f.name)])
                         if getattr(self, f.name) else np.zeros(0, np.int64))
                for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class _TableArrays:
    """The table's int32 fields as int64 numpy arrays, plus each tile's segment and each segment's rows."""

    cu: np.ndarray
    k0: np.ndarray
    kl: np.ndarray
    mr: np.ndarray
    seg_of_tile: np.ndarray
    seg_len: np.ndarray

    @classmethod
    def of(cls, table: TileTable) -> "_TableArrays":
        cu = table.seg_cu.numpy().astype(np.int64)
        ptr = table.seg_tile_ptr.numpy().astype(np.int64)
        return cls(cu, table.tile_k_start.numpy().astype(np.int64), table.tile_k_len.numpy().astype(np.int64),
                   table.tile_mask_row.numpy().astype(np.int64),
                   np.repeat(np.arange(table.n_segments), np.diff(ptr)), np.diff(cu))


def _full_pieces(a: _TableArrays, out: _Pieces, base: int) -> int:
    """One piece per q segment over all its full tiles' keys. Returns the number of pieces added."""
    cu, k0, kl, seg_of_tile = a.cu, a.k0, a.kl, a.seg_of_tile
    full = np.flatnonzero((a.mr < 0) & (kl > 0))
    full = full[a.seg_len[seg_of_tile[full]] > 0]
    if full.size == 0:
        return 0
    segs, piece_of_tile = np.unique(seg_of_tile[full], return_inverse=True)
    m = segs.size
    out.q_start.append(cu[segs])
    out.n.append(cu[segs + 1] - cu[segs])
    out.left.append(np.full(m, -1))
    out.right.append(np.full(m, -1))
    out.reverse.append(np.zeros(m, np.int64))
    out.span_piece.append(base + piece_of_tile)
    out.span_start.append(k0[full])
    out.span_len.append(kl[full])
    return m


def _partial_pieces(table: TileTable, a: _TableArrays, out: _Pieces, base: int) -> int:
    """Pieces of the partial tiles (module docstring). Returns the number of pieces added."""
    cu, k0, mr, seg_of_tile = a.cu, a.k0, a.mr, a.seg_of_tile
    partial = np.flatnonzero(mr >= 0)
    if partial.size == 0 or table.max_ranges == 0:
        return 0
    q_len = a.seg_len[seg_of_tile[partial]]
    partial, q_len = partial[q_len > 0], q_len[q_len > 0]
    if partial.size == 0:
        return 0
    tile_of_row = np.repeat(np.arange(partial.size), q_len)            # index into `partial`
    local = np.arange(int(q_len.sum())) - np.repeat(np.cumsum(q_len) - q_len, q_len)
    ranges = _disjoint(table.mask_ranges.numpy()[mr[partial][tile_of_row] + local].astype(np.int64))
    q_row = cu[seg_of_tile[partial]][tile_of_row] + local
    key0 = k0[partial][tile_of_row]
    first = local == 0
    added = 0
    for r in range(ranges.shape[1]):
        lo = ranges[:, r, 0] + key0
        hi = ranges[:, r, 1] + key0
        live = hi > lo
        dlo = np.diff(lo, prepend=0)
        dhi = np.diff(hi, prepend=0)
        prev_live = np.concatenate([[False], live[:-1]])
        ok = live & prev_live & ~first & (dlo >= 0) & (dlo <= 1) & (dhi >= 0) & (dhi <= 1)
        code = np.where(ok, dlo * 2 + dhi, -1)                             # code of transition j-1 -> j
        prev_code = np.concatenate([[-1], code[:-1]])
        # row j continues row j-1's piece if the step is valid and either row j-1 opened the piece
        # (its own incoming step is not valid) or both steps have one pattern
        cont = ok & ((prev_code < 0) | (prev_code == code))
        starts = np.flatnonzero(live & ~cont)
        if starts.size == 0:
            continue
        # a piece ends (exclusive) at the next row that does not continue it
        brk = np.flatnonzero(~cont)
        nxt = np.searchsorted(brk, starts, side="right")
        ends = np.where(nxt < brk.size, brk[np.minimum(nxt, brk.size - 1)], lo.size)
        n = ends - starts
        pat = np.where(n > 1, code[np.minimum(starts + 1, lo.size - 1)], 0)  # singles are full pieces
        lo0, hi0, hi1 = lo[starts], hi[starts], hi[ends - 1]
        m = starts.size
        out.q_start.append(q_row[starts])
        out.n.append(n)
        out.left.append(np.where(pat == 3, hi0 - lo0 - 1, -1))
        out.right.append(np.where(pat == 0, -1, 0))
        out.reverse.append((pat == 2).astype(np.int64))
        out.span_piece.append(base + added + np.arange(m))
        out.span_start.append(lo0)
        out.span_len.append(np.where((pat == 1) | (pat == 3), hi1 - lo0, hi0 - lo0))
        added += m
    return added


def _disjoint(ranges: np.ndarray) -> np.ndarray:
    """Rewrite each row's ``R`` key ranges ``[rows, R, 2]`` as disjoint ones sorted by start (a table's
    ranges may overlap and mean their union; a piece per slot would count shared keys twice).
    Touching ranges are joined; freed slots become ``(0, 0)``."""
    if ranges.shape[1] == 1:
        return ranges
    big = np.iinfo(np.int64).max
    empty = ranges[..., 1] <= ranges[..., 0]
    start = np.where(empty, big, ranges[..., 0])
    end = np.where(empty, -1, ranges[..., 1])
    order = np.argsort(start, axis=1, kind="stable")
    start = np.take_along_axis(start, order, axis=1)
    end = np.take_along_axis(end, order, axis=1)
    reach = np.maximum.accumulate(end, axis=1)                     # furthest end so far
    before = np.concatenate([np.full((start.shape[0], 1), -1), reach[:, :-1]], axis=1)
    opens = (start < big) & (start > before)                       # slot opens a new disjoint range
    r = start.shape[1]
    # a group's end is the reach just before the next opening slot (or at the last slot)
    pos = np.where(opens, np.arange(r)[None, :], r)
    next_open = np.minimum.accumulate(pos[:, ::-1], axis=1)[:, ::-1]  # first opening slot at or after j
    nxt = np.concatenate([next_open[:, 1:], np.full((start.shape[0], 1), r)], axis=1)
    group_end = np.take_along_axis(reach, nxt - 1, axis=1)
    out = np.zeros_like(ranges)
    out[..., 0] = np.where(opens, start, 0)
    out[..., 1] = np.where(opens, group_end, 0)
    return out


def _expand(starts: np.ndarray, lens: np.ndarray, reverse: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + l)`` (reversed where ``reverse``) for every span."""
    total = int(lens.sum())
    offs = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    rev = np.repeat(reverse.astype(bool), lens)
    ln = np.repeat(lens, lens)
    return np.repeat(starts, lens) + np.where(rev, ln - 1 - offs, offs)


def build_schedule(table: TileTable, tq: int, tk: int) -> VarlenSchedule:
    """Rewrite ``table`` (already validated against ``tq`` q rows and ``tk`` keys) as varlen calls."""
    acc = _Pieces()
    arrays = _TableArrays.of(table)
    n_full = _full_pieces(arrays, acc, 0)
    _partial_pieces(table, arrays, acc, n_full)
    p = acc.cat()
    n_pieces = p["n"].size
    calls, rows = [], []
    if n_pieces:
        # a reversed piece reverses its keys too; keys of a piece (one span unless merged full tiles)
        span_rev = p["reverse"][p["span_piece"]]
        key_len = np.bincount(p["span_piece"], weights=p["span_len"], minlength=n_pieces).astype(np.int64)
        windows = np.stack([p["left"], p["right"]], axis=1)
        uniq, call_of_piece = np.unique(windows, axis=0, return_inverse=True)
        call_of_piece = call_of_piece.reshape(-1)
        for c, (left, right) in enumerate(uniq.tolist()):
            pieces = np.flatnonzero(call_of_piece == c)
            n, sk = p["n"][pieces], key_len[pieces]
            q_index = _expand(p["q_start"][pieces], n, p["reverse"][pieces])
            spans = np.flatnonzero(np.isin(p["span_piece"], pieces))
            # spans are grouped by piece already in piece order (pieces are numbered in span order)
            k_index = _expand(p["span_start"][spans], p["span_len"][spans], span_rev[spans])
            if left == -1 and right == -1:
                pairs = int((n * sk).sum())
            else:
                pairs = int(_window_pairs(n, sk, left, right).sum())
            calls.append(VarlenCall(
                window=(int(left), int(right)),
                q_index=torch.from_numpy(q_index), k_index=torch.from_numpy(k_index),
                cu_q=torch.from_numpy(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)),
                cu_k=torch.from_numpy(np.concatenate([[0], np.cumsum(sk)]).astype(np.int32)),
                max_q=int(n.max()), max_k=int(sk.max()), n_pairs=pairs))
            rows.append(q_index)
    row_index = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    unique = np.unique(row_index).size == row_index.size
    return VarlenSchedule(tuple(calls), torch.from_numpy(row_index), bool(unique), int(tq), int(tk))


def _window_pairs(n: np.ndarray, sk: np.ndarray, left: int, right: int) -> np.ndarray:
    """Attended (row, key) pairs per sequence under a bottom-right window (exact, vectorized)."""
    t = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    d = np.repeat(sk - n, n)
    s = np.repeat(sk, n)
    lo = np.zeros_like(t) if left < 0 else np.maximum(0, t + d - left)
    hi = s if right < 0 else np.minimum(s, t + d + right + 1)
    return np.bincount(np.repeat(np.arange(n.size), n), weights=np.maximum(hi - lo, 0), minlength=n.size)


_CACHE: "weakref.WeakKeyDictionary[TileTable, dict]" = weakref.WeakKeyDictionary()


def schedule_for(table: TileTable, tq: int, tk: int, device: torch.device) -> VarlenSchedule:
    """The (cached) schedule of ``table`` with its indices on ``device``.

    Tables are immutable values owned by a plan, so the cache lives as long as the table.
    """
    per_table = _CACHE.setdefault(table, {})
    key = (int(tq), int(tk))
    base = per_table.get(key)
    if base is None:
        base = per_table[key] = build_schedule(table, tq, tk)
    dkey = (key, str(device))
    got = per_table.get(dkey)
    if got is None:
        got = per_table[dkey] = base.to(device)
    return got
