"""Blockwise evaluation of a mask_mod: bounds for whole blocks, exact values only where they are needed.

For a sequence of L tokens the (query, key) square is cut into row *stripes* of C rows (C a power of two,
about L / 64) and each stripe into C x C blocks. Each block is classified by one abstract call of the
mask_mod (``dcp.masks.bounds``): *full* (allowed on every pair), *empty* (masked on every pair) or
*partial* (anything else, including every block the bounds refuse to follow). Partial blocks are split
into four and classified again, down to ``leaf`` x ``leaf`` blocks, whose pairs are then evaluated exactly
with concrete index arrays. A stripe's KV ranges are assembled from the full blocks and the exact values
of the partial leaves, without any dense copy of the stripe: every full block contributes one segment
per row, every exact leaf row its runs of True (found from transitions), and touching segments of a row
are merged (``segments_to_ranges``).

Exactness rests on the bounds being sound (see ``dcp.masks.bounds``): a block is skipped only when they
prove the mask_mod constant on it. Concrete evaluations here pass ``q_idx`` of shape ``[P, s, 1]`` and
``kv_idx`` of shape ``[P, 1, s]`` (P leaves of s x s pairs at once) — fine for any mask_mod the bounds
could follow, since they refuse every shape-dependent operation (indexing a traced value, ``len``, ...).

``dense_ranges`` is the fallback for a mask_mod the bounds refuse outright: every pair, evaluated in row
chunks of ``q_idx [h, 1]`` against ``kv_idx [1, L]`` as the reference path does, encoded by transitions
into preallocated buffers.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dcp.masks.bounds import INT64, BoolBounds, Bounds, IntBounds, Refused, Trace, lift, truth
from dcp.masks.bounds_lookup import TableCache

EMPTY, FULL, PARTIAL = 0, 1, 2
#: pairs evaluated exactly per concrete call (bounds the predicate's temporaries)
FINE_CHUNK = 1 << 22
#: blocks per abstract call (bounds the arrays of the traced operations)
BLOCK_CHUNK = 1 << 16
#: stripes per sequence the coarse block size aims at
TARGET_STRIPES = 64


@dataclass
class BlockStats:
    """What a blockwise evaluation did: blocks classified per outcome, pairs evaluated exactly, calls."""

    seqlen: int = 0
    coarse: int = 0
    leaf: int = 0
    full_blocks: int = 0
    empty_blocks: int = 0
    partial_leaves: int = 0
    refused_calls: int = 0
    abstract_calls: int = 0
    exact_calls: int = 0
    exact_pairs: int = 0
    fallback: str | None = None  # why every pair was evaluated (the bounds refused the mask_mod)
    refusals: list[str] = field(default_factory=list)

    @property
    def exact_fraction(self) -> float:
        """Share of the L x L pairs the mask_mod was evaluated on concretely."""
        return self.exact_pairs / float(self.seqlen) ** 2 if self.seqlen else 0.0


# ----------------------------------------------------------------------------------------------------
# encoding: runs of True per row, segments merged into padded KV ranges
# ----------------------------------------------------------------------------------------------------

class RunWork:
    """Preallocated buffers of ``runs_numpy`` for chunks of up to ``rows`` x ``width`` (reused, so the
    dense loop does not allocate two fresh row-chunk-sized arrays per chunk)."""

    def __init__(self, rows: int, width: int):
        self.padded = np.zeros((rows, width + 2), dtype=bool)
        self.edges = np.empty((rows, width + 1), dtype=bool)


def _edges_to_runs(edges: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # flat positions of the transitions of the zero-padded rows: each row holds an even number, in order
    # start, end, start, end, ... so starts and ends alternate in the flat, row-major list
    row, col = np.divmod(edges, width + 1)
    return row[0::2], col[0::2], col[1::2]


def runs_numpy(allowed_nw: np.ndarray, work: RunWork | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of True in each row of a boolean ``[N, W]`` array: ``(row, start, end)`` int64 ``[runs]``,
    sorted by row then start, ``end`` exclusive. ``work`` (at least N x W) avoids fresh buffers."""
    n, w = allowed_nw.shape
    if work is None or work.padded.shape[0] < n or work.padded.shape[1] != w + 2:
        work = RunWork(n, w)
    padded, edges = work.padded[:n], work.edges[:n]
    padded[:, 1:-1] = allowed_nw  # the border columns stay False
    np.not_equal(padded[:, 1:], padded[:, :-1], out=edges)
    return _edges_to_runs(np.flatnonzero(edges), w)


