"""The static half of the validator: a plan's arrays and program tables, checked against its batch.

What it proves (``check_arrays``, with ``check_columns`` per direction), before the dynamic checks of
``dcp.validate`` (and of its reference, ``dcp.ir.validate_reference``) run:
- every array has the right type, dtype kind and length;
- the block layout covers the batch: token blocks tile the packed rows contiguously in order, each
  inside one sequence (``tb_seq`` / ``tb_start`` / ``tb_len`` / ``seq_tb_ptr`` agree with the spec's
  lengths), and the head blocking is the one ``num_heads`` / ``num_kv_heads`` give;
- the tiles are exactly the batch's: ``dcp.layout.tiles.enumerate_tiles`` on the plan's layout recomputes,
  from the spec's masks, which (q block, kv block, head block) triples hold unmasked pairs, how many
  (``unmasked``), which are fully unmasked (``full``, which lets kernels skip masking) and their FLOPs;
  the plan's tile arrays must equal them. So a plan cannot compute a pair the masks exclude, skip one
  they include, or mask a tile it calls full;
- each direction's program (``dcp.ir.program.Program``) has the right shape: ``tile_stage`` one stage >= 0
  per tile, ``transfers`` and ``merges`` int ``[n, 6]`` tables whose every field is in range (units of
  the direction's kinds, merges of its output kinds only, token and head blocks of the layout, devices of
  the cluster, a peer other than the device itself, rounds from 1 to ``MAX_ROUND``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dcp.cluster import Cluster
from dcp.errors import DcpError, PlanValidationError
from dcp.ir.program import COLUMNS, DST, HB, KIND, ROUND, SRC, TB, Program
from dcp.layout.blocks import head_blocking
from dcp.layout.tiles import enumerate_tiles
from dcp.layout.units import INPUT_KINDS, OUTPUT_KINDS
from dcp.spec import BatchSpec

if TYPE_CHECKING:
    from dcp.ir.plan import Plan

#: rounds and stages beyond this are refused: every device steps through each of them
MAX_ROUND = 1 << 24

class Problems:
    """The first ``limit`` problems a validator finds; ``raise_if_any`` raises them as one error."""

    def __init__(self, limit: int = 20):
        self.items: list[str] = []
        self.limit = limit

    def add(self, msg: str) -> None:
        if len(self.items) < self.limit:
            self.items.append(msg)

    def raise_if_any(self) -> None:
        if self.items:
            raise PlanValidationError("plan is invalid:\n  " + "\n  ".join(self.items))


_KIND_NAMES = {"i": "int", "u": "uint", "b": "bool", "f": "float"}


def _vector(pb, name: str, a, kinds: str, n: int | None = None) -> bool:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in kinds:
        what = "/".join(_KIND_NAMES[k] for k in kinds)
        got = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        pb.add(f"{name} must be a 1-D {what} array, got {got}")
        return False
    if n is not None and a.size != n:
        pb.add(f"{name} has {a.size} entries, expected {n}")
        return False
    return True


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_arrays(plan: Plan, pb) -> None:
    """Types, layout against the spec, head blocking, tiles against the masks, placement ranges."""
    if not isinstance(plan.spec, BatchSpec) or not isinstance(plan.cluster, Cluster):
        pb.add(f"plan.spec must be a BatchSpec and plan.cluster a Cluster, got {type(plan.spec).__name__} and "
               f"{type(plan.cluster).__name__}")
        return
    lay, tiles = plan.layout, plan.tiles
    if not (_vector(pb, "seq_tb_ptr", lay.seq_tb_ptr, "iu") & _vector(pb, "tb_len", lay.tb_len, "iu")):
        return
    n_tb = lay.tb_len.size
    if not (_vector(pb, "tb_seq", lay.tb_seq, "iu", n_tb) & _vector(pb, "tb_start", lay.tb_start, "iu", n_tb)):
        return
    _check_layout(plan, pb)
    if pb.items or not _vector(pb, "tiles.q_tb", tiles.q_tb, "iu"):
        return
    n_t = tiles.q_tb.size
    checks = [("tiles.kv_tb", tiles.kv_tb, "iu", n_t), ("tiles.hb", tiles.hb, "iu", n_t),
              ("tiles.unmasked", tiles.unmasked, "iu", n_t), ("tiles.full", tiles.full, "b", n_t),
              ("tiles.fwd_flops", tiles.fwd_flops, "f", n_t), ("tiles.bwd_flops", tiles.bwd_flops, "f", n_t),
              ("home", plan.home, "iu", n_tb), ("tile_device", plan.tile_device, "iu", n_t)]
    if not all([_vector(pb, *c) for c in checks]):
        return
    _check_tiles(plan, pb)
    n_dev = plan.n_devices
    if lay.n_token_blocks and (plan.home.min() < 0 or plan.home.max() >= n_dev):
        pb.add(f"token block {_first((plan.home < 0) | (plan.home >= n_dev))}'s home is not a device of the "
               f"{n_dev}-device cluster")
    if n_t and (plan.tile_device.min() < 0 or plan.tile_device.max() >= n_dev):
        pb.add(f"tile {_first((plan.tile_device < 0) | (plan.tile_device >= n_dev))} is assigned to a device "
               f"outside the {n_dev}-device cluster")
    for direction in ("forward", "backward"):
        check_columns(plan, direction, pb)


def _table(pb, name: str, a) -> bool:
    if not isinstance(a, np.ndarray) or a.ndim != 2 or a.shape[1] != len(COLUMNS) or a.dtype.kind not in "iu":
        got = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        pb.add(f"{name} must be an int [n, {len(COLUMNS)}] table of {COLUMNS}, got {got}")
        return False
    return True


def check_columns(plan: Plan, direction: str, pb) -> None:
    """One direction's program tables: types, shapes and every field in range (module docstring)."""
    prog = getattr(plan, direction)
    if not isinstance(prog, Program) or prog.direction != direction:
        got = f"a {prog.direction} Program" if isinstance(prog, Program) else type(prog).__name__
        pb.add(f"plan.{direction} must be the {direction} dcp.ir.program.Program, got {got}")
        return
    n_dev, n_tb, nhb = plan.n_devices, plan.layout.n_token_blocks, plan.layout.n_head_blocks
    if not (_vector(pb, f"{direction} tile_stage", prog.tile_stage, "iu", plan.tiles.n_tiles)
            & _table(pb, f"{direction} transfers", prog.transfers) & _table(pb, f"{direction} merges", prog.merges)):
        return
    st = prog.tile_stage
    if st.size and (st.min() < 0 or st.max() >= MAX_ROUND):
        pb.add(f"{direction}: tile {_first((st < 0) | (st >= MAX_ROUND))} has stage "
               f"{int(st[_first((st < 0) | (st >= MAX_ROUND))])}, outside 0..{MAX_ROUND - 1}")
    kinds = [int(k) for k in (*INPUT_KINDS[direction], *OUTPUT_KINDS[direction])]
    for what, rows, allowed in (("transfer", prog.transfers, kinds),
                                ("merge", prog.merges, [int(k) for k in OUTPUT_KINDS[direction]])):
        if not rows.shape[0]:
            continue
        r = rows.astype(np.int64, copy=False)
        bad = (~np.isin(r[:, KIND], allowed) | (r[:, TB] < 0) | (r[:, TB] >= n_tb) | (r[:, HB] < 0)
               | (r[:, HB] >= nhb) | (r[:, SRC] < 0) | (r[:, SRC] >= n_dev) | (r[:, DST] < 0) | (r[:, DST] >= n_dev)
               | (r[:, SRC] == r[:, DST]) | (r[:, ROUND] < 1) | (r[:, ROUND] >= MAX_ROUND))
        if bad.any():
            kd, b, h, src, dst, rnd = (int(x) for x in r[_first(bad)])
            pb.add(f"{direction} {what} row {_first(bad)} (kind {kd}, token block {b}, head block {h}, device "
                   f"{src} -> {dst}, round {rnd}): a unit kind of another direction, a block, device or round "
                   f"out of range, or a device sending to itself")


