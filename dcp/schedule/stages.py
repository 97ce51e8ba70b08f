"""Stages and routes: when each tile runs and how every remote unit travels, per direction.

Programs run in lockstep rounds (``dcp.schedule.build``): round r's transfers are posted before stage r−1
computes and waited for after it, so they hide behind that stage. A plan's forward and backward each get
their own schedule: the backward moves bigger q-side units and computes 3.3× longer per tile, so its
best rounds differ.

Inputs (``input_rounds``). Every (device, remote unit) pair a device's tiles need is a *demand*; its
value is the compute it unlocks (a tile missing two units credits each half). Rounds are filled
greedily in order of value per byte, each round with a *capacity* on every resource the simulator
models: a GPU's NVLink egress and ingress ports and a node's NIC egress and ingress, each allowed the
bytes it moves in one round's time ``tau``. A demand is served by a *holder* of its unit — the home, or
any device that received it in an earlier round — preferably one in the consumer's node (NVLink) with
the least egress used so far, so a unit that many devices need spreads as a relay tree instead of a star
from its home; across nodes a unit enters a node at most once per round (two-phase: the node's other
consumers get it relayed a round later). Ties in value are broken by ring distance (nearest source
first), which turns a zigzag placement into ring-like relays. ``tau`` is the larger of a stage's share
of the device compute and the busiest resource's share of the transfers: compute-bound plans get rounds
that hide behind stages, communication-bound ones get their bytes spread evenly over the rounds.

Stages (``tile_stages``). A tile is released in the stage its last input arrives (local tiles: stage
0). Each device fills stages in order up to its compute per round, taking first the tiles whose outputs
go to another device (so partials leave early); a device that sends partials keeps local work back for
its final stage, so their trip home hides behind that work.

Outputs (``output_routes``). A partial leaves two rounds after its last tile's stage; with
``two_phase``, partials of one unit from several GPUs of a remote node merge on one of them first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.cluster import Cluster
from dcp.cost import CostModel
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.layout.units import Kind, bytes_per_token
from dcp.schedule.rounds import input_rounds
from dcp.spec import BatchSpec

try:  # the C++ loop, when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE_STAGES = hasattr(_C, "tile_stages")
except ImportError:
    _C, _NATIVE_STAGES = None, False

ROUTE_COLUMNS = ("side", "tb", "hb", "src", "dst", "round")  # side 0: q side, 1: kv side
IN_KINDS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True, eq=False)
class Routes:
    """``inputs``/``outputs``: int64 ``[n, 6]`` rows of ROUTE_COLUMNS. An input row delivers a unit to
    ``dst`` in ``round``; an output row forwards ``src``'s (merged) partial to ``dst`` in ``round``."""

    inputs: np.ndarray
    outputs: np.ndarray


@dataclass(frozen=True, eq=False)
class Schedule:
    """One direction's schedule: ``tile_stage[t]`` (compute stage of every tile) and its routes."""

    direction: str
    tile_stage: np.ndarray
    routes: Routes


@dataclass(frozen=True, eq=False)
class Demands:
    """Remote inputs: one row per (device, unit), and each tile's q / kv demand row (-1: local input)."""

    dev: np.ndarray
    side: np.ndarray
    tb: np.ndarray
    hb: np.ndarray
    nbytes: np.ndarray
    value: np.ndarray
    tile_q: np.ndarray
    tile_kv: np.ndarray

    @property
    def n(self) -> int:
        return int(self.dev.size)