def runs_torch(allowed_nw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``runs_numpy`` for a torch bool tensor on any device: transitions found there, only they are copied."""
    import torch

    n, w = allowed_nw.shape
    padded = torch.zeros((n, w + 2), dtype=torch.bool, device=allowed_nw.device)
    padded[:, 1:-1] = allowed_nw
    edges = torch.nonzero((padded[:, 1:] != padded[:, :-1]).reshape(-1)).reshape(-1)
    return _edges_to_runs(edges.cpu().numpy().astype(np.int64), w)


def segments_to_ranges(row: np.ndarray, start: np.ndarray, end: np.ndarray, seqlen: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge disjoint segments ``[start, end)`` of rows into maximal ranges: ``(row, slot, start, end)``
    of each range, ``slot`` its rank within its row. Segments may come in any order; touching ones of
    a row merge. All arrays int64 ``[segments]`` in, ``[ranges]`` out."""
    if row.size == 0:
        return row, row, row, row
    order = np.argsort(row * (seqlen + 1) + start, kind="stable")
    row, start, end = row[order], start[order], end[order]
    new = np.ones(row.size, dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], row.size) - 1
    r_row = row[first]
    # slot within the row: the range's rank minus the rank of its row's first range
    row_first = np.flatnonzero(np.append(True, r_row[1:] != r_row[:-1]))
    counts = np.diff(np.append(row_first, r_row.size))
    slot = np.arange(r_row.size) - np.repeat(row_first, counts)
    return r_row, slot, start[first], end[last]


class RangesBuffer:
    """The output ``[L, R, 2]`` int32, written stripe by stripe; R grows (one reallocation per doubling)
    when a stripe needs more slots, so per-stripe results are never kept around."""

    def __init__(self, seqlen: int, slots: int = 1):
        self.ranges = np.zeros((seqlen, slots, 2), dtype=np.int32)
        self.used = 1

    def write(self, row: np.ndarray, slot: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        if slot.size == 0:
            return
        need = int(slot.max()) + 1
        if need > self.ranges.shape[1]:
            grown = np.zeros((self.ranges.shape[0], max(need, 2 * self.ranges.shape[1]), 2), dtype=np.int32)
            grown[:, : self.ranges.shape[1]] = self.ranges
            self.ranges = grown
        self.used = max(self.used, need)
        self.ranges[row, slot, 0] = start
        self.ranges[row, slot, 1] = end

    def result(self) -> np.ndarray:
        return np.ascontiguousarray(self.ranges[:, : self.used])


def release_free_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere). Chunk-sized
    temporaries that land on the brk heap otherwise stay resident behind small live allocations."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


# ----------------------------------------------------------------------------------------------------
# classification (abstract) and exact evaluation (concrete)
# ----------------------------------------------------------------------------------------------------

def classify(fn: Callable, nargs: int, q_lo: np.ndarray, q_hi: np.ndarray, kv_lo: np.ndarray,
             kv_hi: np.ndarray, tables: TableCache) -> np.ndarray:
    """Status (EMPTY / FULL / PARTIAL) int8 ``[P]`` of the blocks ``q_lo..q_hi`` x ``kv_lo..kv_hi``
    (inclusive int64 ``[P]``) from one abstract call of ``fn``; raises ``Refused`` (with the reason)."""
    trace = Trace(q_lo.size, tables)
    q, kv = IntBounds(q_lo, q_hi, trace, INT64), IntBounds(kv_lo, kv_hi, trace, INT64)
    try:
        if nargs == 4:
            zero = IntBounds(np.int64(0), np.int64(0), trace, INT64)
            out = fn(zero, zero, q, kv)
        else:
            out = fn(q, kv)
        if trace.refused is None:
            result = truth(out) if isinstance(out, Bounds) else lift(out, trace)
            if not isinstance(result, BoolBounds):
                result = truth(result)
    except Exception as exc:  # noqa: BLE001 - any failure on bounds means: evaluate exactly
        if trace.refused is None:
            trace.refused = f"{type(exc).__name__}: {exc}"
    if trace.refused is not None:
        raise Refused(trace.refused)
    can_true = np.broadcast_to(result.can_true, q_lo.shape)
    can_false = np.broadcast_to(result.can_false, q_lo.shape)
    status = np.where(can_true, FULL, EMPTY).astype(np.int8)
    status[(can_true & can_false) | trace.force] = PARTIAL
    return status


