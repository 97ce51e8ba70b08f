"""Bounds of lookups ``table[i, j, ...]`` in torch tensors indexed by bounds (see ``dcp.masks.bounds``).

The value range of a table over the box of indices a block can take: range-min/max tables (sparse
tables, O(1) per block) for one varying index, the box enumerated for several (up to ``MAX_BOX_WORK``
cells times blocks; beyond that the whole table's range, still sound). Leading constant indices (e.g.
FlexAttention's ``b`` or ``h``) select a sub-table exactly. An index interval reaching outside the table
marks the block as "evaluate exactly" (``Trace.force``): the concrete lookup raises there, as the dense
evaluation would; the bounds then cover the in-range part only.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from dcp.masks.bounds import (BOOL_RANGE, INDEXING, BoolBounds, Bounds, IntBounds, Trace, dtype_range, int_result,
                              is_const, lift)


class TableCache:
    """Lookup tables seen by the traces of one mask evaluation, as NumPy values with range-min/max tables
    (kept across traces: a mask_mod's closure holds the same tensors on every call). Holds at most
    ``max_tables`` tables (a mask_mod that builds tensors inside would otherwise grow it)."""

    def __init__(self, max_tables: int = 16):
        self.max_tables = max_tables
        self._entries: dict[int, tuple[Any, np.ndarray, dict]] = {}

    def values(self, table: Any, trace: "Trace") -> tuple[np.ndarray, dict]:
        """``(values, memo)``: the table as int64 (booleans as 0/1) and a dict for derived tables."""
        hit = self._entries.get(id(table))
        if hit is not None and hit[0] is table:
            return hit[1], hit[2]
        dtype = str(table.dtype)
        if "float" in dtype or "complex" in dtype:
            trace.refuse(f"lookup in a {dtype} table")
        values = table.detach().cpu().numpy().astype(np.int64)
        if len(self._entries) >= self.max_tables:
            self._entries.pop(next(iter(self._entries)))
        self._entries[id(table)] = (table, values, {})
        return values, self._entries[id(table)][2]




#: the most (box offsets x blocks) a multi-dimensional lookup enumerates before bounding by the whole table
MAX_BOX_WORK = 1 << 24


def _sparse_minmax(values: np.ndarray, memo: dict, key) -> tuple[list, list]:
    """Range-min/max tables of a 1-D array: level j holds min/max over windows of 2**j (O(n log n))."""
    hit = memo.get(key)
    if hit is None:
        mins, maxs = [values], [values]
        j = 1
        while (1 << j) <= values.size:
            half = 1 << (j - 1)
            mins.append(np.minimum(mins[-1][:-half], mins[-1][half:]))
            maxs.append(np.maximum(maxs[-1][:-half], maxs[-1][half:]))
            j += 1
        hit = memo[key] = (mins, maxs)
    return hit


def lookup(table, index, trace: Trace) -> Bounds:
    """``table[index]`` for a torch tensor of integers or booleans, one scalar index per dimension."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(table, torch.Tensor):
        trace.refuse("indexing a traced value")
    values, memo = trace.tables.values(table, trace)
    rng = dtype_range(table.dtype)
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != values.ndim:
        trace.refuse(f"a lookup with {len(index)} indices in a {values.ndim}-D table (one per dimension needed)")
    const_key, varying = [], []
    for i in index:
        b = lift(i, trace) if not isinstance(i, (slice, type(None), type(Ellipsis))) else None
        if not isinstance(b, IntBounds):
            trace.refuse(f"a lookup indexed by {type(i).__name__} (integer indices only)")
        if is_const(b) and not varying:  # leading constant indices select a sub-table exactly
            const_key.append(int(b.lo))
        else:
            varying.append(b)
    sub = values
    for d, c in enumerate(const_key):
        n = values.shape[d]
        if not -n <= c < n:
            trace.refuse(f"constant index {c} out of range for a table dimension of size {n}")
    sub = values[tuple(const_key)] if const_key else values
    if sub.ndim == 0:
        return _from_values(sub, sub, trace, rng)
    boxes = []
    for d, b in enumerate(varying):
        n = sub.shape[d]
        lo, hi = np.broadcast_to(b.lo, (trace.num_blocks,)), np.broadcast_to(b.hi, (trace.num_blocks,))
        # an index outside [-n, n) raises in the concrete evaluation: evaluate those blocks exactly
        trace.force |= (lo < -n) | (hi >= n)
        lo, hi = np.maximum(lo, -n), np.minimum(hi, n - 1)
        outside = lo > hi  # wholly out of range (forced above): any cell will do
        lo, hi = np.where(outside, 0, lo), np.where(outside, 0, hi)
        # negative indices count from the end; an interval across 0 may touch both ends
        lo, hi = np.where(hi < 0, lo + n, np.where(lo < 0, 0, lo)), np.where(hi < 0, hi + n, np.where(lo < 0, n - 1, hi))
        boxes.append((lo, hi))
    if len(boxes) == 1:
        lo, hi = boxes[0]
        mins, maxs = _sparse_minmax(sub, memo, tuple(const_key))
        level = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
        vmin = np.empty(lo.shape, dtype=np.int64)
        vmax = np.empty(lo.shape, dtype=np.int64)
        for j in np.unique(level):
            sel = level == j
            a, b = lo[sel], hi[sel] - (1 << int(j)) + 1
            vmin[sel] = np.minimum(mins[j][a], mins[j][b])
            vmax[sel] = np.maximum(maxs[j][a], maxs[j][b])
        return _from_values(vmin, vmax, trace, rng)
    extents = [int(np.max(hi - lo)) + 1 for lo, hi in boxes]
    if int(np.prod(extents, dtype=np.float64)) * trace.num_blocks > MAX_BOX_WORK:
        # too large a box to enumerate: the whole (sub-)table's range bounds every value in it
        return _from_values(np.int64(sub.min()), np.int64(sub.max()), trace, rng)
    vmin = np.full(trace.num_blocks, np.iinfo(np.int64).max)
    vmax = np.full(trace.num_blocks, np.iinfo(np.int64).min)
    for offsets in np.ndindex(*extents):
        coords = [np.minimum(lo + o, hi) for (lo, hi), o in zip(boxes, offsets)]  # repeats the box's last cell
        v = sub[tuple(coords)]
        np.minimum(vmin, v, out=vmin)
        np.maximum(vmax, v, out=vmax)
    return _from_values(vmin, vmax, trace, rng)


def _from_values(vmin, vmax, trace: Trace, rng) -> Bounds:
    if rng == BOOL_RANGE:
        return BoolBounds(np.asarray(vmax) != 0, np.asarray(vmin) == 0, trace)
    return int_result(vmin, vmax, trace, rng, "lookup")


INDEXING["lookup"] = lookup
