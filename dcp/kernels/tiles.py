"""The tile table: which KV keys each q row of a device's buffer attends to, in blocks.

A device's q buffer ``q_thd [Tq, Hq, D]`` is cut into consecutive q *segments*
``[seg_cu[s], seg_cu[s+1])`` (rows before ``seg_cu[0]`` or after ``seg_cu[-1]`` belong to no segment and
get ``o = 0, lse = -inf``). Segment ``s`` owns tiles ``seg_tile_ptr[s] .. seg_tile_ptr[s+1]-1``; tile
``i`` is the contiguous KV segment ``[tile_k_start[i], tile_k_start[i] + tile_k_len[i])`` of
``k_thd / v_thd [Tk, Hkv, D]``. The tiles of one segment are pairwise disjoint.

A tile is FULL (``tile_mask_row[i] == -1``: every row of the segment sees every key of the tile) or
PARTIAL: then rows ``mask_row .. mask_row + q_len - 1`` of ``mask_ranges [n_rows, R, 2]`` give, for each
q row of the segment, up to R half-open key ranges *relative to the tile's k_start*
(``0 <= start <= end <= k_len``; empty ``(0, 0)`` slots anywhere; overlapping ranges mean their union).

Every field is a contiguous int32 CPU tensor. ``validate(Tq, Tk)`` checks all of the above.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Sequence

import numpy as np
import torch

from dcp.errors import ExecutionError

_VALIDATED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # table -> {(tq, tk) that passed}
_FIELDS = ("seg_cu", "seg_tile_ptr", "tile_k_start", "tile_k_len", "tile_mask_row", "mask_ranges")


@dataclasses.dataclass(frozen=True, eq=False)
class TileTable:
    """Block-table description of one device's attention work (see module docstring for the layout).

    Fields (int32 CPU tensors): ``seg_cu [n_seg+1]``, ``seg_tile_ptr [n_seg+1]``,
    ``tile_k_start [n_tiles]``, ``tile_k_len [n_tiles]``, ``tile_mask_row [n_tiles]``,
    ``mask_ranges [n_rows, R, 2]``.
    """

    seg_cu: torch.Tensor
    seg_tile_ptr: torch.Tensor
    tile_k_start: torch.Tensor
    tile_k_len: torch.Tensor
    tile_mask_row: torch.Tensor
    mask_ranges: torch.Tensor

    # ---------------------------------------------------------------------------------------- sizes
    @property
    def n_segments(self) -> int:
        return int(self.seg_cu.numel()) - 1

    @property
    def n_tiles(self) -> int:
        return int(self.tile_k_start.numel())

    @property
    def max_ranges(self) -> int:
        """R, the number of range slots per mask row."""
        return int(self.mask_ranges.shape[1])

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The six fields in the order the native kernels take them."""
        return tuple(getattr(self, f) for f in _FIELDS)

    # ----------------------------------------------------------------------------------- validation
    def validate(self, tq: int, tk: int) -> None:
        """Check the table against a q buffer of ``tq`` rows and a kv buffer of ``tk`` rows.

        Raises ``ExecutionError`` naming the first offending segment / tile / row. A table that passed
        for these sizes is not checked again (tables are plan-owned values, built once, read often;
        the native kernels check the fields they index once more on every call).
        """
        key = (int(tq), int(tk))
        done = _VALIDATED.get(self)
        if done is not None and key in done:
            return
        self._validate(tq, tk)
        _VALIDATED.setdefault(self, set()).add(key)

    def _validate(self, tq: int, tk: int) -> None:
        for name in _FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ExecutionError(f"TileTable.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise ExecutionError(f"TileTable.{name} must be int32, got {t.dtype}")
            if t.device.type != "cpu":
                raise ExecutionError(f"TileTable.{name} must live on the CPU, got {t.device}")
            want_dim = 3 if name == "mask_ranges" else 1
            if t.dim() != want_dim:
                raise ExecutionError(f"TileTable.{name} must have {want_dim} dims, got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ExecutionError(f"TileTable.{name} must be contiguous")
        if self.mask_ranges.shape[2] != 2:
            raise ExecutionError(f"TileTable.mask_ranges must have shape [n_rows, R, 2], "
                                 f"got {tuple(self.mask_ranges.shape)}")
        n_seg, n_tiles = self.n_segments, self.n_tiles
        if n_seg < 0:
            raise ExecutionError("TileTable.seg_cu must have n_seg + 1 >= 1 entries")
        if self.seg_tile_ptr.numel() != n_seg + 1:
            raise ExecutionError(f"TileTable.seg_tile_ptr must have {n_seg + 1} entries like seg_cu, "
                                 f"got {self.seg_tile_ptr.numel()}")
        if self.tile_k_len.numel() != n_tiles or self.tile_mask_row.numel() != n_tiles:
            raise ExecutionError(
                f"TileTable.tile_k_start / tile_k_len / tile_mask_row must have equal lengths, got "
                f"{n_tiles}, {self.tile_k_len.numel()}, {self.tile_mask_row.numel()}")

        # value checks in numpy (zero-copy views; much cheaper than torch ops on tiny arrays)
        cu = self.seg_cu.numpy().astype(np.int64)
        ptr = self.seg_tile_ptr.numpy().astype(np.int64)
        if cu[0] < 0:
            raise ExecutionError(f"TileTable.seg_cu[0] = {cu[0]} is negative")
        bad = np.flatnonzero(cu[1:] < cu[:-1])
        if bad.size:
            s = int(bad[0])
            raise ExecutionError(f"TileTable.seg_cu must be non-decreasing: seg_cu[{s + 1}] = {cu[s + 1]} "
                                 f"< seg_cu[{s}] = {cu[s]}")
        if cu[-1] > tq:
            raise ExecutionError(f"TileTable segments end at q row {cu[-1]} but q has only Tq = {tq} rows")
        if ptr[0] != 0:
            raise ExecutionError(f"TileTable.seg_tile_ptr[0] must be 0, got {ptr[0]}")
        bad = np.flatnonzero(ptr[1:] < ptr[:-1])
        if bad.size:
            raise ExecutionError(f"TileTable.seg_tile_ptr must be non-decreasing (segment {int(bad[0])})")
        if ptr[-1] != n_tiles:
            raise ExecutionError(f"TileTable.seg_tile_ptr[-1] = {ptr[-1]} must equal the number of tiles {n_tiles}")
        if n_tiles == 0:
            return

        seg_of_tile = np.repeat(np.arange(n_seg), np.diff(ptr))
        q_len = np.diff(cu)[seg_of_tile]
        k0 = self.tile_k_start.numpy().astype(np.int64)
        kl = self.tile_k_len.numpy().astype(np.int64)
        mr = self.tile_mask_row.numpy().astype(np.int64)
        bad = np.flatnonzero((k0 < 0) | (kl < 0) | (k0 + kl > tk))
        if bad.size:
            i = int(bad[0])
            raise ExecutionError(f"tile {i} (segment {seg_of_tile[i]}): key range [{k0[i]}, {k0[i] + kl[i]}) is "
                                 f"not inside [0, Tk = {tk})")
        n_rows = self.mask_ranges.shape[0]
        bad = np.flatnonzero((mr < -1) | ((mr >= 0) & (mr + q_len > n_rows)))
        if bad.size:
            i = int(bad[0])
            raise ExecutionError(f"tile {i} (segment {seg_of_tile[i]}): mask rows [{mr[i]}, {mr[i] + q_len[i]}) "
                                 f"are not inside mask_ranges ({n_rows} rows); use -1 for a full tile")
        partial = np.flatnonzero(mr >= 0)
        if partial.size and self.max_ranges:
            lens = q_len[partial]
            tile_of_row = np.repeat(partial, lens)
            local = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            rows = self.mask_ranges.numpy()[mr[tile_of_row] + local].astype(np.int64)  # [n, R, 2]
            lim = kl[tile_of_row][:, None]
            bad = np.argwhere((rows[..., 0] < 0) | (rows[..., 1] < rows[..., 0]) | (rows[..., 1] > lim))
            if bad.size:
                n, r = int(bad[0, 0]), int(bad[0, 1])
                i = int(tile_of_row[n])
                raise ExecutionError(
                    f"tile {i} (segment {seg_of_tile[i]}), q row {local[n]}: key range {tuple(rows[n, r].tolist())} "
                    f"must satisfy 0 <= start <= end <= k_len = {kl[i]}")
        # tiles of a segment must be disjoint: sort non-empty tiles by (segment, k_start)
        nz = np.flatnonzero(kl > 0)
        if nz.size > 1:
            order = nz[np.lexsort((k0[nz], seg_of_tile[nz]))]
            same = seg_of_tile[order[1:]] == seg_of_tile[order[:-1]]
            bad = np.flatnonzero(same & (k0[order[1:]] < (k0 + kl)[order[:-1]]))
            if bad.size:
                a, b = int(order[bad[0]]), int(order[bad[0] + 1])
                raise ExecutionError(
                    f"segment {seg_of_tile[a]}: tiles {a} and {b} overlap on keys [{k0[b]}, "
                    f"{min(k0[a] + kl[a], k0[b] + kl[b])}) (tiles of a segment must be disjoint)")

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_segments(cls, segments: Sequence[tuple[int, Sequence[tuple]]], q_start: int = 0) -> "TileTable":
        """Build a table from Python data.

        ``segments[s] = (q_len, tiles)`` for consecutive segments starting at q row ``q_start``; each tile
        is ``(k_start, k_len)`` (full) or ``(k_start, k_len, ranges)`` with ``ranges`` array-like of shape
        ``[q_len, r, 2]`` (key ranges relative to k_start; ``None`` also means full).
        """
        seg_cu, ptr = [int(q_start)], [0]
        k_start, k_len, mask_row, blocks = [], [], [], []
        n_rows = 0
        for q_len, tiles in segments:
            q_len = int(q_len)
            for tile in tiles:
                k_start.append(int(tile[0]))
                k_len.append(int(tile[1]))
                ranges = tile[2] if len(tile) > 2 else None
                if ranges is None:
                    mask_row.append(-1)
                    continue
                arr = np.asarray(ranges, dtype=np.int64)
                arr = np.zeros((q_len, 0, 2), np.int64) if arr.size == 0 else arr.reshape(q_len, -1, 2)
                mask_row.append(n_rows)
                n_rows += q_len
                blocks.append(arr)
            seg_cu.append(seg_cu[-1] + q_len)
            ptr.append(len(k_start))
        r_max = max([b.shape[1] for b in blocks], default=1)
        mask = np.zeros((n_rows, max(r_max, 1), 2), dtype=np.int32)
        row = 0
        for b in blocks:
            mask[row:row + b.shape[0], :b.shape[1]] = b
            row += b.shape[0]

        def i32(x):
            return torch.as_tensor(np.asarray(x, dtype=np.int32).reshape(-1))

        return cls(i32(seg_cu), i32(ptr), i32(k_start), i32(k_len), i32(mask_row), torch.from_numpy(mask))

    @classmethod
    def full(cls, tq: int, tk: int) -> "TileTable":
        """One segment of ``tq`` rows attending to all ``tk`` keys (dense attention)."""
        return cls.from_segments([(tq, [(0, tk)] if tk > 0 else [])])

    # ---------------------------------------------------------------------------------------- views
    def segment_keys(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_idx long [n_keys], allowed bool [q_len, n_keys]) of segment ``s``: the keys of its tiles
        (concatenated in tile order) and which of them each row of the segment may attend to."""
        q_len = int(self.seg_cu[s + 1] - self.seg_cu[s])
        keys, cols = [], []
        for i in range(int(self.seg_tile_ptr[s]), int(self.seg_tile_ptr[s + 1])):
            k0, kl, mr = int(self.tile_k_start[i]), int(self.tile_k_len[i]), int(self.tile_mask_row[i])
            keys.append(torch.arange(k0, k0 + kl))
            if mr < 0:
                cols.append(torch.ones(q_len, kl, dtype=torch.bool))
            else:
                rg = self.mask_ranges[mr:mr + q_len].long()  # [q_len, R, 2]
                j = torch.arange(kl)[None, None, :]
                cols.append(((j >= rg[..., 0:1]) & (j < rg[..., 1:2])).any(dim=1))
        if not keys:
            return torch.zeros(0, dtype=torch.long), torch.zeros(q_len, 0, dtype=torch.bool)
        return torch.cat(keys), torch.cat(cols, dim=1)

    def to_dense(self, tq: int, tk: int) -> torch.Tensor:
        """Boolean ``[tq, tk]`` matrix: True where q row t may attend to key j (tests and drawing)."""
        out = torch.zeros(tq, tk, dtype=torch.bool)
        for s in range(self.n_segments):
            q0, q1 = int(self.seg_cu[s]), int(self.seg_cu[s + 1])
            keys, allowed = self.segment_keys(s)
            if keys.numel():
                out[q0:q1, keys] = allowed
        return out
