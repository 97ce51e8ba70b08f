"""Per-device buffer layout and kernel calls of a plan, derived once per (direction, device) and cached.

Each side of a device — the q side (Q units forward, QG units backward) and the kv side (KV units) —
has these row spaces, all with the full head dimension unless noted:

- ``HOME``: the caller's local tensors themselves (home token blocks in local order), read in place;
- ``BUF``: one tensor per input tensor of the side with one slot per received token block that some
  stage reads together with other units, at a fixed offset (slots in order of first use, so that the
  units of a stage tend to be adjacent). On the kv side it also holds *staged* home blocks: those that
  some stage reads next to received ones, copied in once at the start of a step. Received units are
  unpacked straight into their slots at ``CommWait``; rows that a call spans but does not use are zeroed
  once per step (a dense kernel multiplies them by zero, which uninitialized NaNs would survive). The
  BUF tensors are allocated once per plan and reused by every step (``dcp.execute.local.Workspace``);
- ``MSG``: the views of ONE received unit (its heads only) in the message it came in, for calls whose
  side is that single unit: no copy at all.

A ``Compute`` becomes one kernel call per (q row space, head-block group): the call passes row/head
views of these tensors (``q[q_lo:q_hi, heads]``, ``k/v[kv_lo:kv_hi, heads]``; no gather) and a tile
table whose ``seg_cu`` / ``tile_k_start`` address rows of the views. Units between the q units of a call
become empty segments (their output rows are 0 / -inf, or zero gradients). Head blocks with the same
tiles whose heads are adjacent (and whose kv heads are disjoint) share one call; otherwise each head
block is its own call on head-sliced views. Calls never mix home and received q units (a stage that
has both is split into two calls, which costs no copy), while a stage whose kv units are both home and
received reads the kv ``BUF`` with the home ones staged.

Messages (everything a device sends to one peer in one round: ONE contiguous uint8 buffer of typed
regions) are laid out by ``dcp.execute.compile.message_layout``.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dcp.ir.instructions import Unit

HOME, BUF, MSG = 0, 1, 2   # a call side reads: the caller's tensors, the slot buffer, one received unit


@dataclass(frozen=True)
class Call:
    """One kernel call of a Compute: views of the side tensors and the tile table over them."""

    q_src: int                # HOME, BUF or MSG (the views of the one received unit: message or relay)
    q_lo: int                 # q rows [q_lo, q_hi) of the q side's tensors
    q_hi: int
    kv_src: int
    kv_lo: int
    kv_hi: int
    hq: slice | None          # query heads of the call (None: all)
    hk: slice | None          # kv heads of the call (None: all)
    table: Any                # TileTable over the views
    q_out: tuple              # ((tb, hb, a, b, local head slice | None), ...): output rows of q units
    kv_out: tuple             # the same for the kv units (dK / dV rows of the backward)
    needs: tuple              # received input Units the call reads (must have arrived)
    q_home_full: bool         # the q view is all home rows and heads (its output can become the accumulator)
    kv_home_full: bool


@dataclass(frozen=True)
class DeviceLayout:
    """Slots of the BUF tensors of one device and direction."""

    q_slot: dict              # token block -> first row of its slot in the q-side BUF
    n_q: int                  # rows of the q-side BUF
    kv_slot: dict
    n_kv: int
    staged: tuple             # ((home row, BUF row, rows), ...): kv home rows copied into BUF per step
    home_q: tuple             # home token blocks (local order)
    zero_q: tuple = ()        # ((row, rows), ...): BUF rows between the units of a call, zeroed per step
    zero_kv: tuple = ()       # (a kernel may read them; uninitialized memory could hold NaN)


@dataclass
class _Spec:
    q_src: int
    hbs: list
    sig: tuple
    tiles: np.ndarray         # tile ids of the first head block


# ------------------------------------------------------------------------------------ grouping
def _mergeable(tab, hbs: list) -> bool:
    """Head blocks ``hbs`` (consecutive) can share one kernel call: adjacent, disjoint kv heads and the
    kernel's GQA mapping (local q head j -> local kv head j // (nq / nkv)) equals the real one."""
    kv = [tab.kv_lo[h] for h in hbs]
    if any(b != a + tab.kvb for a, b in zip(kv, kv[1:])):
        return False
    nq, nkv, g = len(hbs) * tab.hqb, len(hbs) * tab.kvb, tab.hq // tab.hkv
    if nq % nkv:
        return False
    r, q0, k0 = nq // nkv, hbs[0] * tab.hqb, kv[0]
    return all((q0 + j) // g - k0 == j // r for j in range(nq))


def _stage_specs(tab, device: int, t: np.ndarray) -> list[_Spec]:
    ts = tab.plan.tiles
    q_tb, kv_tb, hb = ts.q_tb[t].astype(np.int64), ts.kv_tb[t].astype(np.int64), ts.hb[t].astype(np.int64)
    full = ts.full[t].astype(bool)
    src = np.where(tab.home[q_tb] == device, HOME, BUF)
    specs: list[_Spec] = []
    for s in (HOME, BUF):
        run = None
        for h in np.unique(hb[src == s]).tolist():
            sel = np.flatnonzero((src == s) & (hb == h))
            order = np.lexsort((kv_tb[sel], q_tb[sel]))
            sel = sel[order]
            sig = tuple(zip(q_tb[sel].tolist(), kv_tb[sel].tolist(), full[sel].tolist()))
            if run is not None and run.hbs[-1] == h - 1 and run.sig == sig and _mergeable(tab, run.hbs + [h]):
                run.hbs.append(h)
            else:
                run = _Spec(s, [h], sig, t[sel])
                specs.append(run)
    return specs


# ------------------------------------------------------------------------------------ layout
def build_layout(tab, device: int, ops: Sequence, in_kinds: tuple, table_cls) -> DeviceLayout:
    """Derive the device's BUF slots and every Compute's calls (set as ``op.calls``; tile tables of
    ``table_cls``) for one direction's ops (``in_kinds``: its q-side and kv-side input kinds)."""
    in_q, in_kv = in_kinds
    ts, home = tab.plan.tiles, tab.home
    per_op = []
    q_order: dict = {}
    kv_order: dict = {}
    staged: dict = {}
    for op in ops:
        if op.code != "compute":
            continue
        specs = _stage_specs(tab, device, np.asarray(op.tiles, dtype=np.int64)) if len(op.tiles) else []
        per_op.append((op, specs))
        for sp in specs:
            q_tbs = sorted(set(ts.q_tb[sp.tiles].tolist()))
            if sp.q_src == BUF and (len(q_tbs) > 1 or len(sp.hbs) > 1):  # one received unit: read in place
                for tb in q_tbs:
                    q_order.setdefault(tb, None)
            kv_tbs = sorted(set(ts.kv_tb[sp.tiles].tolist()))
            if not all(home[tb] == device for tb in kv_tbs) and (len(kv_tbs) > 1 or len(sp.hbs) > 1):
                for tb in kv_tbs:
                    kv_order.setdefault(tb, None)
                    if home[tb] == device:
                        staged.setdefault(tb, None)

    def slots(order):
        out, n = {}, 0
        for tb in order:
            out[tb] = n
            n += int(tab.tb_len[tb])
        return out, n

    q_slot, n_q = slots(q_order)
    kv_slot, n_kv = slots(kv_order)
    runs: list = []
    for tb in sorted(staged, key=lambda b: kv_slot[b]):
        h, b, n = int(tab.local_off[tb]), kv_slot[tb], int(tab.tb_len[tb])
        if runs and runs[-1][0] + runs[-1][2] == h and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += n
        else:
            runs.append([h, b, n])
    lay = DeviceLayout(q_slot, n_q, kv_slot, n_kv, tuple(tuple(r) for r in runs),
                       tuple(tab.plan.local_blocks(device).tolist()))
    n_local = int(tab.n_local[device])
    gaps_q, gaps_kv = np.zeros(n_q + 1, dtype=np.int64), np.zeros(n_kv + 1, dtype=np.int64)
    for op, specs in per_op:
        op.calls = tuple(_make_call(tab, device, sp, lay, in_q, in_kv, n_local, table_cls) for sp in specs)
        for c in op.calls:
            if c.q_src == BUF:
                _mark_gaps(gaps_q, c.q_lo, c.q_hi, [(c.q_lo + a, c.q_lo + b) for _, _, a, b, _ in c.q_out])
            if c.kv_src == BUF:
                _mark_gaps(gaps_kv, c.kv_lo, c.kv_hi, [(c.kv_lo + a, c.kv_lo + b) for _, _, a, b, _ in c.kv_out])
    # staged rows are written at the start of every step anyway
    return dataclasses.replace(lay, zero_q=_runs(gaps_q, ()), zero_kv=_runs(gaps_kv, lay.staged))


def _mark_gaps(marks: np.ndarray, lo: int, hi: int, used: list) -> None:
    """Count +1/-1 at the ends of the rows of [lo, hi) outside ``used``."""
    cur = lo
    for a, b in sorted(used):
        if a > cur:
            marks[cur] += 1
            marks[a] -= 1
        cur = max(cur, b)
    if hi > cur:
        marks[cur] += 1
        marks[hi] -= 1


def _runs(marks: np.ndarray, written: tuple) -> tuple:
    """((row, rows), ...) of the marked rows, less the ``written`` ((_, row, rows), ...) ones."""
    on = np.cumsum(marks)[:-1] > 0
    for _, b, n in written:
        on[b:b + n] = False
    if not on.any():
        return ()
    edges = np.flatnonzero(np.diff(np.r_[0, on.astype(np.int8), 0]))
    return tuple((int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2]))


