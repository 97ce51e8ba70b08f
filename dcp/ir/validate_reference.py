"""The reference validator: ``dcp.validate``'s guarantees, checked the slow and obvious way, as a test oracle.

It reads the instruction view of a plan (``Plan.program``: one object per instruction and transfer) and
simulates every device's stream in lockstep, one instruction at a time, with sets and dicts; the
vectorized validator (``dcp.validate``) must accept exactly the plans this one accepts (the tests compare
them on valid and broken plans). Not for large plans: it is linear in the plan but with a large constant.

First the static checks (``dcp.ir.validate_arrays``, shared with the fast validator): the layout covers the
batch, the tiles are exactly those the masks give, every field of the program tables is in range. Then
every instruction's fields, and the lockstep simulation, per direction (forward, backward):
- every tile runs exactly once, on its assigned device, after all its inputs are present there;
- every device launches and waits the same rounds, in order, each launch before its wait;
- every send has a matching receive of the same unit between the same devices in the same round,
  and a device only sends an input it holds (home or received in an earlier round);
- every partial output is sent at most once, never changed after being sent, and merged exactly once:
  at the end each home holds, for each of its output units, the contributions of exactly that unit's
  tiles, each once, and no partial is left unmerged anywhere;
- the dependency graph (program order plus send → wait edges) is acyclic: no device deadlocks.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from dcp.ir.instructions import CommLaunch, CommWait, Compute, Reduce
from dcp.ir.validate_arrays import Problems, _first, check_arrays
from dcp.layout.units import INPUT_KINDS, OUTPUT_KINDS, Kind

if TYPE_CHECKING:
    from dcp.ir.plan import Plan

_IN = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
_OUT = {"forward": ((Kind.O, 0),), "backward": ((Kind.DQ, 0), (Kind.DKV, 1))}  # (kind, 0: q side / 1: kv side)


def validate_reference(plan: Plan) -> None:
    """Raise ``PlanValidationError`` listing the first problems found; return None for a valid plan."""
    pb = Problems()
    check_arrays(plan, pb)
    pb.raise_if_any()
    for direction in ("forward", "backward"):
        check_instructions(plan, direction, pb)
        pb.raise_if_any()
        _check_program(plan, direction, pb)
        pb.raise_if_any()


_MASK64 = (1 << 64) - 1


def _tile_hashes(n: int) -> np.ndarray:
    """A fixed random 64-bit tag per tile: a partial's (count, tag sum mod 2^64) identifies its set of
    contributions, so "each tile merged exactly once" is checked without carrying sets of tile ids."""
    return np.random.default_rng(0x5EED).integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64)


def _check_program(plan: Plan, direction: str, pb: Problems) -> None:
    tiles, home, n_dev = plan.tiles, plan.home, plan.n_devices
    nhb = plan.layout.n_head_blocks
    n_units = plan.layout.n_token_blocks * nhb
    in_q, in_kv = _IN[direction]
    prog = plan.program(direction)
    q_unit = tiles.q_tb.astype(np.int64) * nhb + tiles.hb
    kv_unit = tiles.kv_tb.astype(np.int64) * nhb + tiles.hb
    side_unit = (q_unit, kv_unit)
    tags = _tile_hashes(tiles.n_tiles)
    # expected (count, tag sum) per output unit
    expected = {}
    for kind, side in _OUT[direction]:
        uniq, inv = np.unique(side_unit[side], return_inverse=True)
        cnt = np.bincount(inv, minlength=uniq.size)
        tag = np.zeros(uniq.size, dtype=np.uint64)
        np.add.at(tag, inv, tags)
        for u, c, h in zip(uniq.tolist(), cnt.tolist(), tag.tolist()):
            expected[kind, u] = (c, h)
    # inputs present per device: home units, then received ones
    have = {in_q: np.zeros((n_dev, n_units), dtype=bool), in_kv: np.zeros((n_dev, n_units), dtype=bool)}
    home_unit_dev = np.repeat(home.astype(np.int64), nhb)
    for arr in have.values():
        arr[home_unit_dev, np.arange(n_units)] = True
    acc = [dict() for _ in range(n_dev)]     # (kind, unit) -> (count, tag sum) merged here
    sent = [set() for _ in range(n_dev)]     # output (kind, unit) already sent away
    inbox = [dict() for _ in range(n_dev)]   # (kind, unit, src) -> (count, tag sum), after its wait
    ran = np.zeros(tiles.n_tiles, dtype=np.int64)
    segments, rounds = _segments(prog, direction, pb)
    if pb.items:
        return
    flight = defaultdict(list)  # (round, dst) -> [(kind, unit, src, payload)]
    send_edges = set()

    def uid(unit):
        return unit.tb * nhb + unit.hb

    def run(d, ins, idx):
        if isinstance(ins, CommLaunch):
            for unit, peer in ins.sends:
                if unit.kind in have:
                    if not have[unit.kind][d, uid(unit)]:
                        pb.add(f"{direction} device {d} round {ins.round}: sends {unit} it does not hold")
                    payload = None
                else:
                    key = (unit.kind, uid(unit))
                    if key in sent[d]:
                        pb.add(f"{direction} device {d}: sends partial {unit} twice")
                    sent[d].add(key)
                    payload = acc[d].pop(key, None)
                    if payload is None:
                        pb.add(f"{direction} device {d} round {ins.round}: sends an empty partial {unit}")
                        payload = (0, 0)
                flight[ins.round, peer].append((unit.kind, uid(unit), d, payload))
                send_edges.add(((d, idx), (peer, ins.round)))
        elif isinstance(ins, CommWait):
            for kind, u, src, payload in flight.pop((ins.round, d), ()):
                if payload is None:
                    have[kind][d, u] = True
                else:
                    inbox[d][kind, u, src] = payload
        elif isinstance(ins, Compute):
            t = np.asarray(ins.tiles, dtype=np.int64)
            if t.size == 0:
                return
            wrong = plan.tile_device[t] != d
            if wrong.any():
                pb.add(f"{direction} device {d}: runs tile {int(t[wrong][0])} assigned to device "
                       f"{int(plan.tile_device[t[wrong][0]])}")
            np.add.at(ran, t, 1)
            for kind, units in ((in_q, q_unit[t]), (in_kv, kv_unit[t])):
                missing = ~have[kind][d, units]
                if missing.any():
                    pb.add(f"{direction} device {d} stage {ins.stage}: tile {int(t[missing][0])} needs "
                           f"{kind.name} unit {int(units[missing][0])}, not yet there")
            for kind, side in _OUT[direction]:
                uniq, inv = np.unique(side_unit[side][t], return_inverse=True)
                cnt = np.bincount(inv, minlength=uniq.size)
                tag = np.zeros(uniq.size, dtype=np.uint64)
                np.add.at(tag, inv, tags[t])
                for u, c, h in zip(uniq.tolist(), cnt.tolist(), tag.tolist()):
                    key = (kind, u)
                    if key in sent[d]:
                        pb.add(f"{direction} device {d}: a tile adds to {kind.name} unit {u} after it was sent")
                    c0, h0 = acc[d].get(key, (0, 0))
                    acc[d][key] = (c0 + c, (h0 + h) & _MASK64)
        elif isinstance(ins, Reduce):
            key = (ins.unit.kind, uid(ins.unit))
            if key in sent[d]:
                pb.add(f"{direction} device {d}: reduces into {ins.unit} after sending it")
            for src in ins.sources:
                payload = inbox[d].pop((*key, src), None)
                if payload is None:
                    pb.add(f"{direction} device {d}: reduces {ins.unit} from {src}, which it never received")
                    continue
                c0, h0 = acc[d].get(key, (0, 0))
                acc[d][key] = (c0 + payload[0], (h0 + payload[1]) & _MASK64)

    for r in range(0, rounds + 1):
        # every device posts round r before any waits on it, as grouped p2p does
        bases = [sum(len(s) for s in segments[d][:r]) for d in range(n_dev)]
        if r > 0:
            for d in range(n_dev):
                run(d, segments[d][r][0], bases[d])
            for d in range(n_dev):
                got = sorted((k, u, s) for k, u, s, _ in flight.get((r, d), ()))
                want = sorted((t.unit.kind, uid(t.unit), t.peer) for t in segments[d][r][0].recvs)
                if got != want:
                    pb.add(f"{direction} device {d} round {r}: posts {len(want)} receives but "
                           f"{len(got)} units are sent to it (or they differ)")
        for d in range(n_dev):
            for i, ins in enumerate(segments[d][r][1 if r > 0 else 0:], start=1 if r > 0 else 0):
                run(d, ins, bases[d] + i)
    if (ran != 1).any():
        t = int(np.flatnonzero(ran != 1)[0])
        pb.add(f"{direction}: tile {t} runs {int(ran[t])} times (must be exactly once)")
    for d in range(n_dev):
        for (kind, u, src) in inbox[d]:
            pb.add(f"{direction} device {d}: partial {kind.name} unit {u} from {src} is never merged")
        for (kind, u), got in acc[d].items():
            if home[u // nhb] != d:
                pb.add(f"{direction} device {d}: partial {kind.name} unit {u} is never sent home")
            elif got != expected.get((kind, u)):
                pb.add(f"{direction}: home {d} of {kind.name} unit {u} merged {got[0]} contributions, "
                       f"expected its {expected.get((kind, u), (0,))[0]} tiles each once")
    for (kind, u) in expected:
        if (kind, u) not in acc[int(home[u // nhb])]:
            pb.add(f"{direction}: output {kind.name} unit {u} never reaches its home")
    _check_acyclic(plan, direction, send_edges, pb)


def _segments(prog, direction, pb):
    """Split each program at its launches; check rounds are launched and waited 1..R in order."""
    segments, rounds = [], None
    for d, p in enumerate(prog):
        segs, cur, launched, waited = [], [], [], []
        for ins in p.instructions:
            if isinstance(ins, CommLaunch):
                segs.append(cur)
                cur = [ins]
                launched.append(ins.round)
            else:
                if isinstance(ins, CommWait):
                    waited.append(ins.round)
                    if not launched or launched[-1] != ins.round:
                        pb.add(f"{direction} device {d}: waits round {ins.round} without launching it just before")
                cur.append(ins)
        segs.append(cur)
        segments.append(segs)
        if launched != list(range(1, len(launched) + 1)) or waited != launched:
            pb.add(f"{direction} device {d}: rounds launched {launched[:8]}.. waited {waited[:8]}.. must be 1..R in order")
        if rounds is None:
            rounds = len(launched)
        elif rounds != len(launched):
            pb.add(f"{direction}: device {d} has {len(launched)} rounds, device 0 has {rounds}")
    return segments, rounds or 0


def _check_acyclic(plan: Plan, direction: str, send_edges, pb: Problems) -> None:
    """Only launches and waits create cross-device dependencies, so the graph keeps just those
    instructions, in program order, plus an edge from each sender's launch to the receiver's wait."""
    import networkx as nx

    g = nx.DiGraph()
    waits = {}
    for p in plan.program(direction):
        sync = [i for i, ins in enumerate(p.instructions) if isinstance(ins, (CommLaunch, CommWait))]
        g.add_nodes_from((p.device, i) for i in sync)
        g.add_edges_from(((p.device, a), (p.device, b)) for a, b in zip(sync, sync[1:]))
        waits[p.device] = {ins.round: i for i, ins in enumerate(p.instructions) if isinstance(ins, CommWait)}
    for (src, i), (dst, rnd) in send_edges:
        if rnd in waits.get(dst, {}):
            g.add_edge((src, i), (dst, waits[dst][rnd]))
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        pb.add(f"{direction}: dependency cycle (deadlock) through {cycle[:4]}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


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
