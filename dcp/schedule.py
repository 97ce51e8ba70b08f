"""Stages and routes: when each tile runs and how every remote unit travels.

A device's remote input units are grouped into rounds 1..S: round r's transfers are posted before
stage r−1 computes, so they hide behind it; stage r holds the tiles whose inputs have all arrived by
round r. Devices exchange data in lockstep rounds, so every stage of every device aims at the same
modelled time (total compute / devices / (S + 1)): local tiles, which need no transfer, fill each
stage's shortfall (see ``_device_stages``).

Partial outputs go home in the first round after their last tile ran (stage s → round s+2). With
``two_phase``, a unit needed by several GPUs of a remote node crosses the network once, to the GPU that
needs it first, which relays it over NVLink; partial outputs of several GPUs of a remote node are merged
on one of them before crossing back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.blocks import BlockLayout, TileSet
from dcp.cluster import Cluster
from dcp.cost import CostModel
from dcp.spec import BatchSpec
from dcp.units import Kind, unit_bytes

ROUTE_COLUMNS = ("side", "tb", "hb", "src", "dst", "round")  # side 0: q side, 1: kv side


@dataclass(frozen=True, eq=False)
class Routes:
    """``inputs``/``outputs``: int64 ``[n, 6]`` rows of ROUTE_COLUMNS. An input row delivers a unit to
    ``dst`` in ``round``; an output row forwards ``src``'s (merged) partial to ``dst`` in ``round``."""

    inputs: np.ndarray
    outputs: np.ndarray


def _device_stages(unit_time, unit_of_tile_q, unit_of_tile_kv, tile_time, stage_target, max_stages):
    """Round of each remote unit and stage of each tile of one device (vectorized per round).

    ``unit_of_tile_q/kv``: index of the tile's remote q/kv unit, or -1 when local. Every stage aims at
    the same modelled time ``stage_target`` on every device: devices exchange data in lockstep rounds,
    so a stage that runs long on one device delays everyone's next round. Round r's units are chosen by
    value density (compute they unlock per transfer second) until their transfer time fills the
    overlapped stage. A tile is released in the stage its last input arrives (local tiles: stage 0);
    stages are then filled in order up to the target with released tiles, in tile order so a
    sequence's tiles stay together, and the last stage takes what is left.
    """
    n_units = unit_time.size
    unit_round = np.zeros(n_units, dtype=np.int64)  # 0: not yet chosen
    local = (unit_of_tile_q < 0) & (unit_of_tile_kv < 0)
    tile_stage = np.zeros(unit_of_tile_q.size, dtype=np.int64)
    pending = ~local
    for r in range(1, max_stages + 1):
        open_units = unit_round == 0
        if not open_units.any():
            break
        if r == max_stages:
            chosen = open_units
        else:
            have = unit_round > 0
            q_ok = (unit_of_tile_q < 0) | have[np.maximum(unit_of_tile_q, 0)]
            kv_ok = (unit_of_tile_kv < 0) | have[np.maximum(unit_of_tile_kv, 0)]
            # a tile missing exactly one unit credits it fully; missing two credits each half
            miss_q = pending & ~q_ok
            miss_kv = pending & ~kv_ok
            share = np.where(miss_q & miss_kv, 0.5, 1.0) * tile_time
            value = np.bincount(unit_of_tile_q[miss_q], weights=share[miss_q], minlength=n_units) + \
                np.bincount(unit_of_tile_kv[miss_kv], weights=share[miss_kv], minlength=n_units)
            budget = max(stage_target, unit_time[open_units].sum() / (max_stages - r + 1))
            cand = np.flatnonzero(open_units)
            cand = cand[np.argsort(-value[cand] / np.maximum(unit_time[cand], 1e-12), kind="stable")]
            within = np.cumsum(unit_time[cand]) <= budget
            within[0] = True
            chosen = np.zeros(n_units, dtype=bool)
            chosen[cand[within]] = True
        unit_round[chosen] = r
        have = unit_round > 0
        ready = pending & ((unit_of_tile_q < 0) | have[np.maximum(unit_of_tile_q, 0)]) & \
            ((unit_of_tile_kv < 0) | have[np.maximum(unit_of_tile_kv, 0)])
        tile_stage[ready] = r
        pending &= ~ready
    # tile_stage now holds each tile's release stage (0 for local tiles); fill stages in order, each up
    # to the common target, with released tiles in tile order (a sequence's tiles stay together)
    release = tile_stage
    n_stages = max(int(release.max()) + 1, max_stages + 1)
    stage = np.full(release.size, -1, dtype=np.int64)
    for s_ in range(n_stages):
        cand = np.flatnonzero((stage < 0) & (release <= s_))
        if cand.size == 0:
            continue
        if s_ == n_stages - 1:
            stage[cand] = s_
            break
        take = np.cumsum(tile_time[cand]) - tile_time[cand] <= stage_target
        if not take[0] and s_ >= release[cand].max():
            take[0] = True
        stage[cand[take]] = s_
    tile_stage = stage
    return unit_round, tile_stage