def _make_call(tab, device: int, sp: _Spec, lay: DeviceLayout, in_q, in_kv, n_local: int, table_cls) -> Call:
    ts, home, t = tab.plan.tiles, tab.home, sp.tiles
    q_tb, kv_tb = ts.q_tb[t].astype(np.int64), ts.kv_tb[t].astype(np.int64)
    q_set, kv_set = set(q_tb.tolist()), set(kv_tb.tolist())
    q_src = MSG if sp.q_src == BUF and q_set.isdisjoint(lay.q_slot) else sp.q_src
    kv_src = HOME if bool((home[kv_tb] == device).all()) else MSG if kv_set.isdisjoint(lay.kv_slot) else BUF

    def rows(src: int, slots: dict, tbs: set) -> dict:  # token block -> first row in the side's view
        if src == HOME:
            return {tb: int(tab.local_off[tb]) for tb in tbs}
        return {tb: 0 if src == MSG else slots[tb] for tb in tbs}

    qrow, krow = rows(q_src, lay.q_slot, q_set), rows(kv_src, lay.kv_slot, kv_set)
    qr = np.array([qrow[b] for b in q_tb.tolist()], dtype=np.int64)
    kr = np.array([krow[b] for b in kv_tb.tolist()], dtype=np.int64)
    order = np.lexsort((kv_tb, qr))  # a segment's tiles in kv block order (the order keys are folded in)
    t, q_tb, kv_tb, qr, kr = t[order], q_tb[order], kv_tb[order], qr[order], kr[order]
    # segments: the q units in row order, empty segments over the rows between them
    uq = sorted(qrow, key=qrow.get)
    q_lo = qrow[uq[0]]
    seg_cu, ptr, q_out_rows = [0], [0], []
    cursor, n_seen, tiles_of = q_lo, 0, Counter(q_tb.tolist())
    tb_len = tab.tb_len_list
    for tb in uq:
        r, n = qrow[tb], tb_len[tb]
        if r > cursor:
            seg_cu.append(r - q_lo)
            ptr.append(n_seen)
        n_seen += tiles_of[tb]
        seg_cu.append(r + n - q_lo)
        ptr.append(n_seen)
        q_out_rows.append((tb, r - q_lo, r + n - q_lo))
        cursor = r + n
    q_hi = cursor
    kv_lo = min(krow.values())
    kv_hi = max(r + tb_len[tb] for tb, r in krow.items())
    tile_mask_row, mask_ranges = mask_table(tab, device, t, q_tb)
    i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    table = table_cls(seg_cu=i32(seg_cu), seg_tile_ptr=i32(ptr), tile_k_start=i32(kr - kv_lo),
                      tile_k_len=i32(tab.tb_len[kv_tb]), tile_mask_row=i32(tile_mask_row),
                      mask_ranges=i32(mask_ranges))
    hbs, hb0 = sp.hbs, sp.hbs[0]
    multi = len(hbs) > 1
    hq = slice(hb0 * tab.hqb, (hbs[-1] + 1) * tab.hqb)
    hk = slice(tab.kv_lo[hb0], tab.kv_lo[hbs[-1]] + tab.kvb)
    hq = None if (hq.start, hq.stop) == (0, tab.hq) or q_src == MSG else hq
    hk = None if (hk.start, hk.stop) == (0, tab.hkv) or kv_src == MSG else hk
    qh = lambda h: slice((h - hb0) * tab.hqb, (h - hb0 + 1) * tab.hqb) if multi else None  # noqa: E731
    kh = lambda h: (slice(tab.kv_lo[h] - tab.kv_lo[hb0], tab.kv_lo[h] - tab.kv_lo[hb0] + tab.kvb)  # noqa: E731
                    if multi else None)
    q_out = tuple((tb, h, a, b, qh(h)) for tb, a, b in q_out_rows for h in hbs)
    kv_out = tuple((tb, h, r - kv_lo, r - kv_lo + tb_len[tb], kh(h))
                   for tb, r in sorted(krow.items(), key=lambda x: x[1]) for h in hbs)
    needs = []
    if q_src != HOME:
        needs += [Unit(in_q, tb, h) for tb in uq for h in hbs]
    needs += [Unit(in_kv, tb, h) for tb in sorted(krow) if home[tb] != device for h in hbs]
    return Call(q_src, q_lo, q_hi, kv_src, kv_lo, kv_hi, hq, hk, table, q_out, kv_out, tuple(needs),
                q_src == HOME and q_lo == 0 and q_hi == n_local and hq is None,
                kv_src == HOME and kv_lo == 0 and kv_hi == n_local and hk is None)


