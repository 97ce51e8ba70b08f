"""The static half of the validator: a plan's arrays and instruction fields, checked against its batch.

What it proves (``check_arrays``, then ``check_instructions`` per direction), before the lockstep
simulation in ``dcp.validate`` runs:
- every array has the right type, dtype kind and length;
- the block layout covers the batch: token blocks tile the packed rows contiguously in order, each
  inside one sequence (``tb_seq`` / ``tb_start`` / ``tb_len`` / ``seq_tb_ptr`` agree with the spec's
  lengths), and the head blocking is the one ``num_heads`` / ``num_kv_heads`` give;
- the tiles are exactly the batch's: ``dcp.blocks.enumerate_tiles`` on the plan's layout recomputes,
  from the spec's masks, which (q block, kv block, head block) triples hold unmasked pairs, how many
  (``unmasked``), which are fully unmasked (``full``, which lets kernels skip masking) and their FLOPs;
  the plan's tile arrays must equal them. So a plan cannot compute a pair the masks exclude, skip one
  they include, or mask a tile it calls full;
- every index (homes, tile devices, units, peers, tile ids, merge sources) is in range, every unit kind
  belongs to its direction, and the forward program runs each tile in the stage ``tile_stage`` names.
"""
from __future__ import annotations

import numpy as np

from dcp.blocks import enumerate_tiles, head_blocking
from dcp.cluster import Cluster
from dcp.errors import DcpError
from dcp.plan import CommLaunch, CommWait, Compute, Plan, Reduce
from dcp.spec import BatchSpec
from dcp.units import INPUT_KINDS, OUTPUT_KINDS

_KIND_NAMES = {"i": "int", "u": "uint", "b": "bool", "f": "float"}


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


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
              ("home", plan.home, "iu", n_tb), ("tile_device", plan.tile_device, "iu", n_t),
              ("tile_stage", plan.tile_stage, "iu", n_t)]
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
    if n_t and plan.tile_stage.min() < 0:
        pb.add(f"tile {_first(plan.tile_stage < 0)} has a negative stage")
    for name, prog in (("forward", plan.forward), ("backward", plan.backward)):
        if len(prog) != n_dev or any(getattr(p, "device", None) != d for d, p in enumerate(prog)):
            pb.add(f"{name} program must list devices 0..{n_dev - 1} in order")


def _check_layout(plan: Plan, pb) -> None:
    spec, lay = plan.spec, plan.layout
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
    for name in ("fwd_flops", "bwd_flops"):
        got, exp = getattr(tiles, name), getattr(want, name)
        bad = ~np.isclose(got, exp, rtol=1e-12, atol=0.0)
        if bad.any():
            t = _first(bad)
            pb.add(f"tile {t} has {name} {float(got[t])!r}; its unmasked area gives {float(exp[t])!r}")


def _int_rows(rows: list, width: int, flat: bool = False) -> np.ndarray | None:
    """``rows`` (tuples of ``width`` fields, or all fields in one flat list) as an int64 ``[n, width]``
    array, or None if a field is not an integer."""
    if not rows:
        return np.zeros((0, width), dtype=np.int64)
    try:
        arr = np.asarray(rows)
    except (TypeError, ValueError):
        return None
    if arr.dtype.kind not in "iu" or arr.shape != ((len(rows),) if flat else (len(rows), width)):
        return None
    return arr.astype(np.int64, copy=False).reshape(-1, width)


def check_instructions(plan: Plan, direction: str, pb) -> None:
    """Every instruction's fields in range and of the right kind (so the simulation can index with them);
    the forward program runs each tile in its ``tile_stage``. Fields are gathered per kind of field and
    checked with numpy (a plan has thousands of transfers)."""
    n_dev, n_tb, nhb, n_t = plan.n_devices, plan.layout.n_token_blocks, plan.layout.n_head_blocks, plan.tiles.n_tiles
    # units: flat (device, kind, tb, hb, peer, role) ints; no tuple per transfer (10^5 of them kept alive
    # would set off the cyclic garbage collector over the whole plan again and again)
    units, rounds, stages, tiles, tile_stage = [], [], [], [], []
    outputs = {int(k) for k in OUTPUT_KINDS[direction]}
    for d, p in enumerate(plan.program(direction)):
        where = f"{direction} device {d}"
        for i, ins in enumerate(p.instructions):
            try:
                if isinstance(ins, CommLaunch):
                    rounds.append((ins.round, 1))
                    for role, transfers in ((0, ins.sends), (1, ins.recvs)):
                        for u, peer in transfers:
                            units += (d, u[0], u[1], u[2], peer, role)
                elif isinstance(ins, CommWait):
                    rounds.append((ins.round, 1))
                elif isinstance(ins, Compute):
                    stages.append((ins.stage, 0))
                    t = np.asarray(ins.tiles)
                    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
                        pb.add(f"{where} instruction {i}: compute tiles {list(ins.tiles)[:6]} are not tile ids")
                        continue
                    tiles.append(t.astype(np.int64))
                    tile_stage.append(np.full(t.size, ins.stage if _is_int(ins.stage) else -1, dtype=np.int64))
                elif isinstance(ins, Reduce):
                    kind, tb, hb = ins.unit
                    if int(kind) not in outputs if _is_int(kind) else True:
                        pb.add(f"{where} instruction {i}: reduces {tuple(ins.unit)}, not an output of the {direction}")
                    for src in ins.sources:
                        units += (d, kind, tb, hb, src, 2)
                else:
                    pb.add(f"{where} instruction {i}: {type(ins).__name__} is not an instruction")
            except (TypeError, ValueError, AttributeError) as err:
                pb.add(f"{where} instruction {i} is malformed ({type(err).__name__}: {err})")
    for name, rows in (("round", rounds), ("stage", stages)):
        arr = _int_rows(rows, 2)
        if arr is None or (arr[:, 0] < arr[:, 1]).any():
            pb.add(f"{direction}: a {name} number is not an int >= {1 if name == 'round' else 0}")
    arr = _int_rows(units, 6, flat=True)
    if arr is None:
        pb.add(f"{direction}: a transfer or merge names a non-integer unit or device")
    elif arr.size:
        d, kind, tb, hb, peer, role = arr.T
        ok_kind = np.isin(kind, [int(k) for k in (*INPUT_KINDS[direction], *OUTPUT_KINDS[direction])])
        bad = ~ok_kind | (tb < 0) | (tb >= n_tb) | (hb < 0) | (hb >= nhb) | (peer < 0) | (peer >= n_dev) | (peer == d)
        if bad.any():
            dev, kd, b, h, other, what = (int(x) for x in arr[_first(bad)])
            pb.add(f"{direction} device {dev}: {('send', 'receive', 'reduce')[what]} of unit (kind "
                   f"{kd}, token block {b}, head block {h}) {'from' if what else 'to'} device {other}: a unit kind, "
                   f"token block, head block or device out of range")
    if tiles:
        t, st = np.concatenate(tiles), np.concatenate(tile_stage)
        if t.size and (t.min() < 0 or t.max() >= n_t):
            pb.add(f"{direction}: a compute names tile {int(t[(t < 0) | (t >= n_t)][0])}, outside 0..{n_t - 1}")
        elif direction == "forward" and t.size:
            bad = st != plan.tile_stage[t]
            if bad.any():
                k = _first(bad)
                pb.add(f"forward: tile {int(t[k])} runs in stage {int(st[k])}, tile_stage says "
                       f"{int(plan.tile_stage[t[k]])}")