def find_demands(spec: BatchSpec, layout: BlockLayout, tiles: TileSet, home: np.ndarray,
                 tile_device: np.ndarray, tile_time: np.ndarray, direction: str) -> Demands:
    """Every device's remote input units, with their bytes in ``direction`` and the compute they unlock."""
    nhb = layout.n_head_blocks
    n_units = layout.n_token_blocks * nhb
    dev = np.asarray(tile_device, dtype=np.int64)
    q_rem = home[tiles.q_tb] != dev
    kv_rem = home[tiles.kv_tb] != dev
    share = np.asarray(tile_time, float) / np.maximum(q_rem.astype(np.int64) + kv_rem, 1)
    q_key = (dev * 2) * n_units + tiles.q_tb.astype(np.int64) * nhb + tiles.hb
    kv_key = (dev * 2 + 1) * n_units + tiles.kv_tb.astype(np.int64) * nhb + tiles.hb
    ukeys, inv = np.unique(np.concatenate([q_key[q_rem], kv_key[kv_rem]]), return_inverse=True)
    value = np.bincount(inv, weights=np.concatenate([share[q_rem], share[kv_rem]]), minlength=ukeys.size)
    unit = ukeys % n_units
    side = (ukeys // n_units) % 2
    tb = unit // nhb
    bpt = bytes_per_token(spec, layout)
    q_kind, kv_kind = IN_KINDS[direction]
    nbytes = np.where(side == 0, bpt[q_kind], bpt[kv_kind]) * layout.tb_len[tb].astype(np.int64)
    tile_q = np.full(tiles.n_tiles, -1, dtype=np.int64)
    tile_kv = np.full(tiles.n_tiles, -1, dtype=np.int64)
    n_q = int(q_rem.sum())
    tile_q[q_rem] = inv[:n_q]
    tile_kv[kv_rem] = inv[n_q:]
    return Demands(ukeys // (2 * n_units), side, tb, unit % nhb, nbytes, value, tile_q, tile_kv)


def _unit_key(dm: Demands, n_token_blocks: int, nhb: int) -> np.ndarray:
    return (dm.side * n_token_blocks + dm.tb) * nhb + dm.hb


def comm_floor(dm: Demands, unit_key: np.ndarray, home: np.ndarray, cluster: Cluster, cost: CostModel) -> float:
    """Seconds the busiest resource needs for all of a direction's inputs: ingress ports, and with
    several nodes the NICs (each unit entering a remote node once)."""
    if dm.n == 0:
        return 0.0
    p = cost.profile
    gpn, n_dev = cluster.gpus_per_node, cluster.n_devices
    busiest = float(np.bincount(dm.dev, weights=dm.nbytes, minlength=n_dev).max()) / (p.nvlink_gbps * 1e9)
    if cluster.nodes > 1:
        src_node = home[dm.tb].astype(np.int64) // gpn
        dst_node = dm.dev // gpn
        cross = np.flatnonzero(src_node != dst_node)
        if cross.size:
            _, first = np.unique(unit_key[cross] * cluster.nodes + dst_node[cross], return_index=True)
            idx = cross[first]
            nic = p.nic_gbps_per_node * 1e9
            for node_of in (dst_node, src_node):
                load = np.bincount(node_of[idx], weights=dm.nbytes[idx], minlength=cluster.nodes)
                busiest = max(busiest, float(load.max()) / nic)
    return busiest


def round_durations(dm: Demands, arrival: np.ndarray, source: np.ndarray, cluster: Cluster,
                    cost: CostModel) -> np.ndarray:
    """float ``[n_devices, last round + 2]``: about how long each device's input transfers of each round
    take (its busier port, and its node's busier NIC when it sends or receives across nodes)."""
    p = cost.profile
    n, gpn, nodes = cluster.n_devices, cluster.gpus_per_node, cluster.nodes
    width = int(arrival.max(initial=0)) + 2
    out = np.zeros((n, width))
    if dm.n == 0:
        return out
    b = dm.nbytes.astype(float)
    port = np.maximum(np.bincount(dm.dev * width + arrival, weights=b, minlength=n * width),
                      np.bincount(source * width + arrival, weights=b, minlength=n * width)) / (p.nvlink_gbps * 1e9)
    out += port.reshape(n, width)
    cross = source // gpn != dm.dev // gpn
    if cross.any():
        nic_in = np.bincount((dm.dev[cross] // gpn) * width + arrival[cross], weights=b[cross], minlength=nodes * width)
        nic_out = np.bincount((source[cross] // gpn) * width + arrival[cross], weights=b[cross], minlength=nodes * width)
        nic = (np.maximum(nic_in, nic_out) / (p.nic_gbps_per_node * 1e9)).reshape(nodes, width)
        uses = np.zeros(n * width, dtype=bool)
        uses[dm.dev[cross] * width + arrival[cross]] = True
        uses[source[cross] * width + arrival[cross]] = True
        out = np.maximum(out, np.where(uses.reshape(n, width), nic[np.arange(n) // gpn], 0.0))
    return out + np.where(out > 0, p.link_latency_us * 1e-6, 0.0)


def tile_stages(tile_device: np.ndarray, release: np.ndarray, out_unit: np.ndarray, tile_time: np.ndarray,
                staged: np.ndarray, n_stages: int, round_s: np.ndarray | None = None,
                native: bool | None = None) -> np.ndarray:
    """``tile_stages_reference``'s stages; ``native``: force (True) or forbid (False) its C++ loop
    (``dcp._C.tile_stages``, csrc/stages.cpp; None: use it when built)."""
    if not (_NATIVE_STAGES if native is None else native):
        return tile_stages_reference(tile_device, release, out_unit, tile_time, staged, n_stages, round_s)
    import torch

    i64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    f64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))  # noqa: E731
    return _C.tile_stages(i64(tile_device), i64(release), i64(out_unit), f64(tile_time),
                          torch.from_numpy(np.ascontiguousarray(staged, dtype=bool)), int(n_stages),
                          None if round_s is None else f64(round_s)).numpy()


def tile_stages_reference(tile_device: np.ndarray, release: np.ndarray, out_unit: np.ndarray, tile_time: np.ndarray,
                          staged: np.ndarray, n_stages: int, round_s: np.ndarray | None = None) -> np.ndarray:
    """Stage of every tile (module docstring). ``release[t]``: the round its last input arrives (0:
    local inputs, and then local outputs too); ``out_unit[t]``: a partial output of the tile that
    belongs to another device (-1: none) — tiles of one such unit are kept together, units whose tiles
    are all released first, so each partial is complete (and leaves) as early as possible;
    ``staged[d]``: device d takes part in transfers after round 1, so it computes in stages
    0..max(n_stages, last release) paced to its compute per round, each stage at least as long as the
    next round's transfers where it has the work (``round_s``, ``round_durations``); others compute
    everything as soon as it is released: at most two fused calls."""
    stage = np.array(release, dtype=np.int64)
    if stage.size == 0:
        return stage
    order = np.lexsort((np.arange(tile_device.size), tile_device))
    cuts = np.flatnonzero(np.r_[True, tile_device[order][1:] != tile_device[order][:-1], True])
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        t = order[a:b]
        if not staged[tile_device[t[0]]]:
            continue
        rel, unit, tt = release[t], out_unit[t], tile_time[t]
        out = unit >= 0
        last = max(int(rel.max()), n_stages)
        # when a unit's partial could be complete: the latest release among its tiles here
        ready = np.zeros(t.size, dtype=np.int64)
        if out.any():
            uu, inv = np.unique(unit[out], return_inverse=True)
            unit_ready = np.zeros(uu.size, dtype=np.int64)
            np.maximum.at(unit_ready, inv, rel[out])
            ready[out] = unit_ready[inv]
        target = np.full(last + 1, float(np.cumsum(tt)[-1]) / (last + 1))  # summed in tile order, as in C++
        if round_s is not None:  # a stage as long as the round it hides, where the work allows
            d = int(tile_device[t[0]])
            k = min(last, round_s.shape[1] - 1)
            target[:k] = np.maximum(target[:k], round_s[d, 1:k + 1])
        local = np.flatnonzero(rel == 0)
        st = np.full(t.size, -1, dtype=np.int64)
        st[local[np.cumsum(tt[local]) - tt[local] < target[0]]] = 0  # stage 0 hides round 1
        if out.any():  # local work kept for the last stage, so the partials sent before it travel meanwhile
            rest = local[st[local] < 0][::-1]
            st[rest[np.cumsum(tt[rest]) <= target[-1]]] = last
        for s in range(1, last):
            cand = np.flatnonzero((st < 0) & (rel <= s))
            if cand.size == 0:
                continue
            # partials leave early: remote-output tiles first, a unit's tiles together, ready units first
            cand = cand[np.lexsort((cand, rel[cand], unit[cand], ready[cand], ~out[cand]))]
            st[cand[np.cumsum(tt[cand]) - tt[cand] < target[s]]] = s
        st[st < 0] = last
        stage[t] = st
    return stage


def output_routes(tiles: TileSet, home: np.ndarray, tile_device: np.ndarray, tile_stage: np.ndarray,
                  nhb: int, direction: str) -> np.ndarray:
    """One row per (side, unit, device ≠ home): sent in (last stage of its tiles there) + 2. The
    forward has q-side partials (O) only; the backward both sides (DQ, DKV)."""
    rows = []
    n_dev = int(tile_device.max()) + 1 if tile_device.size else 1
    sides = ((0, tiles.q_tb),) if direction == "forward" else ((0, tiles.q_tb), (1, tiles.kv_tb))
    for side, blocks in sides:
        remote = tile_device != home[blocks]
        key = (blocks[remote].astype(np.int64) * nhb + tiles.hb[remote]) * n_dev + tile_device[remote]
        ukey, inv = np.unique(key, return_inverse=True)
        last = np.zeros(ukey.size, dtype=np.int64)
        np.maximum.at(last, inv, tile_stage[remote])
        dev, unit = ukey % n_dev, ukey // n_dev
        tb = unit // nhb
        rows.append(np.stack([np.full_like(tb, side), tb, unit % nhb, dev, home[tb], last + 2], axis=1))
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 6), dtype=np.int64)


def merge_outputs(outputs: np.ndarray, gpn: int) -> np.ndarray:
    """Node-level reduction: partials of one unit from several GPUs of a remote node meet on the GPU
    that is ready last, which sends the merged partial home one round after the others arrive."""
    out = outputs.copy()
    node_src = out[:, 3] // gpn
    idx = np.flatnonzero(node_src != out[:, 4] // gpn)
    if idx.size == 0:
        return out
    key = np.stack([out[idx, 0], out[idx, 1], out[idx, 2], node_src[idx]], axis=1)
    order = np.lexsort((out[idx, 3], -out[idx, 5], key[:, 3], key[:, 2], key[:, 1], key[:, 0]))
    idx, key = idx[order], key[order]
    new_group = np.r_[True, (key[1:] != key[:-1]).any(axis=1)]
    gid = np.cumsum(new_group) - 1
    head = idx[new_group]  # the aggregator: latest ready round in its group
    members = ~new_group
    if not members.any():
        return out
    out[idx[members], 4] = out[head[gid[members]], 3]
    latest = np.zeros(head.size, dtype=np.int64)
    np.maximum.at(latest, gid[members], out[idx[members], 5])
    has = np.bincount(gid[members], minlength=head.size) > 0
    out[head[has], 5] = np.maximum(out[head[has], 5], latest[has] + 1)
    return out


def schedule(spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet, home: np.ndarray,
             tile_device: np.ndarray, tile_time: np.ndarray, cost: CostModel, direction: str = "forward",
             max_stages: int = 4, two_phase: bool = True) -> Schedule:
    """The schedule of one direction for a placement (module docstring). ``tile_time``: that
    direction's modelled seconds per tile; ``max_stages``: rounds of transfers aimed for (a round
    carries about 1/max_stages of the busiest resource's bytes, or one stage's compute if more)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    home = np.asarray(home, dtype=np.int64)
    tile_device = np.asarray(tile_device, dtype=np.int64)
    tile_time = np.asarray(tile_time, dtype=float)
    nhb = layout.n_head_blocks
    n = cluster.n_devices
    # per-tile times charge each tile its own launch and small-tile efficiency; a stage runs as one fused
    # call, so scale them to each device's fused total (what the simulator charges) before pacing rounds
    group = cost.tile_groups(layout, tiles)
    flops = tiles.bwd_flops if direction == "backward" else tiles.fwd_flops
    fused = cost.fused_calls_s(flops, tiles.full, tiles.q_tb, tiles.kv_tb, group, layout.tb_len, tile_device, n,
                               backward=direction == "backward", unmasked=tiles.unmasked,
                               shapes=cost.tile_shapes(tiles))
    alone = np.bincount(tile_device, weights=tile_time, minlength=n)
    tile_time = tile_time * (fused / np.maximum(alone, 1e-300))[tile_device]
    dm = find_demands(spec, layout, tiles, home, tile_device, tile_time, direction)
    key = _unit_key(dm, layout.n_token_blocks, nhb)
    target = np.bincount(tile_device, weights=tile_time, minlength=n) / (max_stages + 1)
    local = (dm.tile_q < 0) & (dm.tile_kv < 0)
    stage0 = np.minimum(target, np.bincount(tile_device[local], weights=tile_time[local], minlength=n))
    floor = comm_floor(dm, key, home, cluster, cost) / max_stages
    arrival, source = input_rounds(dm, key, home, cluster, cost, np.maximum(stage0, floor),
                                   np.maximum(target, floor), 2 * max_stages, two_phase)
    release = np.zeros(tiles.n_tiles, dtype=np.int64)
    for col in (dm.tile_q, dm.tile_kv):
        has = col >= 0
        release[has] = np.maximum(release[has], arrival[col[has]])
    q_out = home[tiles.q_tb] != tile_device
    kv_out = home[tiles.kv_tb] != tile_device
    q_unit = tiles.q_tb.astype(np.int64) * nhb + tiles.hb
    kv_unit = tiles.kv_tb.astype(np.int64) * nhb + tiles.hb
    out_unit = np.where(q_out, 2 * q_unit, -1)
    if direction == "backward":  # a remote dKV unit first: it is the side a q-stationary plan sends back
        out_unit = np.where(kv_out, 2 * kv_unit + 1, out_unit)
    # devices that send or receive after round 1: inputs of later rounds, partials either way
    staged = np.zeros(cluster.n_devices, dtype=bool)
    late = arrival >= 2
    staged[dm.dev[late]] = True
    staged[source[late]] = True
    for out, blocks in ((q_out, tiles.q_tb), (kv_out, tiles.kv_tb)) if direction == "backward" else ((q_out, tiles.q_tb),):
        staged[tile_device[out]] = True
        staged[home[blocks[out]]] = True
    stage = tile_stages(tile_device, release, out_unit, tile_time, staged, max_stages,
                        round_durations(dm, arrival, source, cluster, cost))
    inputs = np.stack([dm.side, dm.tb, dm.hb, source, dm.dev, arrival], axis=1).astype(np.int64) \
        if dm.n else np.zeros((0, 6), dtype=np.int64)
    outputs = output_routes(tiles, home, tile_device, stage, nhb, direction)
    if two_phase and cluster.nodes > 1:
        outputs = merge_outputs(outputs, cluster.gpus_per_node)
    return Schedule(direction, stage, Routes(inputs, outputs))