def mask_table(tab, device: int, t: np.ndarray, q_tb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tile_mask_row, mask_ranges) of ``device``'s tiles ``t`` in table order: the sequence-local key ranges
    of every row of each partial tile, clipped and shifted to the tile's kv block (only slots some row uses;
    ``PlanTables.mask_rows`` makes those of all the device's tiles at once)."""
    full = tab.plan.tiles.full[t].astype(bool)
    tile_mask_row = np.full(t.size, -1, dtype=np.int64)
    part = np.flatnonzero(~full)
    if not part.size:
        return tile_mask_row, np.zeros((0, 1, 2), dtype=np.int64)
    plens = tab.tb_len[q_tb[part]]
    starts = np.cumsum(plens) - plens
    tile_mask_row[part] = starts
    pos, ranges = tab.mask_rows(device)
    first = pos[t[part]]
    if (first < 0).any():
        raise ValueError(f"mask_table: tiles {t[part][first < 0].tolist()} are not device {device}'s")
    rep = np.repeat(np.arange(part.size), plens)
    rows = ranges[(first - starts)[rep] + np.arange(rep.size)]
    used_cols = np.flatnonzero((rows[:, :, 1] > rows[:, :, 0]).any(axis=0))
    ncol = int(used_cols[-1]) + 1 if used_cols.size else 1
    return tile_mask_row, rows[:, :ncol]


