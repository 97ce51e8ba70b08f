"""The per-device interpreter shared by every executor.

A ``DeviceRunner`` executes one device's instruction stream (``plan.forward[d]`` or ``plan.backward[d]``)
against that device's home rows. Transfers go through a ``Comm`` (in-memory for the reference executor,
``torch.distributed`` for the distributed one):

    handle = comm.launch(round, sends=[(peer, uint8 tensor), ...], recvs=[(peer, shape, dtype), ...])
    tensors = comm.wait(handle)          # in the order of ``recvs``

Everything a device sends to one peer in one round is packed into ONE contiguous uint8 buffer (the units
in sorted order, each of its tensors padded to 8 bytes so that the receiver can view them back in place),
so a round is one grouped operation with at most one message per peer and direction.

Data held by a device:
- home rows: q/k/v (forward), plus dO, lse, delta (backward), local layout = home token blocks stacked in
  block-id order (``plan.local_token_index(d)``);
- received inputs per unit (Q, KV, QG), possibly relayed onwards later;
- one accumulator per partial output unit: O = (o, lse) merged by log-sum-exp, DQ = dq, DKV = (dk, dv)
  summed; accumulators are fp32 (fp64 for fp64 runs);
- received partials, merged into the accumulator by ``Reduce``.

``Compute(stage, tiles)`` builds ONE tile table for all tiles of the instruction: the distinct q units are
the q segments of a q buffer, the distinct kv units contiguous segments of a kv buffer (units of all head
blocks are stacked along the token axis: every unit has the same heads per block), so a stage is one
kernel call. The tables (segments, tiles, clipped mask ranges) are derived once per plan and cached.

Unit payloads (one unit = one token block × one head block, L tokens):
    Q: q [L, hq, D]                 KV: k, v [L, hkv, D]
    O: o [L, hq, D], lse [hq, L]    QG: q, dO [L, hq, D], lse, delta [hq, L]
    DQ: dq [L, hq, D]               DKV: dk, dv [L, hkv, D]
with q/k/v/dO and partials (o, dq, dk, dv) in the element dtype (as ``dcp.units.bytes_per_token`` counts
them; ``partial_dtype`` may raise partials to fp32) and lse/delta in fp32 (fp64 for fp64 runs).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from dcp.errors import ExecutionError
from dcp.plan import CommLaunch, CommWait, Compute, Plan, Reduce, Unit
from dcp.units import Kind

INPUT_KINDS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
OUTPUT_KINDS = {"forward": (Kind.O,), "backward": (Kind.DQ, Kind.DKV)}
_ALIGN = 8  # every packed tensor starts at a multiple of 8 bytes


# --------------------------------------------------------------------------------------------- comm
class Comm(Protocol):
    """Point-to-point transfers of one device, grouped per round."""

    def launch(self, round: int, sends: list[tuple[int, torch.Tensor]],
               recvs: list[tuple[int, tuple, torch.dtype]]) -> Any:
        """Post this round's sends and receives (non-blocking); return a handle for ``wait``."""

    def wait(self, handle: Any) -> list[torch.Tensor]:
        """Block until the round's transfers are done; the received tensors in the order of ``recvs``."""


# ------------------------------------------------------------------------------------------ kernels
def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse / delta / accumulator dtype: fp64 for fp64 runs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class FallbackTileTable:
    """Same fields as ``dcp.kernels.tiles.TileTable`` (used only when dcp.kernels is not importable)."""

    seg_cu: torch.Tensor
    seg_tile_ptr: torch.Tensor
    tile_k_start: torch.Tensor
    tile_k_len: torch.Tensor
    tile_mask_row: torch.Tensor
    mask_ranges: torch.Tensor


def _dense_mask(tiles, tq: int, tk: int) -> np.ndarray:
    """Boolean ``[tq, tk]`` matrix of the (q row, key) pairs a tile table attends (vectorized)."""
    seg_cu = np.asarray(tiles.seg_cu, dtype=np.int64)
    ptr = np.asarray(tiles.seg_tile_ptr, dtype=np.int64)
    ks = np.asarray(tiles.tile_k_start, dtype=np.int64)
    kl = np.asarray(tiles.tile_k_len, dtype=np.int64)
    mrow = np.asarray(tiles.tile_mask_row, dtype=np.int64)
    mr = np.asarray(tiles.mask_ranges, dtype=np.int64)
    if mr.ndim != 3 or mr.shape[0] == 0:
        mr = np.zeros((0, 1, 2), dtype=np.int64)
    n_tiles = ks.size
    diff = np.zeros((tq, tk + 1), dtype=np.int64)
    if n_tiles == 0:
        return np.zeros((tq, tk), dtype=bool)
    tile_seg = np.repeat(np.arange(ptr.size - 1), np.diff(ptr))
    seg_len = np.diff(seg_cu)
    rows_per_tile = seg_len[tile_seg]
    t_of_row = np.repeat(np.arange(n_tiles), rows_per_tile)
    i_in_tile = np.arange(t_of_row.size) - np.repeat(np.cumsum(rows_per_tile) - rows_per_tile, rows_per_tile)
    row = seg_cu[tile_seg][t_of_row] + i_in_tile
    full = mrow[t_of_row] < 0
    # full tiles: one range per row
    s_full = ks[t_of_row][full]
    e_full = s_full + kl[t_of_row][full]
    r_full = row[full]
    # partial tiles: all slots of their mask rows, shifted to the key buffer
    pr = ~full
    mr_rows = mrow[t_of_row][pr] + i_in_tile[pr]
    slots = mr[mr_rows] if mr_rows.size else np.zeros((0, mr.shape[1], 2), dtype=np.int64)
    s_part = (slots[:, :, 0] + ks[t_of_row][pr][:, None]).reshape(-1)
    e_part = (slots[:, :, 1] + ks[t_of_row][pr][:, None]).reshape(-1)
    r_part = np.repeat(row[pr], mr.shape[1])
    used = slots[:, :, 1].reshape(-1) > slots[:, :, 0].reshape(-1)
    r_all = np.concatenate([r_full, r_part[used]])
    s_all = np.concatenate([s_full, s_part[used]])
    e_all = np.concatenate([e_full, e_part[used]])
    np.add.at(diff, (r_all, s_all), 1)
    np.add.at(diff, (r_all, e_all), -1)
    return np.cumsum(diff, axis=1)[:, :tk] > 0