def _check_layout(plan: Plan, pb) -> None:
    if plan.layout.grouped:
        _check_grouped_layout(plan.spec, plan.layout, pb)
    else:
        _check_plain_layout(plan.spec, plan.layout, pb)


def _check_grouped_layout(spec, lay, pb) -> None:
    """A grouped layout (``dcp.layout.pieces``): its pieces are an ordinary layout of the batch, every piece is in
    one block, and the block arrays are the ones ``group_layout`` derives from them."""
    from dcp.layout.blocks import BlockLayout
    from dcp.layout.pieces import group_layout

    if not isinstance(lay.pieces, BlockLayout) or lay.pieces.grouped:
        pb.add(f"the pieces of a grouped layout must be an ordinary BlockLayout, got {type(lay.pieces).__name__}")
        return
    _check_plain_layout(spec, lay.pieces, pb)
    if pb.items or not _vector(pb, "piece_block", lay.piece_block, "iu", lay.pieces.n_token_blocks):
        return
    try:
        want = group_layout(lay.pieces, lay.piece_block)
    except DcpError as err:
        pb.add(f"the grouping of pieces into token blocks is invalid: {err}")
        return
    for name in ("tb_seq", "tb_start", "tb_len", "seq_tb_ptr"):
        if not np.array_equal(getattr(lay, name), getattr(want, name)):
            pb.add(f"grouped layout: {name} does not follow from its pieces and piece_block")
            return
    got = (lay.head_block_size, lay.n_head_blocks, lay.kv_heads_per_block, lay.group_size)
    if got != (want.head_block_size, want.n_head_blocks, want.kv_heads_per_block, want.group_size):
        pb.add(f"grouped layout: head blocking {got} differs from its pieces'")


