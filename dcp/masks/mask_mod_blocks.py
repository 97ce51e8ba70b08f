"""Blockwise evaluation of a mask_mod: bounds for whole blocks, exact values only where they are needed.

For a sequence of L tokens the (query, key) square is cut into row *stripes* of C rows (C a power of two,
about L / 64) and each stripe into C x C blocks. Each block is classified by one abstract call of the
mask_mod (``dcp.masks.bounds``): *full* (allowed on every pair), *empty* (masked on every pair) or
*partial* (anything else, including every block the bounds refuse to follow). A partial block above the
leaf size has its columns classified next, each over the block's rows: if every column is full or empty
the block is a *pattern* (``kv % 8 == 0`` far from the diagonal: the same keys in every row) and is done.
The other partial blocks are split into four and classified again, down to ``leaf`` x ``leaf`` blocks,
whose pairs are then evaluated exactly with concrete index arrays. A stripe's KV ranges are assembled
without any dense copy of the stripe (``dcp.masks.mask_mod_bands``): the columns of the coarse blocks
decided whole (empty, full, pattern) are shared by all the stripe's rows and written by broadcasting;
inside the split ones every full block contributes one segment per row, every pattern its runs per row,
every exact leaf row its runs of True (found from transitions), and touching segments of a row merge.

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
from dcp.masks.box_counts import INDEX_MIN_BUDGET, index_bytes
from dcp.masks.mask_mod_bands import (SHARED_EMPTY, SHARED_FULL, VARIES, assemble_band, bands_index, bands_profile,
                                     write_bands)

EMPTY, FULL, PARTIAL = 0, 1, 2
#: pairs evaluated exactly per concrete call (bounds the predicate's temporaries)
FINE_CHUNK = 1 << 22
#: blocks per abstract call (bounds the arrays of the traced operations)
BLOCK_CHUNK = 1 << 16
#: stripes per sequence the coarse block size aims at
TARGET_STRIPES = 64
#: a result with at least this many ranges per row on average also gets its pair-count index
INDEX_RANGES_PER_ROW = 16
#: partial blocks of at least this size are tried as column patterns, after this many sampled columns
PATTERN_MIN_SIZE = 64
PATTERN_PROBES = 32


@dataclass
class BlockStats:
    """What a blockwise evaluation did: blocks classified per outcome, pairs evaluated exactly, calls."""

    seqlen: int = 0
    coarse: int = 0
    leaf: int = 0
    full_blocks: int = 0
    empty_blocks: int = 0
    partial_leaves: int = 0
    pattern_blocks: int = 0  # partial blocks whose every column is constant over the block's rows
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


@dataclass(frozen=True, eq=False)
class StripeBlocks:
    """What the classification of one stripe (rows ``s0 .. s1``) found: ``shared`` int8 ``[L]``, the state
    of every column over the whole stripe (``mask_mod_bands``: empty, full, or varies by row: inside a
    coarse block that was split); inside the split blocks, full squares ``full = (q0, k0, size)``,
    column patterns ``patterns = [(q0, k0, size, allowed_cols bool [P, size]), ...]`` (one per level) and
    partial leaves ``leaves = (q0, k0)`` (int64 arrays)."""

    s0: int
    s1: int
    shared: np.ndarray
    full: tuple[np.ndarray, np.ndarray, np.ndarray]
    patterns: list
    leaves: tuple[np.ndarray, np.ndarray]


class BlockEvaluator:
    """Blockwise KV ranges of one mask_mod for one length (see the module docstring).

    ``concrete(q_idx, kv_idx)`` evaluates the mask_mod on index arrays and returns a boolean NumPy array
    of their broadcast shape, or a torch bool tensor when it runs on an accelerator. ``progress``, if
    given, is called with the fraction done (stripes classified, then the output written).
    """

    def __init__(self, fn: Callable, nargs: int, seqlen: int, concrete: Callable, leaf: int = 16,
                 coarse: int | None = None, progress: Callable[[float], None] | None = None):
        self.fn, self.nargs, self.seqlen = fn, nargs, seqlen
        self.concrete = concrete
        self.leaf = leaf
        if coarse is None:
            coarse = 1 << int(np.ceil(np.log2(max(1, -(-seqlen // TARGET_STRIPES)))))
        self.coarse = max(leaf, coarse)
        self.tables = TableCache()
        self.stats = BlockStats(seqlen=seqlen, coarse=self.coarse, leaf=leaf)
        self.progress = progress
        self._rng = np.random.default_rng(0)  # sampled columns (fixed: the same work on every run)
        #: the ``RangesIndex`` of the result, when ``ranges()`` built one (masks of many ranges per row), and
        #: its ``box_counts.range_profile``
        self.index = None
        self.profile = None

    # --- abstract
    def _classify(self, q_lo: np.ndarray, q_hi: np.ndarray, k_lo: np.ndarray, k_hi: np.ndarray) -> np.ndarray:
        """Status of the rectangles ``q_lo..q_hi`` x ``k_lo..k_hi`` (inclusive), in chunks of abstract calls."""
        status = np.empty(q_lo.size, dtype=np.int8)
        for a in range(0, q_lo.size, BLOCK_CHUNK):
            sl = slice(a, a + BLOCK_CHUNK)
            self.stats.abstract_calls += 1
            try:
                status[sl] = classify(self.fn, self.nargs, q_lo[sl], q_hi[sl], k_lo[sl], k_hi[sl], self.tables)
            except Refused as why:
                if self.stats.abstract_calls == 1:
                    raise  # the very first call: the mask_mod is out of the bounds' reach
                self.stats.refused_calls += 1
                if len(self.stats.refusals) < 4:
                    self.stats.refusals.append(str(why))
                status[sl] = PARTIAL  # exact evaluation below decides these blocks
        return status

    def _squares(self, q0: np.ndarray, k0: np.ndarray, size: int) -> np.ndarray:
        last = self.seqlen - 1
        return self._classify(q0, np.minimum(q0 + size - 1, last), k0, np.minimum(k0 + size - 1, last))

    def _columns(self, q0: np.ndarray, k0: np.ndarray, size: int, offsets: np.ndarray | None = None) -> np.ndarray:
        """Status of the columns ``k0 + offsets`` (default: all ``size``) of the blocks ``(q0, k0)`` of
        ``size`` x ``size``, each over the block's rows: int8 ``[P, len(offsets)]`` (columns past the
        sequence: EMPTY). A block whose columns are all FULL or EMPTY holds the same keys in each of its
        rows (a column pattern): no row of it needs evaluating."""
        offsets = np.arange(size, dtype=np.int64) if offsets is None else offsets
        cols = k0[:, None] + offsets[None, :]
        inside = cols < self.seqlen
        q_lo = np.broadcast_to(q0[:, None], cols.shape)[inside]
        q_hi = np.minimum(q_lo + size - 1, self.seqlen - 1)
        status = np.full(cols.shape, EMPTY, dtype=np.int8)
        status[inside] = self._classify(q_lo, q_hi, cols[inside], cols[inside])
        return status

    # --- concrete
    def _exact_segments(self, q0: np.ndarray, k0: np.ndarray, size: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Runs of allowed keys of the leaves ``(q0, k0)`` of ``size`` x ``size``, evaluated exactly: sorted
        by leaf, then row, then start."""
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
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(rows), np.concatenate(starts), np.concatenate(ends)

    # --- one stripe
    def classify_stripe(self, s0: int) -> StripeBlocks:
        """Blocks of the stripe of rows ``s0 .. s0 + coarse`` (``StripeBlocks``). Partial blocks above the
        leaf size whose columns are each constant over the block's rows become patterns; the others split
        into four, down to partial leaves of ``leaf`` x ``leaf``."""
        size, n = self.coarse, self.seqlen
        k0 = np.arange(0, n, size, dtype=np.int64)
        q0 = np.full(k0.size, s0, dtype=np.int64)
        shared = np.full(n, VARIES, dtype=np.int8)
        full_parts: list[tuple] = []
        patterns: list[tuple] = []
        top = True
        while True:
            status = self._squares(q0, k0, size)
            full, part = status == FULL, status == PARTIAL
            self.stats.full_blocks += int(full.sum())
            self.stats.empty_blocks += int((status == EMPTY).sum())
            if top:  # coarse blocks decided for the whole stripe
                shared[:] = np.repeat(np.where(full, SHARED_FULL, np.where(part, VARIES, SHARED_EMPTY)), size)[:n]
            else:
                full_parts.append((q0[full], k0[full], np.full(int(full.sum()), size, dtype=np.int64)))
            q0, k0 = q0[part], k0[part]
            if size >= PATTERN_MIN_SIZE and size > self.leaf and q0.size:
                # a few columns first (at random: no aliasing with a stride): most partial blocks (diagonals,
                # lookups) have a partial one
                sample = np.unique(self._rng.integers(0, size, PATTERN_PROBES))
                maybe = np.flatnonzero((self._columns(q0, k0, size, sample) != PARTIAL).all(axis=1))
                cols = self._columns(q0[maybe], k0[maybe], size)
                pattern = np.zeros(q0.size, dtype=bool)
                pattern[maybe[(cols != PARTIAL).all(axis=1)]] = True
                cols = cols[(cols != PARTIAL).all(axis=1)]
                self.stats.pattern_blocks += int(pattern.sum())
                if top:
                    for kb, c in zip(k0[pattern].tolist(), cols):
                        shared[kb: kb + size] = np.where(c == FULL, SHARED_FULL, SHARED_EMPTY)[: n - kb]
                else:
                    patterns.append((q0[pattern], k0[pattern], size, cols == FULL))
                q0, k0 = q0[~pattern], k0[~pattern]
            top = False
            if size <= self.leaf or q0.size == 0:
                break
            size //= 2  # four children per partial block; those starting past the sequence are dropped
            q0 = (q0[:, None] + np.array([0, 0, size, size])).reshape(-1)
            k0 = (k0[:, None] + np.array([0, size, 0, size])).reshape(-1)
            keep = (q0 < n) & (k0 < n)
            q0, k0 = q0[keep], k0[keep]
        self.stats.partial_leaves += q0.size
        full = tuple(np.concatenate(x) if x else np.zeros(0, dtype=np.int64) for x in zip(*full_parts)) \
            if full_parts else (np.zeros(0, dtype=np.int64),) * 3
        return StripeBlocks(s0, min(n, s0 + self.coarse), shared, full, patterns, (q0, k0))

    def _block_segments(self, blocks: StripeBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-row segments of the stripe's full squares and patterns (inside its split coarse blocks):
        each block's segments by run, then row, so that a row meets them in key order."""
        n = self.seqlen
        rows, starts, ends = [], [], []
        q0, k0, size = blocks.full
        if q0.size:
            height = np.minimum(q0 + size, n) - q0
            idx = np.repeat(np.arange(q0.size), height)
            rows.append(q0[idx] + np.arange(idx.size) - np.repeat(np.cumsum(height) - height, height))
            starts.append(k0[idx])
            ends.append(np.minimum(k0 + size, n)[idx])
        for q0, k0, size, cols in blocks.patterns:
            blk, s, e = runs_numpy(cols)  # runs of allowed columns, by block then start
            height = np.minimum(q0 + size, n) - q0
            h = height[blk]
            idx = np.repeat(np.arange(blk.size), h)  # each run once per row of its block
            rows.append(q0[blk][idx] + np.arange(idx.size) - np.repeat(np.cumsum(h) - h, h))
            starts.append((k0[blk] + s)[idx])
            ends.append((k0[blk] + e)[idx])
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(rows), np.concatenate(starts), np.concatenate(ends)

    def ranges(self) -> np.ndarray:
        """KV ranges ``[L, R, 2]`` int32 of the whole sequence; raises ``Refused`` if the bounds cannot
        follow the mask_mod at all (the caller then evaluates every pair).

        Stripes are classified one by one; their partial leaves are evaluated together once about
        ``FINE_CHUNK`` pairs are pending, so the concrete calls are few and large; each stripe then
        becomes a ``mask_mod_bands.Band``, and the bands are written into the output at its final width.
        Masks of many ranges per row also get their ``RangesIndex`` (``self.index``)."""
        n = self.seqlen
        bands: list = []
        pending: list[StripeBlocks] = []
        pairs = 0
        n_stripes = -(-n // self.coarse)
        for s0 in range(0, n, self.coarse):
            blocks = self.classify_stripe(s0)
            pending.append(blocks)
            if self.progress is not None:  # one unit per stripe, one for writing the result
                self.progress((s0 // self.coarse + 1) / (n_stripes + 1))
            pairs += blocks.leaves[0].size * self.leaf * self.leaf
            if pairs >= FINE_CHUNK or blocks.s1 >= n:
                leaf_q = np.concatenate([b.leaves[0] for b in pending])
                leaf_k = np.concatenate([b.leaves[1] for b in pending])
                row, start, end = self._exact_segments(leaf_q, leaf_k, self.leaf)
                # leaves come stripe after stripe: split their runs at the stripes' first rows
                cut = np.searchsorted(row // self.coarse, [b.s0 // self.coarse for b in pending] + [n])
                for i, b in enumerate(pending):
                    own = self._block_segments(b)
                    sl = slice(cut[i], cut[i + 1])
                    bands.append(assemble_band(n, b.s0, b.s1, b.shared, np.concatenate([own[0], row[sl]]),
                                               np.concatenate([own[1], start[sl]]),
                                               np.concatenate([own[2], end[sl]]), self.leaf))
                pending, pairs = [], 0
        out = write_bands(n, bands)
        self.profile = bands_profile(n, bands)
        used = int(sum(int(b.counts.sum()) for b in bands))
        if used >= INDEX_RANGES_PER_ROW * n and index_bytes(n) <= max(INDEX_MIN_BUDGET, out.nbytes):
            self.index = bands_index(n, bands, used)
        return out


def dense_ranges(concrete: Callable, seqlen: int, chunk_elements: int = 1 << 24,
                 stats: BlockStats | None = None, progress: Callable[[float], None] | None = None) -> np.ndarray:
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
        if progress is not None:
            progress(r1 / seqlen)
    return out.result()