class FallbackKernels:
    """Small dense pure-PyTorch tile kernels with the ``dcp.kernels`` interface (stopgap / cross-check).

    Materializes the ``[Tq, Tk]`` mask of the whole stage and computes in fp32 (fp64 for fp64 inputs)."""

    name = "execute-fallback"

    @staticmethod
    def _heads(x, hkv):
        """[T, Hq, D] -> [Hkv, g*T, D] (query heads of one kv head stacked along rows)."""
        t, h, d = x.shape
        return x.reshape(t, hkv, h // hkv, d).permute(1, 2, 0, 3).reshape(hkv, (h // hkv) * t, d)

    @staticmethod
    def _unheads(x, t):
        """[Hkv, g*T, D] -> [T, Hq, D]."""
        hkv, gt, d = x.shape
        return x.reshape(hkv, gt // t, t, d).permute(2, 0, 1, 3).reshape(t, hkv * (gt // t), d)

    def _probs_setup(self, q_thd, k_thd, tiles, scale):
        tq, hq, d = q_thd.shape
        tk, hkv = k_thd.shape[0], k_thd.shape[1]
        cdt = _stat_dtype(q_thd.dtype)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        mask = torch.from_numpy(_dense_mask(tiles, tq, tk)).to(q_thd.device)  # [tq, tk]
        qh = self._heads(q_thd.to(cdt), hkv)                                   # [hkv, g*tq, d]
        kh = k_thd.to(cdt).permute(1, 0, 2)                                    # [hkv, tk, d]
        s = torch.bmm(qh, kh.transpose(1, 2)).view(hkv, hq // hkv, tq, tk) * scale
        return s.masked_fill(~mask, float("-inf")), mask, qh, kh, cdt, scale

    def forward(self, q_thd, k_thd, v_thd, tiles, scale=None):
        tq, hq, d = q_thd.shape
        hkv = k_thd.shape[1]
        s, _, _, _, cdt, _ = self._probs_setup(q_thd, k_thd, tiles, scale)
        m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.full(s.shape[:-1] + (1,), float("-inf"),
                                                                      dtype=s.dtype, device=s.device)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        p = p * torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
        vh = v_thd.to(cdt).permute(1, 0, 2)
        o = self._unheads(torch.bmm(p.reshape(hkv, -1, p.shape[-1]), vh), tq)
        lse = (torch.log(denom) + m).reshape(hq, tq)
        return o.to(q_thd.dtype), lse.to(cdt)

    def backward(self, do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles, scale=None, out_dtype=None):
        tq, hq, d = q_thd.shape
        tk, hkv = k_thd.shape[0], k_thd.shape[1]
        s, mask, qh, kh, cdt, scale = self._probs_setup(q_thd, k_thd, tiles, scale)
        lse = lse_ht.to(cdt).reshape(hkv, hq // hkv, tq, 1)
        fin = torch.isfinite(lse)
        p = torch.where(mask & fin, torch.exp(s - torch.where(fin, lse, torch.zeros_like(lse))),
                        torch.zeros_like(s)).reshape(hkv, -1, tk)                  # [hkv, g*tq, tk]
        doh = self._heads(do_thd.to(cdt), hkv)
        vh = v_thd.to(cdt).permute(1, 0, 2)
        dv = torch.bmm(p.transpose(1, 2), doh)                                       # [hkv, tk, d]
        dp = torch.bmm(doh, vh.transpose(1, 2))
        ds = p * (dp - delta_ht.to(cdt).reshape(hkv, -1, 1))
        dq = self._unheads(torch.bmm(ds, kh), tq) * scale
        dk = torch.bmm(ds.transpose(1, 2), qh) * scale
        out = out_dtype or q_thd.dtype
        return dq.to(out), dk.permute(1, 0, 2).to(out), dv.permute(1, 0, 2).to(out)

    @staticmethod
    def merge_into(o_acc, lse_acc, o_new, lse_new):
        """In place: (o_acc, lse_acc) <- LSE merge of both partials. o [T, H, D], lse [H, T]."""
        lse_new = lse_new.to(lse_acc.dtype)
        mx = torch.maximum(lse_acc, lse_new)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        wa, wb = torch.exp(lse_acc - mx), torch.exp(lse_new - mx)
        tot = wa + wb
        inv = torch.where(tot > 0, 1.0 / tot, torch.zeros_like(tot))
        ca, cb = ((w * inv).t()[..., None].to(o_acc.dtype) for w in (wa, wb))
        o_acc.mul_(ca).add_(o_new.to(o_acc.dtype) * cb)
        lse_acc.copy_(torch.log(tot) + mx)
        return o_acc, lse_acc

    def merge_partials(self, o_list, lse_list):
        o, lse = o_list[0].clone(), lse_list[0].clone()
        for o_new, lse_new in zip(o_list[1:], lse_list[1:]):
            self.merge_into(o, lse, o_new, lse_new)
        return o, lse


class KernelAdapter:
    """The kernels an executor calls: ``dcp.kernels`` for fp32/bf16/fp16 and, for fp64 inputs, the same
    kernels only if they keep the row statistics (lse, delta) in fp64 — fp32 statistics cap the accuracy
    of an fp64 run near 1e-7 — else the dense fallback here (probed once per kernels object)."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.name = getattr(kernels, "name", type(kernels).__name__)
        self._fp64 = None

    def _fp64_capable(self) -> bool:
        if self._fp64 is None:
            ok = False
            try:
                tt = _tile_table_cls()
                i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
                table = tt(seg_cu=i32([0, 1]), seg_tile_ptr=i32([0, 1]), tile_k_start=i32([0]),
                           tile_k_len=i32([1]), tile_mask_row=i32([-1]),
                           mask_ranges=torch.zeros((0, 1, 2), dtype=torch.int32))
                x = torch.ones((1, 1, 1), dtype=torch.float64)
                _, lse = self.kernels.forward(x, x, x, table, 1.0)
                if lse.dtype == torch.float64:
                    st = torch.zeros((1, 1), dtype=torch.float64)
                    self.kernels.backward(x, x, x, x, st, st, table, 1.0, out_dtype=torch.float64)
                    ok = True
            except Exception:  # noqa: BLE001 - any refusal means: not fp64-capable
                ok = False
            self._fp64 = ok
        return self._fp64

    def for_input(self, dtype: torch.dtype, device: torch.device):
        """The kernels to run inputs of this dtype on this device with."""
        if dtype == torch.float64 and not isinstance(self.kernels, FallbackKernels) and not self._fp64_capable():
            return _FALLBACK
        if device.type != "cpu" and getattr(self.kernels, "name", "") == "native":
            from dcp.kernels import get_kernels  # the C++ attention kernels take CPU tensors only

            return get_kernels("reference")
        return self.kernels


_FALLBACK = FallbackKernels()


_ADAPTERS: dict = {}


def resolve_kernels(kernels=None) -> KernelAdapter:
    """``None``/"auto"/"reference"/"native" → ``dcp.kernels.get_kernels(name)`` ("fallback": the small
    dense kernels here, also used while ``dcp.kernels`` is not importable); objects with ``forward``,
    ``backward`` and ``merge_into`` pass through. Returns a ``KernelAdapter`` (cached per name / object,
    so the fp64 probe runs once)."""
    if isinstance(kernels, KernelAdapter):
        return kernels
    if kernels is not None and not isinstance(kernels, str):
        key = ("object", id(kernels))
        got = _ADAPTERS.get(key)
        if got is None or got.kernels is not kernels:
            got = _ADAPTERS[key] = KernelAdapter(kernels)
        return got
    name = kernels or "auto"
    got = _ADAPTERS.get(name)
    if got is None:
        if name == "fallback":
            got = KernelAdapter(_FALLBACK)
        else:
            try:
                from dcp.kernels import get_kernels
            except ImportError:
                got = KernelAdapter(_FALLBACK)
            else:
                got = KernelAdapter(get_kernels(name))
        _ADAPTERS[name] = got
    return got


def _tile_table_cls():
    try:
        from dcp.kernels.tiles import TileTable
        return TileTable
    except ImportError:
        return FallbackTileTable


# ------------------------------------------------------------------------------------ plan tables
@dataclass
class StageTable:
    """Derived once per Compute instruction: its q/kv units, buffers' layout and the tile table."""

    n_tiles: int
    q_tb: np.ndarray          # q units (token block, head block), in segment order
    q_hb: np.ndarray
    q_cu: list                # q buffer rows of unit i: q_cu[i]:q_cu[i+1]
    q_count: list             # tiles per q unit
    kv_tb: np.ndarray         # kv units, in kv buffer order
    kv_hb: np.ndarray
    kv_cu: list
    kv_count: list
    table: Any                # TileTable (CPU int32 tensors)


@dataclass
class Op:
    code: str                 # "launch" | "wait" | "compute" | "reduce"
    round: int = 0
    sends: tuple = ()         # launch: ((peer, (unit, ...)), ...) grouped per peer, units sorted
    recvs: tuple = ()
    stage: StageTable | None = None
    tiles: tuple = ()
    unit: Unit | None = None
    sources: tuple = ()


class PlanTables:
    """Per-plan derived data shared by every device and step (built lazily, cached per plan object)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        spec, lay = plan.spec, plan.layout
        self.hq, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.hqb, self.nhb = lay.head_block_size, lay.n_head_blocks
        self.kvb = lay.kv_heads_per_block
        g = spec.group_size
        # kv heads of head block hb (GQA): the kv head of its first query head onwards (when a block has
        # fewer query heads than a kv group, the group's single kv head is shared by several blocks)
        self.kv_lo = [(hb * self.hqb) // g for hb in range(self.nhb)]
        self.tb_len = lay.tb_len.astype(np.int64)
        self.home = plan.home.astype(np.int64)
        # row offset of each token block inside its home's local tensors
        self.local_off = np.zeros(lay.n_token_blocks, dtype=np.int64)
        self.n_local = np.zeros(plan.n_devices, dtype=np.int64)
        for d in range(plan.n_devices):
            blocks = plan.local_blocks(d)
            lens = self.tb_len[blocks]
            self.local_off[blocks] = np.cumsum(lens) - lens
            self.n_local[d] = int(lens.sum())
        self._local_index = {}
        self._stages: dict[tuple, StageTable] = {}
        self._programs: dict[tuple, tuple[list[Op], list[int]]] = {}
        self._granges = None
        self.validated = False
        self.tiles_checked = False

    # -- local rows
    def local_index(self, device: int) -> torch.Tensor:
        idx = self._local_index.get(device)
        if idx is None:
            idx = torch.from_numpy(self.plan.local_token_index(device).astype(np.int64))
            self._local_index[device] = idx
        return idx

    # -- mask ranges of the packed batch, local to each sequence, padded to the max slot count
    def global_ranges(self) -> np.ndarray:
        if self._granges is None:
            spec = self.plan.spec
            per_seq = [spec.kv_ranges(s) for s in range(spec.num_seqs)]
            r = max(x.shape[1] for x in per_seq)
            out = np.zeros((spec.total_tokens, r, 2), dtype=np.int32)
            cu = spec.cu_seqlens
            for s, x in enumerate(per_seq):
                out[cu[s]:cu[s + 1], :x.shape[1]] = x
            self._granges = out
        return self._granges

    def stage(self, tiles: tuple[int, ...]) -> StageTable:
        st = self._stages.get(tiles)
        if st is None:
            st = self._build_stage(np.asarray(tiles, dtype=np.int64))
            self._stages[tiles] = st
        return st

    def _build_stage(self, t: np.ndarray) -> StageTable:
        plan, lay, ts = self.plan, self.plan.layout, self.plan.tiles
        nhb = self.nhb
        q_tb, kv_tb, hb = ts.q_tb[t].astype(np.int64), ts.kv_tb[t].astype(np.int64), ts.hb[t].astype(np.int64)
        qkey, kvkey = q_tb * nhb + hb, kv_tb * nhb + hb
        order = np.lexsort((kvkey, qkey))
        t, q_tb, kv_tb, hb, qkey, kvkey = t[order], q_tb[order], kv_tb[order], hb[order], qkey[order], kvkey[order]
        uq, q_inv, q_cnt = np.unique(qkey, return_inverse=True, return_counts=True)
        ukv, kv_inv, kv_cnt = np.unique(kvkey, return_inverse=True, return_counts=True)
        q_len = self.tb_len[uq // nhb]
        kv_len = self.tb_len[ukv // nhb]
        q_cu = np.r_[0, np.cumsum(q_len)]
        kv_cu = np.r_[0, np.cumsum(kv_len)]
        seg_tile_ptr = np.r_[0, np.cumsum(q_cnt)]
        tile_k_start = kv_cu[kv_inv]
        tile_k_len = kv_len[kv_inv]
        full = ts.full[t].astype(bool)
        tile_rows = self.tb_len[q_tb]
        tile_mask_row = np.full(t.size, -1, dtype=np.int64)
        part = np.flatnonzero(~full)
        if part.size:
            plens = tile_rows[part]
            starts = np.cumsum(plens) - plens
            tile_mask_row[part] = starts
            # global rows of every partial tile's q block, their sequence-local kv ranges, clipped and
            # shifted to the tile's kv block
            rep = np.repeat(np.arange(part.size), plens)
            within = np.arange(rep.size) - starts[rep]
            rows = lay.tb_start[q_tb[part]][rep].astype(np.int64) + within
            ks = (lay.tb_start[kv_tb[part]].astype(np.int64) - plan.spec.cu_seqlens[lay.tb_seq[kv_tb[part]]])[rep]
            ke = ks + self.tb_len[kv_tb[part]][rep]
            rng = self.global_ranges()[rows].astype(np.int64)      # [n_rows, R, 2], sequence-local
            s = np.clip(rng[:, :, 0], ks[:, None], ke[:, None]) - ks[:, None]
            e = np.clip(rng[:, :, 1], ks[:, None], ke[:, None]) - ks[:, None]
            empty = e <= s
            s[empty], e[empty] = 0, 0
            # keep only the slots some row uses
            used_cols = np.flatnonzero((~empty).any(axis=0))
            ncol = int(used_cols[-1]) + 1 if used_cols.size else 1
            mask_ranges = np.stack([s[:, :ncol], e[:, :ncol]], axis=-1)
        else:
            mask_ranges = np.zeros((0, 1, 2), dtype=np.int64)
        i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        table_cls = _tile_table_cls()
        table = table_cls(seg_cu=i32(q_cu), seg_tile_ptr=i32(seg_tile_ptr), tile_k_start=i32(tile_k_start),
                          tile_k_len=i32(tile_k_len), tile_mask_row=i32(tile_mask_row),
                          mask_ranges=i32(mask_ranges))
        return StageTable(int(t.size), uq // nhb, uq % nhb, q_cu.tolist(), q_cnt.tolist(), ukv // nhb,
                          ukv % nhb, kv_cu.tolist(), kv_cnt.tolist(), table)

    # -- compiled programs
    def program(self, direction: str, device: int) -> tuple[list[Op], list[int]]:
        """(ops, segment starts): segment r (r >= 1) begins at round r's launch; segment 0 precedes it."""
        key = (direction, device)
        got = self._programs.get(key)
        if got is None:
            got = self._compile(direction, device)
            self._programs[key] = got
        return got

    def _compile(self, direction: str, device: int):
        prog = self.plan.program(direction)
        if len(prog) != self.plan.n_devices or prog[device].device != device:
            raise ExecutionError(f"{direction} program does not list device {device} at index {device}")
        ops, starts = [], [0]
        for ins in prog[device].instructions:
            if isinstance(ins, CommLaunch):
                starts.append(len(ops))
                ops.append(Op("launch", round=ins.round, sends=_group(ins.sends), recvs=_group(ins.recvs)))
            elif isinstance(ins, CommWait):
                ops.append(Op("wait", round=ins.round))
            elif isinstance(ins, Compute):
                ops.append(Op("compute", round=ins.stage, stage=self.stage(tuple(ins.tiles)), tiles=ins.tiles))
            elif isinstance(ins, Reduce):
                ops.append(Op("reduce", unit=Unit(Kind(ins.unit.kind), ins.unit.tb, ins.unit.hb),
                              sources=tuple(ins.sources)))
            else:
                raise ExecutionError(f"{direction} device {device}: unknown instruction {ins!r}")
        return ops, starts

    # -- payload layout of a unit
    def pieces(self, kind: Kind, tb: int, dt: "Dtypes") -> list[tuple[tuple, torch.dtype]]:
        n = int(self.tb_len[tb])
        hq, hkv, d = self.hqb, self.kvb, self.d
        if kind == Kind.Q:
            return [((n, hq, d), dt.el)]
        if kind == Kind.KV:
            return [((n, hkv, d), dt.el)] * 2
        if kind == Kind.O:
            return [((n, hq, d), dt.part), ((hq, n), dt.stat)]
        if kind == Kind.QG:
            return [((n, hq, d), dt.el)] * 2 + [((hq, n), dt.stat)] * 2
        if kind == Kind.DQ:
            return [((n, hq, d), dt.part)]
        if kind == Kind.DKV:
            return [((n, hkv, d), dt.part)] * 2
        raise ExecutionError(f"unknown unit kind {kind!r}")


def _group(transfers) -> tuple:
    by_peer: dict[int, list] = {}
    for unit, peer in transfers:
        by_peer.setdefault(int(peer), []).append(Unit(Kind(unit.kind), int(unit.tb), int(unit.hb)))
    return tuple((p, tuple(sorted(us))) for p, us in sorted(by_peer.items()))


_TABLES: "weakref.WeakKeyDictionary[Plan, PlanTables]" = weakref.WeakKeyDictionary()


def plan_tables(plan: Plan) -> PlanTables:
    """The cached derived tables of ``plan`` (built on first use)."""
    tab = _TABLES.get(plan)
    if tab is None:
        tab = PlanTables(plan)
        _TABLES[plan] = tab
    return tab


def check_tiles_once(plan: Plan) -> None:
    """Cheap structural check run even without full validation (cached per plan): in each direction every
    tile is computed exactly once, on its assigned device. Raises ``ExecutionError``."""
    tab = plan_tables(plan)
    if tab.tiles_checked:
        return
    n = plan.tiles.n_tiles
    for direction in ("forward", "backward"):
        prog = plan.program(direction)
        if len(prog) != plan.n_devices:
            raise ExecutionError(f"{direction} program has {len(prog)} devices, the plan's cluster "
                                 f"{plan.n_devices}")
        ids, devs = [], []
        for d, p in enumerate(prog):
            for ins in p.instructions:
                if isinstance(ins, Compute):
                    ids.append(np.asarray(ins.tiles, dtype=np.int64))
                    devs.append(np.full(len(ins.tiles), d, dtype=np.int64))
        ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        devs = np.concatenate(devs) if devs else np.zeros(0, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise ExecutionError(f"{direction}: a Compute names a tile outside 0..{n - 1}")
        runs = np.bincount(ids, minlength=n)
        if (runs != 1).any():
            t = int(np.flatnonzero(runs != 1)[0])
            raise ExecutionError(f"{direction}: tile {t} is computed {int(runs[t])} times (must be exactly once)")
        wrong = plan.tile_device[ids] != devs
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise ExecutionError(f"{direction}: device {int(devs[i])} computes tile {int(ids[i])}, assigned to "
                                 f"device {int(plan.tile_device[ids[i]])}")
    tab.tiles_checked = True


def ensure_valid(plan: Plan, full: bool = True) -> None:
    """``dcp.validate.validate(plan)`` once per plan object (raises ``PlanValidationError``); with
    ``full=False`` only ``check_tiles_once``."""
    tab = plan_tables(plan)
    if full and not tab.validated:
        from dcp.validate import validate

        validate(plan)
        tab.validated = True
    check_tiles_once(plan)


# ------------------------------------------------------------------------------------ packing
@dataclass(frozen=True)
class Dtypes:
    el: torch.dtype      # q/k/v/dO
    part: torch.dtype    # partial outputs on the wire
    stat: torch.dtype    # lse, delta, accumulators

    @staticmethod
    def of(dtype: torch.dtype, partial_dtype: torch.dtype | None = None) -> "Dtypes":
        return Dtypes(dtype, partial_dtype or dtype, _stat_dtype(dtype))


def _nbytes(shape, dtype) -> int:
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return -(-n // _ALIGN) * _ALIGN


def pack(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """One contiguous uint8 buffer holding ``tensors`` back to back, each padded to 8 bytes."""
    parts = []
    for t in tensors:
        f = t.reshape(-1)
        if f.numel() and f.stride(0) != 1:  # e.g. a one-element slice keeps its parent's stride
            f = f.new_empty(f.shape).copy_(f)
        b = f.view(torch.uint8)
        parts.append(b)
        pad = -b.numel() % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unpack(buf: torch.Tensor, layout: Sequence[tuple[tuple, torch.dtype]]) -> list[torch.Tensor]:
    out, off = [], 0
    for shape, dtype in layout:
        nb = _nbytes(shape, dtype)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += nb
    return out


# ------------------------------------------------------------------------------------ the runner
class DeviceRunner:
    """Interpreter of one device's program for one direction.

    Args:
        plan, device, direction: what to run.
        home: forward: ``(q, k, v)`` local tensors; backward: ``(q, k, v, do, lse, delta)`` with
            ``lse``/``delta`` ``[Hq, n_local]`` in the stat dtype.
        comm: the device's ``Comm``.
        kernels: object with ``forward``/``backward``/``merge_into`` (see ``dcp.kernels``).
        scale: softmax scale.
        partial_dtype: dtype of partial outputs on the wire (None: the element dtype).
    """

    def __init__(self, plan: Plan, device: int, direction: str, home: Sequence[torch.Tensor], comm: Comm,
                 kernels, scale: float, partial_dtype: torch.dtype | None = None):
        self.plan, self.rank, self.direction = plan, device, direction
        self.tab = plan_tables(plan)
        self.ops, self.seg_starts = self.tab.program(direction, device)
        self.home = home
        self.comm, self.scale = comm, float(scale)
        self.dev = home[0].device
        self.dt = Dtypes.of(home[0].dtype, partial_dtype)
        self.kernels = resolve_kernels(kernels).for_input(self.dt.el, self.dev)
        self.in_q, self.in_kv = INPUT_KINDS[direction]
        self.inputs: dict[Unit, list[torch.Tensor]] = {}
        self.acc: dict[Unit, list[torch.Tensor]] = {}
        self.sent: set[Unit] = set()
        self.inbox: dict[tuple[Unit, int], list[torch.Tensor]] = {}
        self.pending: dict[int, tuple[Any, tuple]] = {}
        self.pc = 0

    # -- segments for lockstep execution
    @property
    def n_rounds(self) -> int:
        return len(self.seg_starts) - 1

    def run_segment(self, r: int, part: str = "all") -> None:
        """Run segment r: ``part`` "launch" (its first op, a launch when r >= 1), "rest", or "all"."""
        a = self.seg_starts[r] if r < len(self.seg_starts) else len(self.ops)
        b = self.seg_starts[r + 1] if r + 1 < len(self.seg_starts) else len(self.ops)
        if r >= 1:
            if part in ("launch", "all"):
                self._step(self.ops[a])
            if part == "launch":
                return
            a += 1
        for op in self.ops[a:b]:
            self._step(op)

    def run(self) -> None:
        for op in self.ops:
            self._step(op)

    # -- instructions
    def _step(self, op: Op) -> None:
        if op.code == "launch":
            self._launch(op)
        elif op.code == "wait":
            self._wait(op)
        elif op.code == "compute":
            self._compute(op)
        else:
            self._reduce(op)

    def _err(self, msg: str) -> ExecutionError:
        return ExecutionError(f"{self.direction} device {self.rank}: {msg}")

    def _home_of(self, tb: int) -> int:
        return int(self.tab.home[tb])

    def _rows(self, tb: int) -> slice:
        off = int(self.tab.local_off[tb])
        return slice(off, off + int(self.tab.tb_len[tb]))

    def _input(self, unit: Unit) -> list[torch.Tensor]:
        got = self.inputs.get(unit)
        if got is not None:
            return got
        if self._home_of(unit.tb) != self.rank:
            raise self._err(f"needs input {unit.kind.name}[{unit.tb},{unit.hb}], which it neither holds nor "
                            f"received")
        rows, tab = self._rows(unit.tb), self.tab
        hq = slice(unit.hb * tab.hqb, (unit.hb + 1) * tab.hqb)
        hk = slice(tab.kv_lo[unit.hb], tab.kv_lo[unit.hb] + tab.kvb)
        h = self.home
        if unit.kind == Kind.Q:
            return [h[0][rows, hq]]
        if unit.kind == Kind.KV:
            return [h[1][rows, hk], h[2][rows, hk]]
        if unit.kind == Kind.QG:
            return [h[0][rows, hq], h[3][rows, hq], h[4][hq, rows], h[5][hq, rows]]
        raise self._err(f"{unit.kind.name} is not an input of the {self.direction} pass")

    def _payload(self, unit: Unit) -> list[torch.Tensor]:
        if unit.kind in (self.in_q, self.in_kv):
            return self._input(unit)
        if unit in self.sent:
            raise self._err(f"sends partial {unit.kind.name}[{unit.tb},{unit.hb}] twice")
        acc = self.acc.pop(unit, None)
        if acc is None:
            raise self._err(f"sends partial {unit.kind.name}[{unit.tb},{unit.hb}], which it never computed")
        self.sent.add(unit)
        if unit.kind == Kind.O:
            return [acc[0].to(self.dt.part), acc[1]]
        return [a.to(self.dt.part) for a in acc]

    def _launch(self, op: Op) -> None:
        sends = [(peer, pack([t for u in units for t in self._payload(u)], self.dev)) for peer, units in op.sends]
        recvs = []
        for peer, units in op.recvs:
            nb = sum(_nbytes(s, dt) for u in units for s, dt in self.tab.pieces(u.kind, u.tb, self.dt))
            recvs.append((peer, (nb,), torch.uint8))
        if op.round in self.pending:
            raise self._err(f"launches round {op.round} twice")
        self.pending[op.round] = (self.comm.launch(op.round, sends, recvs), op.recvs)

    def _wait(self, op: Op) -> None:
        got = self.pending.pop(op.round, None)
        if got is None:
            raise self._err(f"waits for round {op.round}, which it never launched")
        handle, recv_groups = got
        bufs = self.comm.wait(handle)
        for (peer, units), buf in zip(recv_groups, bufs):
            layout = [p for u in units for p in self.tab.pieces(u.kind, u.tb, self.dt)]
            want = sum(_nbytes(s, dt) for s, dt in layout)
            if buf.numel() != want or buf.dtype != torch.uint8:
                raise self._err(f"round {op.round}: message from device {peer} has {buf.numel()} bytes, "
                                f"expected {want}")
            tensors = unpack(buf, layout)
            i = 0
            for u in units:
                n = len(self.tab.pieces(u.kind, u.tb, self.dt))
                part = tensors[i:i + n]
                i += n
                if u.kind in (self.in_q, self.in_kv):
                    self.inputs[u] = part
                else:
                    if (u, peer) in self.inbox:
                        raise self._err(f"receives partial {u.kind.name}[{u.tb},{u.hb}] from {peer} twice")
                    self.inbox[u, peer] = part

    def _acc_add(self, unit: Unit, parts: list[torch.Tensor]) -> None:
        if unit in self.sent:
            raise self._err(f"adds to partial {unit.kind.name}[{unit.tb},{unit.hb}] after sending it")
        acc = self.acc.get(unit)
        if acc is None:
            self.acc[unit] = [p.to(self.dt.stat).clone() if p.dtype == self.dt.stat else p.to(self.dt.stat)
                              for p in parts]
        elif unit.kind == Kind.O:
            self.kernels.merge_into(acc[0], acc[1], parts[0].to(self.dt.stat), parts[1].to(self.dt.stat))
        else:
            for a, p in zip(acc, parts):
                a.add_(p)

    def _reduce(self, op: Op) -> None:
        for src in op.sources:
            parts = self.inbox.pop((op.unit, src), None)
            if parts is None:
                raise self._err(f"reduces {op.unit.kind.name}[{op.unit.tb},{op.unit.hb}] from device {src}, "
                                f"which never sent it")
            self._acc_add(op.unit, parts)

    def _compute(self, op: Op) -> None:
        st = op.stage
        if st.n_tiles == 0:
            return
        nq, nkv = len(st.q_count), len(st.kv_count)
        q_units = [self._input(Unit(self.in_q, int(st.q_tb[i]), int(st.q_hb[i]))) for i in range(nq)]
        kv_units = [self._input(Unit(self.in_kv, int(st.kv_tb[i]), int(st.kv_hb[i]))) for i in range(nkv)]
        cat0 = lambda xs: (xs[0] if len(xs) == 1 else torch.cat(xs, 0)).contiguous()  # noqa: E731
        cat1 = lambda xs: (xs[0] if len(xs) == 1 else torch.cat(xs, 1)).contiguous()  # noqa: E731
        k_buf = cat0([u[0] for u in kv_units])
        v_buf = cat0([u[1] for u in kv_units])
        q_buf = cat0([u[0] for u in q_units])
        if self.direction == "forward":
            o, lse = self.kernels.forward(q_buf, k_buf, v_buf, st.table, self.scale)
            for i in range(nq):
                a, b = st.q_cu[i], st.q_cu[i + 1]
                self._acc_add(Unit(Kind.O, int(st.q_tb[i]), int(st.q_hb[i])), [o[a:b], lse[:, a:b]])
        else:
            do_buf = cat0([u[1] for u in q_units])
            lse_buf = cat1([u[2] for u in q_units])
            delta_buf = cat1([u[3] for u in q_units])
            dq, dk, dv = self.kernels.backward(do_buf, q_buf, k_buf, v_buf, lse_buf, delta_buf,
                                                         st.table, self.scale, out_dtype=self.dt.stat)
            for i in range(nq):
                a, b = st.q_cu[i], st.q_cu[i + 1]
                self._acc_add(Unit(Kind.DQ, int(st.q_tb[i]), int(st.q_hb[i])), [dq[a:b]])
            for i in range(nkv):
                a, b = st.kv_cu[i], st.kv_cu[i + 1]
                self._acc_add(Unit(Kind.DKV, int(st.kv_tb[i]), int(st.kv_hb[i])), [dk[a:b], dv[a:b]])

    # -- results
    def _check_done(self) -> None:
        if self.pending:
            raise self._err(f"rounds {sorted(self.pending)} launched but never waited")
        if self.inbox:
            (u, src) = next(iter(self.inbox))
            raise self._err(f"partial {u.kind.name}[{u.tb},{u.hb}] received from device {src} is never merged")
        for u in self.acc:
            if self._home_of(u.tb) != self.rank:
                raise self._err(f"partial {u.kind.name}[{u.tb},{u.hb}] is never sent to its home "
                                f"{self._home_of(u.tb)}")

    def finish_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_local [n_local, Hq, D] in the element dtype, lse_local [Hq, n_local] in the stat dtype)."""
        self._check_done()
        tab, n = self.tab, int(self.tab.n_local[self.rank])
        o = torch.zeros((n, tab.hq, tab.d), dtype=self.dt.el, device=self.dev)
        lse = torch.full((tab.hq, n), float("-inf"), dtype=self.dt.stat, device=self.dev)
        for u, (ao, al) in self.acc.items():
            rows, hq = self._rows(u.tb), slice(u.hb * tab.hqb, (u.hb + 1) * tab.hqb)
            o[rows, hq] = ao.to(self.dt.el)
            lse[hq, rows] = al
        return o, lse

    def finish_backward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) local, in the element dtype."""
        self._check_done()
        tab, n = self.tab, int(self.tab.n_local[self.rank])
        dq = torch.zeros((n, tab.hq, tab.d), dtype=self.dt.stat, device=self.dev)
        dk = torch.zeros((n, tab.hkv, tab.d), dtype=self.dt.stat, device=self.dev)
        dv = torch.zeros_like(dk)
        for u, parts in self.acc.items():
            rows = self._rows(u.tb)
            if u.kind == Kind.DQ:
                dq[rows, u.hb * tab.hqb:(u.hb + 1) * tab.hqb] += parts[0]
            else:
                hk = slice(tab.kv_lo[u.hb], tab.kv_lo[u.hb] + tab.kvb)
                dk[rows, hk] += parts[0]
                dv[rows, hk] += parts[1]
        el = self.dt.el
        return dq.to(el), dk.to(el), dv.to(el)


def backward_home(q, k, v, o, lse, do) -> tuple:
    """Home inputs of the backward program: (q, k, v, do, lse, delta) with delta = rowsum(dO * O)."""
    stat = _stat_dtype(q.dtype)
    delta = (do.to(stat) * o.to(stat)).sum(-1).t().contiguous()
    return q, k, v, do.contiguous(), lse.to(stat).contiguous(), delta


def default_scale(plan: Plan, scale: float | None) -> float:
    return 1.0 / math.sqrt(plan.spec.head_dim) if scale is None else float(scale)