def _check_plain_layout(spec, lay, pb) -> None:
    n_seq, n_tb = spec.num_seqs, lay.n_token_blocks
    ptr = lay.seq_tb_ptr.astype(np.int64)
    if ptr.size != n_seq + 1 or ptr[0] != 0 or ptr[-1] != n_tb or (np.diff(ptr) <= 0).any():
        pb.add(f"seq_tb_ptr {ptr[:6].tolist()}.. must rise strictly from 0 to the {n_tb} token blocks over "
               f"the batch's {n_seq} sequences")
        return
    want_seq = np.repeat(np.arange(n_seq), np.diff(ptr))
    if not np.array_equal(lay.tb_seq, want_seq):
        b = _first(lay.tb_seq != want_seq)
        pb.add(f"token block {b} is marked as sequence {int(lay.tb_seq[b])}, seq_tb_ptr puts it in {int(want_seq[b])}")
    lens = lay.tb_len.astype(np.int64)
    if (lens <= 0).any():
        pb.add(f"token block {_first(lens <= 0)} has {int(lens[_first(lens <= 0)])} tokens")
        return
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    if not np.array_equal(lay.tb_start.astype(np.int64), starts):
        b = _first(lay.tb_start != starts)
        pb.add(f"token block {b} starts at row {int(lay.tb_start[b])}; blocks must tile the packed batch in "
               f"order, so it starts at {int(starts[b])}")
    cu = spec.cu_seqlens
    if int(lens.sum()) != spec.total_tokens or not np.array_equal(starts[ptr[:-1]], cu[:-1]):
        bad = np.flatnonzero(starts[ptr[:-1]] != cu[:-1])
        where = f"sequence {int(bad[0])}'s first block starts at row {int(starts[ptr[bad[0]]])}, the sequence at " \
                f"{int(cu[bad[0]])}" if bad.size else f"token blocks hold {int(lens.sum())} tokens"
        pb.add(f"the token blocks do not follow the batch's sequences ({where}; the batch has "
               f"{spec.total_tokens} tokens)")
    try:
        want = (*head_blocking(spec, lay.head_block_size), spec.group_size)
    except DcpError as err:
        pb.add(f"head blocking does not fit the batch: {err}")
        return
    got = (lay.head_block_size, lay.n_head_blocks, lay.kv_heads_per_block, lay.group_size)
    if got != want:
        pb.add(f"head blocking (query heads per block, blocks, kv heads per block, GQA group) is {got}; "
               f"{spec.num_heads} query / {spec.num_kv_heads} kv heads give {want}")


def _check_tiles(plan: Plan, pb) -> None:
    """The plan's tiles must be exactly ``enumerate_tiles`` of its spec and layout, in that order."""
    tiles = plan.tiles
    try:
        want = enumerate_tiles(plan.spec, plan.layout)
    except DcpError as err:
        pb.add(f"the batch's tiles cannot be enumerated: {err}")
        return
    if tiles.n_tiles != want.n_tiles:
        pb.add(f"the plan has {tiles.n_tiles} tiles; the masks give {want.n_tiles} non-empty (q block, kv block, "
               f"head block) tiles under its layout")
        return
    key = np.zeros(tiles.n_tiles, dtype=bool)
    for name in ("q_tb", "kv_tb", "hb"):
        key |= getattr(tiles, name) != getattr(want, name)
    if key.any():
        t = _first(key)
        pb.add(f"tile {t} is (q block, kv block, head block) ({int(tiles.q_tb[t])}, {int(tiles.kv_tb[t])}, "
               f"{int(tiles.hb[t])}); the masks give ({int(want.q_tb[t])}, {int(want.kv_tb[t])}, {int(want.hb[t])})")
        return
    for name, what in (("unmasked", "unmasked (q, kv) pairs"), ("full", "full (no masking needed) flag")):
        bad = getattr(tiles, name) != getattr(want, name)
        if bad.any():
            t = _first(bad)
            pb.add(f"tile {t} has {what} {getattr(tiles, name)[t]!r}; the masks give {getattr(want, name)[t]!r}")
    for name in ("sub_n", "sub_wq", "sub_wk", "sub_wqk"):  # grouped tiles' per-sequence moments (None otherwise)
        got, exp = getattr(tiles, name), getattr(want, name)
        if (got is None) != (exp is None) or (exp is not None and (
                not isinstance(got, np.ndarray) or got.shape != exp.shape
                or not np.allclose(got, exp, rtol=1e-9, atol=0.0))):
            pb.add(f"tiles.{name} does not match the masks' grouped tiles" if exp is not None else
                   f"tiles.{name} is set, but the layout is not grouped")
    for name in ("fwd_flops", "bwd_flops"):
        got, exp = getattr(tiles, name), getattr(want, name)
        bad = ~np.isclose(got, exp, rtol=1e-12, atol=0.0)
        if bad.any():
            t = _first(bad)
            pb.add(f"tile {t} has {name} {float(got[t])!r}; its unmasked area gives {float(exp[t])!r}")
