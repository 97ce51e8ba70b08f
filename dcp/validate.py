"""The plan validator: proves a plan's invariants by simulating every device's program in lockstep.

Checked, per direction (forward, backward):
- placement arrays are well formed, and the tiles cover exactly the mask's area (per sequence);
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

import numpy as np

from dcp.errors import PlanValidationError
from dcp.plan import CommLaunch, CommWait, Compute, Plan, Reduce, Unit
from dcp.units import Kind

_IN = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
_OUT = {"forward": ((Kind.O, 0),), "backward": ((Kind.DQ, 0), (Kind.DKV, 1))}  # (kind, 0: q side / 1: kv side)


class _Problems:
    def __init__(self, limit=20):
        self.items, self.limit = [], limit

    def add(self, msg):
        if len(self.items) < self.limit:
            self.items.append(msg)

    def raise_if_any(self):
        if self.items:
            raise PlanValidationError("plan is invalid:\n  " + "\n  ".join(self.items))


def validate(plan: Plan, check_area: bool = True) -> None:
    """Raise ``PlanValidationError`` listing the first problems found; return None for a valid plan."""
    pb = _Problems()
    _check_arrays(plan, pb, check_area)
    pb.raise_if_any()
    for direction in ("forward", "backward"):
        _check_program(plan, direction, pb)
        pb.raise_if_any()


def _check_arrays(plan: Plan, pb: _Problems, check_area: bool) -> None:
    n_dev, lay, tiles = plan.n_devices, plan.layout, plan.tiles
    if plan.home.shape != (lay.n_token_blocks,):
        pb.add(f"home has shape {plan.home.shape}, expected ({lay.n_token_blocks},)")
    elif lay.n_token_blocks and (plan.home.min() < 0 or plan.home.max() >= n_dev):
        pb.add("a token block's home is not a device of the cluster")
    for name in ("tile_device", "tile_stage"):
        arr = getattr(plan, name)
        if arr.shape != (tiles.n_tiles,):
            pb.add(f"{name} has shape {arr.shape}, expected ({tiles.n_tiles},)")
    if tiles.n_tiles and (plan.tile_device.min() < 0 or plan.tile_device.max() >= n_dev):
        pb.add("a tile is assigned to a device outside the cluster")
    if int(lay.tb_len.sum()) != plan.spec.total_tokens:
        pb.add(f"token blocks hold {int(lay.tb_len.sum())} tokens, the batch has {plan.spec.total_tokens}")
    for name, prog in (("forward", plan.forward), ("backward", plan.backward)):
        if len(prog) != n_dev or any(p.device != d for d, p in enumerate(prog)):
            pb.add(f"{name} program must list devices 0..{n_dev - 1} in order")
    if check_area and not pb.items:
        area = np.bincount(lay.tb_seq[tiles.q_tb], weights=tiles.unmasked, minlength=plan.spec.num_seqs)
        for s in range(plan.spec.num_seqs):
            r = plan.spec.kv_ranges(s)
            want = int((r[:, :, 1] - r[:, :, 0]).sum()) * lay.n_head_blocks
            if int(area[s]) != want:
                pb.add(f"sequence {s}: tiles cover {int(area[s])} (q, kv, head block) pairs, mask has {want}")


def _check_program(plan: Plan, direction: str, pb: _Problems) -> None:
    tiles, home, n_dev = plan.tiles, plan.home, plan.n_devices
    nhb = plan.layout.n_head_blocks
    in_q, in_kv = _IN[direction]
    prog = plan.program(direction)
    q_tb, kv_tb, hb = tiles.q_tb.tolist(), tiles.kv_tb.tolist(), tiles.hb.tolist()
    tile_device = plan.tile_device.tolist()
    # expected contributions per output unit
    expected = defaultdict(int)
    for kind, side in _OUT[direction]:
        blocks = tiles.q_tb if side == 0 else tiles.kv_tb
        keys, counts = np.unique(blocks.astype(np.int64) * nhb + tiles.hb, return_counts=True)
        for key, c in zip(keys.tolist(), counts.tolist()):
            expected[Unit(kind, key // nhb, key % nhb)] = c
    # per-device state
    have = [set() for _ in range(n_dev)]
    for tb, d in enumerate(home.tolist()):
        for h in range(nhb):
            have[d].add(Unit(in_q, tb, h))
            have[d].add(Unit(in_kv, tb, h))
    acc = [defaultdict(set) for _ in range(n_dev)]     # output unit -> tile ids merged here
    sent = [set() for _ in range(n_dev)]               # output units already sent away
    inbox = [dict() for _ in range(n_dev)]             # (unit, src) -> tile ids, after their wait
    ran = np.zeros(tiles.n_tiles, dtype=np.int64)
    # split programs at launches and check round structure
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
    if pb.items:
        return
    flight = defaultdict(list)  # (round, dst) -> [(unit, src, payload)]
    graph_edges = []

    def run(d, ins, idx):
        if isinstance(ins, CommLaunch):
            for unit, peer in ins.sends:
                if unit.kind in (in_q, in_kv):
                    if unit not in have[d]:
                        pb.add(f"{direction} device {d} round {ins.round}: sends {unit} it does not hold")
                    payload = None
                else:
                    if unit in sent[d]:
                        pb.add(f"{direction} device {d}: sends partial {unit} twice")
                    sent[d].add(unit)
                    payload = acc[d].pop(unit, set())
                    if not payload:
                        pb.add(f"{direction} device {d} round {ins.round}: sends an empty partial {unit}")
                flight[ins.round, peer].append((unit, d, payload))
                graph_edges.append(((d, idx), (peer, ins.round)))
        elif isinstance(ins, CommWait):
            for unit, src, payload in flight.pop((ins.round, d), ()):
                if payload is None:
                    have[d].add(unit)
                else:
                    inbox[d][unit, src] = payload
        elif isinstance(ins, Compute):
            for t in ins.tiles:
                if tile_device[t] != d:
                    pb.add(f"{direction} device {d}: runs tile {t} assigned to device {tile_device[t]}")
                ran[t] += 1
                q_in, kv_in = Unit(in_q, q_tb[t], hb[t]), Unit(in_kv, kv_tb[t], hb[t])
                for u in (q_in, kv_in):
                    if u not in have[d]:
                        pb.add(f"{direction} device {d} stage {ins.stage}: tile {t} needs {u}, not yet there")
                for kind, side in _OUT[direction]:
                    out = Unit(kind, q_tb[t] if side == 0 else kv_tb[t], hb[t])
                    if out in sent[d]:
                        pb.add(f"{direction} device {d}: tile {t} adds to {out} after it was sent")
                    acc[d][out].add(t)
        elif isinstance(ins, Reduce):
            if ins.unit in sent[d]:
                pb.add(f"{direction} device {d}: reduces into {ins.unit} after sending it")
            for src in ins.sources:
                payload = inbox[d].pop((ins.unit, src), None)
                if payload is None:
                    pb.add(f"{direction} device {d}: reduces {ins.unit} from {src}, which it never received")
                    continue
                mine = acc[d][ins.unit]
                if mine & payload:
                    pb.add(f"{direction} device {d}: {ins.unit} merges tiles {sorted(mine & payload)[:4]} twice")
                mine |= payload

    for r in range(0, rounds + 1):
        # every device posts round r before any waits on it, as grouped p2p does
        bases = [sum(len(s) for s in segments[d][:r]) for d in range(n_dev)]
        if r > 0:
            for d in range(n_dev):
                run(d, segments[d][r][0], bases[d])
            for d in range(n_dev):
                got = sorted((u, s) for u, s, _ in flight.get((r, d), ()))
                want = sorted((t.unit, t.peer) for t in segments[d][r][0].recvs)
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
        for (unit, src) in inbox[d]:
            pb.add(f"{direction} device {d}: partial {unit} from {src} is never merged")
        for unit, ts in acc[d].items():
            if not ts:
                continue
            if unit.tb >= home.size or home[unit.tb] != d:
                pb.add(f"{direction} device {d}: partial {unit} is never sent home")
            elif len(ts) != expected[unit]:
                pb.add(f"{direction}: home {d} of {unit} merged {len(ts)} of its {expected[unit]} tiles")
    for unit, want in expected.items():
        if not acc[int(home[unit.tb])].get(unit):
            pb.add(f"{direction}: output {unit} never reaches its home")
    _check_acyclic(plan, direction, graph_edges, pb)


def _check_acyclic(plan: Plan, direction: str, send_edges, pb: _Problems) -> None:
    import networkx as nx

    g = nx.DiGraph()
    waits = {}
    for p in plan.program(direction):
        n = len(p.instructions)
        g.add_edges_from(((p.device, i), (p.device, i + 1)) for i in range(n - 1))
        g.add_node((p.device, 0))
        waits[p.device] = {ins.round: i for i, ins in enumerate(p.instructions) if isinstance(ins, CommWait)}
    for (src, i), (dst, rnd) in send_edges:
        if rnd in waits.get(dst, {}):
            g.add_edge((src, i), (dst, waits[dst][rnd]))
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        pb.add(f"{direction}: dependency cycle (deadlock) through {cycle[:4]}")