def _leaf_indices(q0: np.ndarray, k0: np.ndarray, size: int, seqlen: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Index arrays of P leaves of ``size`` x ``size``: ``q [P, s, 1]``, ``kv [P, 1, s]`` (clipped to the
    sequence; the clipped copies are masked out by ``valid_q [P, s, 1]`` / ``valid_kv [P, 1, s]``)."""
    offs = np.arange(size, dtype=np.int64)
    q = q0[:, None, None] + offs[None, :, None]
    kv = k0[:, None, None] + offs[None, None, :]
    return np.minimum(q, seqlen - 1), np.minimum(kv, seqlen - 1), q < seqlen, kv < seqlen


class BlockEvaluator:
    """Blockwise KV ranges of one mask_mod for one length (see the module docstring).

    ``concrete(q_idx, kv_idx)`` evaluates the mask_mod on index arrays and returns a boolean NumPy array
    of their broadcast shape, or a torch bool tensor when it runs on an accelerator.
    """

    def __init__(self, fn: Callable, nargs: int, seqlen: int, concrete: Callable, leaf: int = 16,
                 coarse: int | None = None):
        self.fn, self.nargs, self.seqlen = fn, nargs, seqlen
        self.concrete = concrete
        self.leaf = leaf
        if coarse is None:
            coarse = 1 << int(np.ceil(np.log2(max(1, -(-seqlen // TARGET_STRIPES)))))
        self.coarse = max(leaf, coarse)
        self.tables = TableCache()
        self.stats = BlockStats(seqlen=seqlen, coarse=self.coarse, leaf=leaf)

    # --- abstract
    def _classify(self, q0: np.ndarray, k0: np.ndarray, size: int) -> np.ndarray:
        status = np.empty(q0.size, dtype=np.int8)
        last = self.seqlen - 1
        for a in range(0, q0.size, BLOCK_CHUNK):
            qs, ks = q0[a: a + BLOCK_CHUNK], k0[a: a + BLOCK_CHUNK]
            self.stats.abstract_calls += 1
            try:
                status[a: a + qs.size] = classify(self.fn, self.nargs, qs, np.minimum(qs + size - 1, last), ks,
                                                  np.minimum(ks + size - 1, last), self.tables)
            except Refused as why:
                if self.stats.abstract_calls == 1:
                    raise  # the very first call: the mask_mod is out of the bounds' reach
                self.stats.refused_calls += 1
                if len(self.stats.refusals) < 4:
                    self.stats.refusals.append(str(why))
                status[a: a + qs.size] = PARTIAL  # exact evaluation below decides these blocks
        return status

    # --- concrete
    def _exact_segments(self, q0: np.ndarray, k0: np.ndarray, size: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Runs of allowed keys of the leaves ``(q0, k0)`` of ``size`` x ``size``, evaluated exactly."""
        rows, starts, ends = [], [], []
        per_call = max(1, FINE_CHUNK // (size * size))
        for a in range(0, q0.size, per_call):
            qs, ks = q0[a: a + per_call], k0[a: a + per_call]
            q_idx, kv_idx, valid_q, valid_kv = _leaf_indices(qs, ks, size, self.seqlen)
            allowed = self.concrete(q_idx, kv_idx)
            self.stats.exact_calls += 1
            self.stats.exact_pairs += int((valid_q.sum(axis=1) * valid_kv.sum(axis=2)).sum())
            edge = not (valid_q.all() and valid_kv.all())
            if not isinstance(allowed, np.ndarray):  # a torch tensor on an accelerator
                import torch

                allowed = allowed.expand(qs.size, size, size)
                if edge:
                    allowed = allowed & torch.from_numpy(valid_q & valid_kv).to(allowed.device)
                row, s, e = runs_torch(allowed.reshape(-1, size))
            else:
                allowed = np.broadcast_to(allowed, (qs.size, size, size))
                if edge:
                    allowed = allowed & valid_q & valid_kv
                row, s, e = runs_numpy(allowed.reshape(-1, size))
            leaf_of, i = np.divmod(row, size)
            rows.append(qs[leaf_of] + i)
            starts.append(ks[leaf_of] + s)
            ends.append(ks[leaf_of] + e)
        return np.concatenate(rows), np.concatenate(starts), np.concatenate(ends)

    # --- one stripe
    def classify_stripe(self, s0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Blocks of the stripe of rows ``s0 .. s0 + coarse``: the full ones ``(q0, k0, size)`` and the
        partial leaves ``(q0, k0)`` (of ``leaf`` x ``leaf``), int64 arrays."""
        size = self.coarse
        k0 = np.arange(0, self.seqlen, size, dtype=np.int64)
        q0 = np.full(k0.size, s0, dtype=np.int64)
        full_q, full_k, full_size = [], [], []
        while True:
            status = self._classify(q0, k0, size)
            full = status == FULL
            full_q.append(q0[full])
            full_k.append(k0[full])
            full_size.append(np.full(int(full.sum()), size, dtype=np.int64))
            self.stats.full_blocks += int(full.sum())
            self.stats.empty_blocks += int((status == EMPTY).sum())
            part = status == PARTIAL
            q0, k0 = q0[part], k0[part]
            if size <= self.leaf or q0.size == 0:
                break
            size //= 2  # four children per partial block; those starting past the sequence are dropped
            q0 = (q0[:, None] + np.array([0, 0, size, size])).reshape(-1)
            k0 = (k0[:, None] + np.array([0, size, 0, size])).reshape(-1)
            keep = (q0 < self.seqlen) & (k0 < self.seqlen)
            q0, k0 = q0[keep], k0[keep]
        self.stats.partial_leaves += q0.size
        return np.concatenate(full_q), np.concatenate(full_k), np.concatenate(full_size), q0, k0

    def _full_segments(self, q0: np.ndarray, k0: np.ndarray, size: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One segment per row of each full block (blocks side by side with the same rows merged first)."""
        if q0.size == 0:
            return q0, q0, q0
        q1 = np.minimum(q0 + size, self.seqlen)
        k1 = np.minimum(k0 + size, self.seqlen)
        order = np.lexsort((k0, q1, q0))
        q0, q1, k0, k1 = q0[order], q1[order], k0[order], k1[order]
        new = np.ones(q0.size, dtype=bool)
        new[1:] = (q0[1:] != q0[:-1]) | (q1[1:] != q1[:-1]) | (k0[1:] != k1[:-1])
        first = np.flatnonzero(new)
        last = np.append(first[1:], q0.size) - 1
        q0, q1, k0, k1 = q0[first], q1[first], k0[first], k1[last]
        heights = q1 - q0
        block = np.repeat(np.arange(q0.size), heights)
        row = q0[block] + np.arange(block.size) - np.repeat(np.cumsum(heights) - heights, heights)
        return row, k0[block], k1[block]

    def ranges(self) -> np.ndarray:
        """KV ranges ``[L, R, 2]`` int32 of the whole sequence; raises ``Refused`` if the bounds cannot
        follow the mask_mod at all (the caller then evaluates every pair).

        Stripes are classified one by one; their partial leaves are evaluated together once about
        ``FINE_CHUNK`` pairs (or ``FINE_CHUNK`` full-block rows) are pending, so the concrete calls are
        few and large, and the pending stripes' ranges are then assembled and written."""
        out = RangesBuffer(self.seqlen)
        pending: list[tuple[np.ndarray, ...]] = []
        pairs = rows = 0
        for s0 in range(0, self.seqlen, self.coarse):
            blocks = self.classify_stripe(s0)
            pending.append(blocks)
            pairs += blocks[3].size * self.leaf * self.leaf
            rows += int(np.minimum(blocks[2], self.seqlen - blocks[0]).sum())
            if pairs >= FINE_CHUNK or rows >= FINE_CHUNK or s0 + self.coarse >= self.seqlen:
                full_q, full_k, full_size, leaf_q, leaf_k = (np.concatenate(x) for x in zip(*pending))
                row, start, end = self._full_segments(full_q, full_k, full_size)
                if leaf_q.size:
                    r, s, e = self._exact_segments(leaf_q, leaf_k, self.leaf)
                    row, start, end = np.concatenate([row, r]), np.concatenate([start, s]), np.concatenate([end, e])
                out.write(*segments_to_ranges(row, start, end, self.seqlen))
                pending, pairs, rows = [], 0, 0
        return out.result()


def dense_ranges(concrete: Callable, seqlen: int, chunk_elements: int = 1 << 24,
                 stats: BlockStats | None = None) -> np.ndarray:
    """Every pair evaluated, in row chunks of ``q_idx [h, 1]`` x ``kv_idx [1, L]``, runs encoded from
    transitions into reused buffers: KV ranges ``[L, R, 2]`` int32."""
    rows = max(1, chunk_elements // seqlen)
    work = RunWork(min(rows, seqlen), seqlen)
    kv_idx = np.arange(seqlen, dtype=np.int64)[None, :]
    out = RangesBuffer(seqlen)
    for r0 in range(0, seqlen, rows):
        r1 = min(seqlen, r0 + rows)
        allowed = concrete(np.arange(r0, r1, dtype=np.int64)[:, None], kv_idx)
        if not isinstance(allowed, np.ndarray):  # a torch tensor on an accelerator
            row, start, end = runs_torch(allowed.expand(r1 - r0, seqlen))
        else:
            row, start, end = runs_numpy(np.broadcast_to(allowed, (r1 - r0, seqlen)), work)
        del allowed
        out.write(*segments_to_ranges(row + r0, start, end, seqlen))
        release_free_heap()
        if stats is not None:
            stats.exact_calls += 1
            stats.exact_pairs += (r1 - r0) * seqlen
    return out.result()