def schedule(spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet, home: np.ndarray,
             tile_device: np.ndarray, tile_time: np.ndarray, cost: CostModel, max_stages: int = 4,
             two_phase: bool = True) -> tuple[np.ndarray, Routes]:
    """Tile stages and routes for a placement (see module docstring). ``tile_time``: forward seconds."""
    nhb = layout.n_head_blocks
    tile_stage = np.zeros(tiles.n_tiles, dtype=np.int64)
    rows = []
    q_key = tiles.q_tb.astype(np.int64) * nhb + tiles.hb
    kv_key = tiles.kv_tb.astype(np.int64) * nhb + tiles.hb
    gpn = cluster.gpus_per_node
    stage_target = float(tile_time.sum()) / cluster.n_devices / (max_stages + 1)
    for d in range(cluster.n_devices):
        t_idx = np.flatnonzero(tile_device == d)
        if t_idx.size == 0:
            continue
        q_remote = home[tiles.q_tb[t_idx]] != d
        kv_remote = home[tiles.kv_tb[t_idx]] != d
        keys = np.concatenate([q_key[t_idx][q_remote] * 2, kv_key[t_idx][kv_remote] * 2 + 1])
        ukeys, inv = np.unique(keys, return_inverse=True)
        uq = np.full(t_idx.size, -1, dtype=np.int64)
        ukv = np.full(t_idx.size, -1, dtype=np.int64)
        uq[q_remote] = inv[:q_remote.sum()]
        ukv[kv_remote] = inv[q_remote.sum():]
        side = ukeys % 2
        tb = ukeys // 2 // nhb
        src = home[tb]
        nbytes = np.where(side == 0, unit_bytes(spec, layout, Kind.Q, tb), unit_bytes(spec, layout, Kind.KV, tb))
        utime = cost.transfer_s(nbytes, src // gpn != d // gpn, gpn)
        urnd, stage = _device_stages(utime, uq, ukv, tile_time[t_idx], stage_target, max_stages)
        tile_stage[t_idx] = stage
        rows.append(np.stack([side, tb, ukeys // 2 % nhb, src, np.full_like(tb, d), urnd], axis=1))
    inputs = np.concatenate(rows) if rows else np.zeros((0, 6), dtype=np.int64)
    if inputs.shape[0] == 0:
        # nothing moves (every tile sits with its data): one stage, one kernel call per device
        tile_stage[:] = 0
    outputs = _output_routes(tiles, home, tile_device, tile_stage, nhb)
    if two_phase and cluster.nodes > 1:
        inputs = _relay_inputs(inputs, gpn)
        outputs = _merge_outputs(outputs, gpn)
    return tile_stage, Routes(inputs, outputs)


def _output_routes(tiles, home, tile_device, tile_stage, nhb):
    """One row per (side, unit, device ≠ home): sent at (last stage of its tiles there) + 2."""
    rows = []
    for side, blocks in ((0, tiles.q_tb), (1, tiles.kv_tb)):
        remote = tile_device != home[blocks]
        key = (blocks[remote].astype(np.int64) * nhb + tiles.hb[remote]) * (tile_device.max() + 1) + tile_device[remote]
        ukey, inv = np.unique(key, return_inverse=True)
        last = np.zeros(ukey.size, dtype=np.int64)
        np.maximum.at(last, inv, tile_stage[remote])
        dev = ukey % (tile_device.max() + 1)
        unit = ukey // (tile_device.max() + 1)
        tb = unit // nhb
        rows.append(np.stack([np.full_like(tb, side), tb, unit % nhb, dev, home[tb], last + 2], axis=1))
    return np.concatenate(rows)


def _relay_inputs(inputs: np.ndarray, gpn: int) -> np.ndarray:
    """Two-phase multicast: within each remote node, the earliest consumer relays to later ones."""
    out = inputs.copy()
    node_dst = out[:, 4] // gpn
    remote = node_dst != out[:, 3] // gpn
    key = np.stack([out[:, 0], out[:, 1], out[:, 2], node_dst], axis=1)[remote]
    idx = np.flatnonzero(remote)
    if idx.size == 0:
        return out
    order = np.lexsort((out[idx, 4], out[idx, 5], key[:, 3], key[:, 2], key[:, 1], key[:, 0]))
    idx, key = idx[order], key[order]
    new_group = np.r_[True, (key[1:] != key[:-1]).any(axis=1)]
    group_first = idx[np.maximum.accumulate(np.where(new_group, np.arange(idx.size), 0))]
    later = ~new_group & (out[idx, 5] > out[group_first, 5])
    out[idx[later], 3] = out[group_first[later], 4]  # relay from the gateway (it has it a round earlier)
    return out


def _merge_outputs(outputs: np.ndarray, gpn: int) -> np.ndarray:
    """Node-level reduction: partials of one unit from several GPUs of a remote node meet on the GPU
    that is ready last, which sends the merged partial home one round after the others arrive."""
    out = outputs.copy()
    node_src = out[:, 3] // gpn
    remote = node_src != out[:, 4] // gpn
    idx = np.flatnonzero(remote)
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
    agg = head[gid[members]]
    out[idx[members], 4] = out[agg, 3]
    latest_member = np.zeros(head.size, dtype=np.int64)
    np.maximum.at(latest_member, gid[members], out[idx[members], 5])
    has_members = np.bincount(gid[members], minlength=head.size) > 0
    out[head[has_members], 5] = np.maximum(out[head[has_members], 5], latest_member[has_members] + 1)
    return out
