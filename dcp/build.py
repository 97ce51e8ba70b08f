"""Emit per-device instruction streams from a placement, tile stages and routes.

Stream of every device, for rounds r = 1..R (R: the direction's last round, the same on all devices):
``CommLaunch(r)``, ``Compute(r−1)`` (if that stage exists), ``CommWait(r)``, then one ``Reduce`` per unit
whose partials arrived in round r. Stages beyond R compute after the last round. So round r's inputs
are ready for stage r, and a partial finished in stage s can leave in round s+2.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from dcp.plan import CommLaunch, CommWait, Compute, DevicePlan, Reduce, Transfer, Unit
from dcp.schedule import Routes
from dcp.units import Kind

IN_KIND = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
OUT_KIND = {"forward": (Kind.O, None), "backward": (Kind.DQ, Kind.DKV)}


def build_program(direction: str, n_devices: int, tile_device: np.ndarray, tile_stage: np.ndarray,
                  routes: Routes) -> tuple[DevicePlan, ...]:
    in_kind, out_kind = IN_KIND[direction], OUT_KIND[direction]
    sends = defaultdict(list)
    recvs = defaultdict(list)
    reduces = defaultdict(lambda: defaultdict(list))
    last_round = 0
    for side, tb, hb, src, dst, rnd in routes.inputs.tolist():
        unit = Unit(in_kind[side], tb, hb)
        sends[src, rnd].append(Transfer(unit, dst))
        recvs[dst, rnd].append(Transfer(unit, src))
        last_round = max(last_round, rnd)
    for side, tb, hb, src, dst, rnd in routes.outputs.tolist():
        if out_kind[side] is None:
            continue
        unit = Unit(out_kind[side], tb, hb)
        sends[src, rnd].append(Transfer(unit, dst))
        recvs[dst, rnd].append(Transfer(unit, src))
        reduces[dst, rnd][unit].append(src)
        last_round = max(last_round, rnd)
    order = np.lexsort((np.arange(tile_device.size), tile_stage, tile_device))
    dev_sorted, stage_sorted = tile_device[order], tile_stage[order]
    cuts = np.flatnonzero(np.r_[True, (dev_sorted[1:] != dev_sorted[:-1]) | (stage_sorted[1:] != stage_sorted[:-1])])
    compute = {}
    for a, b in zip(cuts, np.r_[cuts[1:], order.size]):
        compute[int(dev_sorted[a]), int(stage_sorted[a])] = tuple(int(t) for t in order[a:b])
    n_stages = int(tile_stage.max()) + 1 if tile_stage.size else 0
    programs = []
    for d in range(n_devices):
        ins = []
        for r in range(1, max(last_round, n_stages) + 1):
            if r <= last_round:
                ins.append(CommLaunch(r, tuple(sorted(sends.get((d, r), ()))), tuple(sorted(recvs.get((d, r), ())))))
            if (d, r - 1) in compute:
                ins.append(Compute(r - 1, compute[d, r - 1]))
            if r <= last_round:
                ins.append(CommWait(r))
                for unit, srcs in sorted(reduces.get((d, r), {}).items()):
                    ins.append(Reduce(unit, tuple(sorted(srcs))))
        programs.append(DevicePlan(d, tuple(ins)))
    return tuple(programs)