# ------------------------------------------------------------------------------------ views
def rows_of(t: torch.Tensor, a: int, b: int, heads: slice | None = None) -> torch.Tensor:
    """Rows [a, b) (and ``heads``) of a ``[T, H, D]`` tensor or of an ``[H, T]`` row-statistics tensor."""
    if t.dim() == 3:
        return t[a:b] if heads is None else t[a:b, heads]
    return t[:, a:b] if heads is None else t[heads, a:b]


def new_like_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Uninitialized tensor like ``t`` ([T, H, D] or [H, T]) with ``n`` rows."""
    shape = (n, *t.shape[1:]) if t.dim() == 3 else (t.shape[0], n)
    return torch.empty(shape, dtype=t.dtype, device=t.device)


def cat_as(parts: Sequence[torch.Tensor], dim: int, dtype: torch.dtype, empty: torch.Tensor) -> torch.Tensor:
    """``cat(parts, dim)`` converted to ``dtype`` in the same single pass; ``empty`` when there are none."""
    if not parts:
        return empty
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0].contiguous()
    shape = list(parts[0].shape)
    shape[dim] = sum(int(t.shape[dim]) for t in parts)
    return torch.cat(list(parts), dim, out=torch.empty(shape, dtype=dtype, device=parts[0].device))


__all__ = ["Call", "DeviceLayout", "HOME", "BUF", "MSG", "build_layout", "mask_table", "rows_of", "new_like_rows",
           "cat_as"]
