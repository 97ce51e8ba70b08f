"""A grouped plan (``dcp.layout.pieces``) as the equivalent plan over its pieces, which executors run.

Every grouped unit (kind, block, head block) stands for one unit per piece of the block, all moved and
merged together, so the expansion is a row expansion: each tile of a grouped tile's pieces keeps its
device and stages, each transfer and merge row of a block becomes one row per piece. One thing differs:
a grouped partial holds something as soon as any of its pieces does, so a device on a relay chain may
forward a block's partial while one of its pieces has received or computed nothing. Those piece rows are
dropped (the validator refuses empty partials): walking rounds in order, a piece's partial is sent only
if its sender computed a tile of it or merged a partial of it that was kept.

The expanded plan computes exactly what the grouped plan describes; at the scales grouped plans are made
for (hundreds of devices) it is large, so it is built only when a plan is executed (``plan_tables``).
"""
from __future__ import annotations

import numpy as np

from dcp import setops
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.ir.program import DST, HB, KIND, MERGE_ORDER, ROUND, SRC, TB, TRANSFER_ORDER, Program, sort_rows
from dcp.layout.tiles import enumerate_tiles
from dcp.layout.units import OUTPUT_KINDS, Kind


def expand_pieces(plan: Plan) -> Plan:
    """The plan over ``plan.layout.pieces`` equivalent to the grouped ``plan`` (module docstring)."""
    lay = plan.layout
    if not lay.grouped:
        raise InvalidConfigError("expand_pieces needs a plan with a grouped layout (dcp.pieces)")
    pieces, pb = lay.pieces, lay.piece_block.astype(np.int64)
    nhb, n_blk = lay.n_head_blocks, lay.n_token_blocks
    fine = enumerate_tiles(plan.spec, pieces)
    g = _grouped_tile(plan, fine, pb, nhb, n_blk)
    order = np.argsort(pb, kind="stable")  # pieces of block b: order[ptr[b]:ptr[b + 1]]
    ptr = np.searchsorted(pb[order], np.arange(n_blk + 1))
    programs = []
    for direction in ("forward", "backward"):
        prog = plan.columns(direction)
        tr = _per_piece(prog.transfers, order, ptr)
        mg = _per_piece(prog.merges, order, ptr)
        tr, mg = _drop_empty_partials(tr, mg, fine, plan.tile_device[g].astype(np.int64), direction, nhb,
                                      pieces.n_token_blocks)
        programs.append(Program(direction, prog.tile_stage[g].astype(np.int32), sort_rows(tr, TRANSFER_ORDER),
                                sort_rows(mg, MERGE_ORDER)))
    return Plan(plan.spec, plan.cluster, pieces, fine, plan.home[pb].astype(np.int32),
                plan.tile_device[g].astype(np.int32), *programs, plan.planner, plan.planning_time_s,
                plan.notes, dict(plan.meta))


def _grouped_tile(plan: Plan, fine, pb, nhb: int, n_blk: int) -> np.ndarray:
    """int64 ``[fine tiles]``: the grouped tile each piece tile belongs to."""
    t = plan.tiles
    key = lambda q, h, k: (q.astype(np.int64) * nhb + h) * n_blk + k  # noqa: E731
    want = key(pb[fine.q_tb], fine.hb.astype(np.int64), pb[fine.kv_tb])
    have = key(t.q_tb, t.hb.astype(np.int64), t.kv_tb.astype(np.int64))
    at = np.minimum(np.searchsorted(have, want), max(have.size - 1, 0))
    if have.size == 0 or (have[at] != want).any():
        raise InvalidConfigError("a piece tile has no grouped tile: the plan's tiles do not match its layout")
    return at


def _per_piece(rows: np.ndarray, order: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Each row ``[kind, block, hb, src, dst, round]`` repeated once per piece of its block."""
    rows = rows.astype(np.int64)
    counts = ptr[rows[:, TB] + 1] - ptr[rows[:, TB]]
    out = np.repeat(rows, counts, axis=0)
    within = np.arange(out.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    out[:, TB] = order[np.repeat(ptr[rows[:, TB]], counts) + within]
    return out


def _drop_empty_partials(tr, mg, fine, tile_device, direction: str, nhb: int, n_pieces: int):
    """Transfer and merge rows without the partial rows whose sender holds nothing of that piece."""
    n_units = n_pieces * nhb
    node = lambda dev, kind, tb, hb: (dev * len(Kind) + kind) * n_units + tb * nhb + hb  # noqa: E731
    hb = fine.hb.astype(np.int64)
    held = []
    for kind in OUTPUT_KINDS[direction]:
        side = fine.kv_tb if kind == Kind.DKV else fine.q_tb
        held.append(node(tile_device, int(kind), side.astype(np.int64), hb))
    held = set(setops.unique(np.concatenate(held)).tolist())
    partial = np.isin(tr[:, KIND], [int(k) for k in OUTPUT_KINDS[direction]])
    keep = ~partial
    idx = np.flatnonzero(partial)
    idx = idx[np.argsort(tr[idx, ROUND], kind="stable")]
    rounds = tr[idx, ROUND]
    cuts = np.flatnonzero(np.r_[True, rounds[1:] != rounds[:-1], True]) if idx.size else np.zeros(1, np.int64)
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        r = tr[idx[a:b]]
        src = node(r[:, SRC], r[:, KIND], r[:, TB], r[:, HB]).tolist()
        ok = np.fromiter((s in held for s in src), dtype=bool, count=len(src))
        keep[idx[a:b][ok]] = True
        held.update(node(r[ok, DST], r[ok, KIND], r[ok, TB], r[ok, HB]).tolist())
    kept, sent = tr[keep], tr[keep & partial]
    if not mg.shape[0]:
        return kept, mg
    _, inv = np.unique(np.concatenate([sent, mg]), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    return kept, mg[setops.isin(inv[sent.shape[0]:], inv[:sent.shape[0]])]
