"""Per-plan tables every executor derives once and caches per plan object (``plan_tables``).

``PlanTables`` holds what all devices and steps of one plan share: the local row offsets of each token
block, the packed batch's mask ranges, each (direction, device)'s op stream (``Op``: launch / wait /
compute / reduce, with the kernel calls of each Compute) and buffer layout (``dcp.execute.buffers``),
its compiled steps (``dcp.execute.compile``: every view, copy and merge resolved, every plan error
found), the region layout of every message, and the workspaces (slot buffers and the steps bound to
them) that every step of a plan reuses. ``ensure_valid`` / ``check_tiles_once`` run the validator or a
cheap structural check once per plan object. The interpreter that runs the steps is
``dcp.execute.local.DeviceRunner``.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dcp.errors import ExecutionError
from dcp.execute.buffers import DeviceLayout, build_layout
from dcp.ir.instructions import Unit
from dcp.ir.plan import Plan
from dcp.ir.program import DST, HB, KIND, SRC, TB
from dcp.kernels.tiles import TileTable
from dcp.layout.units import Kind

if TYPE_CHECKING:
    from dcp.execute.compile import Compiled, Dtypes, MessageLayout

INPUT_KINDS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
OUTPUT_KINDS = {"forward": (Kind.O,), "backward": (Kind.DQ, Kind.DKV)}


@dataclass
class Op:
    code: str                 # "launch" | "wait" | "compute" | "reduce"
    round: int = 0
    sends: tuple = ()         # launch: ((peer, (unit, ...)), ...) grouped per peer, units sorted
    recvs: tuple = ()
    calls: tuple = ()         # compute: its kernel calls (``dcp.execute.buffers.Call``)
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
        self.tb_len_list, self.home_list = self.tb_len.tolist(), self.home.tolist()
        # row offset of each token block inside its home's local tensors
        self.local_off = np.zeros(lay.n_token_blocks, dtype=np.int64)
        self.n_local = np.zeros(plan.n_devices, dtype=np.int64)
        for d in range(plan.n_devices):
            blocks = plan.local_blocks(d)
            lens = self.tb_len[blocks]
            self.local_off[blocks] = np.cumsum(lens) - lens
            self.n_local[d] = int(lens.sum())
        self.local_off_list = self.local_off.tolist()
        self._local_index = {}
        self._stages: dict[tuple, tuple] = {}       # (direction, device, tiles) -> kernel calls
        self._programs: dict[tuple, tuple[list[Op], list[int]]] = {}
        self._layouts: dict[tuple, DeviceLayout] = {}
        self._messages: dict = {}                    # dtypes -> {(direction, round, src, dst): MessageLayout}
        self._compiled: dict[tuple, "Compiled"] = {}
        self._workspaces: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._seq_ranges: dict[int, np.ndarray] = {}
        self._mask_rows: dict[int, tuple] = {}
        self.cu_seqlens = np.asarray(plan.spec.cu_seqlens, dtype=np.int64)
        self._scatter = None
        self.validated = False
        self.tiles_checked = False
        self.digest: bytes | None = None  # dcp.execute.agreement.plan_digest

    # -- local rows
    def local_index(self, device: int) -> torch.Tensor:
        idx = self._local_index.get(device)
        if idx is None:
            idx = torch.from_numpy(self.plan.local_token_index(device).astype(np.int64))
            self._local_index[device] = idx
        return idx

    def scatter_index(self) -> tuple[torch.Tensor, list[int], bool]:
        """(rows of every device's local layout, concatenated in device order; rows per device; whether that
        is the identity permutation) for scattering a packed batch to all devices at once."""
        if self._scatter is None:
            idx = [self.plan.local_token_index(d) for d in range(self.plan.n_devices)]
            perm = np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, dtype=np.int64)
            self._scatter = (torch.from_numpy(perm), [int(i.size) for i in idx],
                             bool(np.array_equal(perm, np.arange(perm.size))))
        return self._scatter

    # -- mask ranges of packed rows, local to their sequence
    def ranges_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """int64 ``[len(rows), R, 2]``: the sequence-local key ranges (``spec.kv_ranges``) of packed rows
        ``rows``, padded with empty slots. Each sequence's ranges are fetched once per plan, and only for
        sequences some rank asks for."""
        cu = self.cu_seqlens
        seq = np.searchsorted(cu, rows, side="right") - 1
        per = {}
        for s in np.unique(seq).tolist():
            got = self._seq_ranges.get(s)
            if got is None:
                got = self._seq_ranges[s] = np.asarray(self.plan.spec.kv_ranges(s))
            per[s] = got
        r = max((x.shape[1] for x in per.values()), default=1)
        out = np.zeros((rows.size, r, 2), dtype=np.int64)
        for s, x in per.items():
            sel = seq == s
            out[sel, :x.shape[1]] = x[rows[sel] - cu[s]]
        return out

    def mask_rows(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """The masks of every partial tile ``device`` runs, made at once (its kernel calls of both directions
        take theirs from here): (int64 ``[n_tiles]``: each such tile's first row in the second array, -1 for
        the other tiles; int64 ``[rows, R, 2]``: per row of the tile's q block, its sequence-local key ranges
        clipped and shifted to the tile's kv block, empty ones (0, 0))."""
        got = self._mask_rows.get(device)
        if got is None:
            plan, lay = self.plan, self.plan.layout
            ts = plan.tiles
            t = np.flatnonzero((np.asarray(plan.tile_device) == device) & ~ts.full.astype(bool))
            q_tb, kv_tb = ts.q_tb[t].astype(np.int64), ts.kv_tb[t].astype(np.int64)
            plens = self.tb_len[q_tb]
            starts = np.cumsum(plens) - plens
            pos = np.full(ts.n_tiles, -1, dtype=np.int64)
            pos[t] = starts
            rep = np.repeat(np.arange(t.size), plens)
            rows = lay.tb_start[q_tb][rep].astype(np.int64) + (np.arange(rep.size) - starts[rep])
            ks = (lay.tb_start[kv_tb].astype(np.int64) - self.cu_seqlens[lay.tb_seq[kv_tb]])[rep]
            ke = ks + self.tb_len[kv_tb][rep]
            rng = self.ranges_of_rows(rows)                         # [n_rows, R, 2], sequence-local
            s = np.clip(rng[:, :, 0], ks[:, None], ke[:, None]) - ks[:, None]
            e = np.clip(rng[:, :, 1], ks[:, None], ke[:, None]) - ks[:, None]
            empty = e <= s
            s[empty], e[empty] = 0, 0
            got = self._mask_rows[device] = (pos, np.stack([s, e], axis=-1))
        return got

    # -- compiled programs
    def program(self, direction: str, device: int) -> tuple[list[Op], list[int]]:
        """(ops, segment starts): segment r (r >= 1) begins at round r's launch; segment 0 precedes it.
        Compiling also derives the device's buffer layout (``layout``) and every Compute's calls."""
        key = (direction, device)
        got = self._programs.get(key)
        if got is None:
            ops, starts = self._compile(direction, device)
            self._layouts[key] = build_layout(self, device, ops, INPUT_KINDS[direction], TileTable)
            for op in ops:
                if op.code == "compute":
                    op.calls = self._stages.setdefault((direction, device, op.tiles), op.calls)
            got = self._programs[key] = (ops, starts)
        return got

    def layout(self, direction: str, device: int) -> DeviceLayout:
        self.program(direction, device)
        return self._layouts[(direction, device)]

    def _compile(self, direction: str, device: int):
        """Ops of the device's canonical stream (``dcp.ir.program.DeviceIndex.stream``), from its index ranges."""
        if not 0 <= device < self.plan.n_devices:
            raise ExecutionError(f"{direction}: device {device} is not one of the plan's {self.plan.n_devices}")
        ops, starts = [], [0]
        for op in self.plan.index(direction).stream(device):
            code = op[0]
            if code == "launch":
                starts.append(len(ops))
                ops.append(Op("launch", round=op[1], sends=_group(op[2], DST), recvs=_group(op[3], SRC)))
            elif code == "wait":
                ops.append(Op("wait", round=op[1]))
            elif code == "compute":
                ops.append(Op("compute", round=op[1], tiles=tuple(op[2].tolist())))
            else:
                kind, tb, hb = op[1]
                ops.append(Op("reduce", unit=Unit(_KIND[kind], tb, hb), sources=op[2]))
        return ops, starts

    # -- compiled steps, message layouts, workspaces
    def compiled(self, direction: str, device: int, dt: "Dtypes") -> "Compiled":
        """The device's compiled steps (``dcp.execute.compile``; raises ``ExecutionError`` for a plan the
        device cannot run)."""
        key = (direction, device, dt)
        got = self._compiled.get(key)
        if got is None:
            from dcp.execute.compile import compile_program

            got = self._compiled[key] = compile_program(self, direction, device, dt)
        return got

    def message_layout(self, key: tuple, units: tuple, dt: "Dtypes") -> "MessageLayout":
        """Regions of the message ``key`` = (direction, round, src, dst) carrying ``units`` (cached per key and dtypes;
        ``dcp.execute.compile.message_layout``)."""
        cache = self.message_layouts(dt)
        got = cache.get(key)
        if got is None:
            from dcp.execute.compile import message_layout

            got = cache[key] = message_layout(self, units, dt)
        return got

    def message_layouts(self, dt: "Dtypes") -> dict:
        """The cache of ``message_layout`` in dtypes ``dt`` (a compiler looks it up once, not per message):
        ``{(direction, round, src, dst): MessageLayout}``."""
        got = self._messages.get(dt)
        if got is None:
            got = self._messages[dt] = {}
        return got

    def workspace(self, key: tuple, make):
        """The cached workspace ``key``, marked busy (``busy = False`` frees it), if no runner holds it; else
        (or the first time) ``make()`` (only the first is cached)."""
        with self._lock:
            got = self._workspaces.get(key)
            if got is None:
                got = self._workspaces[key] = make()
            elif got.busy:
                got = make()
            got.busy = True
        return got


_KIND = tuple(Kind)  # Kind(i) is slow: _KIND[i]


def _group(rows: np.ndarray, peer_col: int) -> tuple:
    """((peer, (unit, ...)), ...) of one round's transfer rows, per peer in order, units sorted (the rows of
    ``DeviceIndex`` come by (peer, kind, tb, hb) within a round already: sender and receiver see one order)."""
    by_peer: dict[int, list] = {}
    new, kinds = tuple.__new__, _KIND  # Unit(...) without its Python-level __new__
    for kind, tb, hb, peer in rows[:, [KIND, TB, HB, peer_col]].tolist():
        us = by_peer.get(peer)
        if us is None:
            us = by_peer[peer] = []
        us.append(new(Unit, (kinds[kind], tb, hb)))
    return tuple((p, tuple(us)) for p, us in sorted(by_peer.items()))


_TABLES: "weakref.WeakKeyDictionary[Plan, PlanTables]" = weakref.WeakKeyDictionary()


def plan_tables(plan: Plan) -> PlanTables:
    """The cached derived tables of ``plan`` (built on first use)."""
    tab = _TABLES.get(plan)
    if tab is None:
        if plan.layout.grouped:  # executors run a grouped plan as the equivalent plan over its pieces
            from dcp.ir.expand import expand_pieces

            tab = PlanTables(expand_pieces(plan))
        else:
            tab = PlanTables(plan)
        _TABLES[plan] = tab
    return tab


def check_tiles_once(plan: Plan) -> None:
    """Cheap structural check run even without full validation (cached per plan): every tile has a device
    of the cluster and, in each direction, one stage >= 0 (the columnar IR runs each tile exactly once,
    on its device, in its stage). Raises ``ExecutionError``."""
    tab = plan_tables(plan)
    if tab.tiles_checked:
        return
    n, dev = plan.tiles.n_tiles, np.asarray(plan.tile_device)
    if dev.shape != (n,) or (n and (dev.min() < 0 or dev.max() >= plan.n_devices)):
        raise ExecutionError(f"tile_device must give each of the {n} tiles a device of the {plan.n_devices}")
    for direction in ("forward", "backward"):
        stage = np.asarray(plan.columns(direction).tile_stage)
        if stage.shape != (n,) or (n and stage.min() < 0):
            raise ExecutionError(f"{direction}: tile_stage must give each of the {n} tiles a stage >= 0")
    tab.tiles_checked = True


def ensure_valid(plan: Plan, full: bool = True) -> None:
    """``dcp.ir.validate.validate(plan)`` once per plan object (raises ``PlanValidationError``); with
    ``full=False`` only ``check_tiles_once``."""
    tab = plan_tables(plan)
    if full and not tab.validated:
        from dcp.ir.validate import validate

        validate(plan)
        tab.validated = True
    check_tiles_once(plan)
