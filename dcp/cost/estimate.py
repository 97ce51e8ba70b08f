"""A fast estimate of one direction's simulated makespan, from a schedule's arrays (no programs, no events).

The planner compares many candidate placements and schedules; the discrete-event simulator
(``dcp.sim.simulate``, ~0.1 s per direction) is too slow for that, so this estimate follows the same
program structure (``dcp.schedule.build``: per round r, launch r, compute stage r−1, wait r, merge what arrived)
and the same cost rules (``CostModel.fused_call_s`` per stage, ``memory_bound_s`` per merge, the
backward's delta first), vectorized over devices round by round. Only the network is simplified: a
round's flows (coalesced per sender and receiver, as the simulator does) all start at the later of their
two ends' launches plus the link latency, and each finishes when the busiest resource it crosses
(sender port, receiver port, and across nodes the two NICs, as the profile groups GPUs onto NICs) has
drained that round's bytes. Rounds do not contend with each other. The estimate ranks plans like the simulator does (tests compare them);
its absolute error is a few percent on typical plans.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dcp.cluster import Cluster
from dcp.cost import CostModel
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.layout.units import LSE_BYTES, Kind, bytes_per_token
from dcp.spec import BatchSpec

if TYPE_CHECKING:  # the schedule stands on this estimate's cost model, not the other way
    from dcp.schedule.stages import Schedule

_OUT_KINDS = {"forward": (Kind.O, None), "backward": (Kind.DQ, Kind.DKV)}
_IN_KINDS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}


def stage_compute_s(layout: BlockLayout, tiles: TileSet, tile_device: np.ndarray, tile_stage: np.ndarray,
                    cost: CostModel, direction: str, n_devices: int) -> np.ndarray:
    """float ``[n_devices, n_stages]``: each (device, stage)'s fused kernel call, as
    ``CostModel.fused_call_s`` charges it (one launch; each group of tiles, ``CostModel.tile_groups``, at
    the efficiency of its merged q and kv extents)."""
    n_stages = int(tile_stage.max()) + 1 if tile_stage.size else 1
    cell = np.asarray(tile_device, np.int64) * n_stages + tile_stage
    group = cost.tile_groups(layout, tiles)
    flops = tiles.bwd_flops if direction == "backward" else tiles.fwd_flops
    return cost.fused_calls_s(flops, tiles.full, tiles.q_tb, tiles.kv_tb, group, layout.tb_len, cell,
                              n_devices * n_stages, backward=direction == "backward",
                              unmasked=tiles.unmasked, shapes=cost.tile_shapes(tiles)).reshape(n_devices, n_stages)


def estimate_makespan_s(spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet,
                        home: np.ndarray, tile_device: np.ndarray, sched: Schedule, cost: CostModel) -> float:
    """Estimated makespan (seconds) of ``sched``'s direction (module docstring)."""
    return float(estimate_device_ends_s(spec, cluster, layout, tiles, home, tile_device, sched, cost).max(initial=0.0))


def estimate_device_ends_s(spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet,
                           home: np.ndarray, tile_device: np.ndarray, sched: Schedule, cost: CostModel) -> np.ndarray:
    """float ``[n_devices]``: when each device's stream is estimated to finish (its last wait included)."""
    p = cost.profile
    direction = sched.direction
    n, gpn = cluster.n_devices, cluster.gpus_per_node
    comp = stage_compute_s(layout, tiles, np.asarray(tile_device), sched.tile_stage, cost, direction, n)
    n_stages = comp.shape[1]
    bpt = bytes_per_token(spec, layout)
    ins, outs = sched.routes.inputs, sched.routes.outputs
    in_kind, out_kind = _IN_KINDS[direction], _OUT_KINDS[direction]
    rows = [ins]
    kinds = [np.where(ins[:, 0] == 0, int(in_kind[0]), int(in_kind[1]))]
    if outs.size:
        keep = np.array([out_kind[int(s)] is not None for s in (0, 1)])[outs[:, 0]]
        rows.append(outs[keep])
        kinds.append(np.where(outs[keep, 0] == 0, int(out_kind[0]), int(out_kind[1] or 0)))
    tr = np.concatenate(rows) if rows else np.zeros((0, 6), dtype=np.int64)
    kind = np.concatenate(kinds) if kinds else np.zeros(0, dtype=np.int64)
    per_token = np.array([bpt[Kind(k)] for k in range(len(Kind))], dtype=np.int64)
    nbytes = per_token[kind] * layout.tb_len[tr[:, 1]] if tr.size else np.zeros(0)
    n_rounds = int(tr[:, 5].max()) if tr.size else 0
    # merges per (receiver, round, unit): one memory-bound kernel over (2 + sources) units
    red = np.zeros((n, n_rounds + 1))
    n_merges = np.zeros((n, n_rounds + 1))
    if outs.size:
        o = outs[keep]
        okind = kinds[-1]
        ukey = ((o[:, 4] * (n_rounds + 1) + o[:, 5]) * 2 + o[:, 0]) * layout.n_token_blocks * layout.n_head_blocks \
            + o[:, 1] * layout.n_head_blocks + o[:, 2]
        uk, first, cnt = np.unique(ukey, return_index=True, return_counts=True)
        ub = per_token[okind[first]] * layout.tb_len[o[first, 1]]
        np.add.at(red, (o[first, 4], o[first, 5]), cost.memory_bound_s((2 + cnt) * ub))
        np.add.at(n_merges, (o[first, 4], o[first, 5]), 1)
    # flows: one per (round, src, dst)
    if tr.size:
        fkey = (tr[:, 5] * n + tr[:, 3]) * n + tr[:, 4]
        fk, f_inv = np.unique(fkey, return_inverse=True)
        f_bytes = np.bincount(f_inv, weights=nbytes, minlength=fk.size)
        f_round, f_src, f_dst = fk // (n * n), fk // n % n, fk % n
        local = f_src == f_dst
    t = np.full(n, p.program_overhead_us * 1e-6)
    hc = cost.host_s()
    host = np.full(n, hc.program)  # when each device's host has issued its last instruction (GPUProfile.host_*)
    if direction == "backward":
        tokens = np.bincount(home, weights=layout.tb_len, minlength=n)
        per_tok = spec.num_heads * (2 * spec.head_dim * spec.element_bytes + LSE_BYTES)
        has = tokens > 0
        host = host + np.where(has, hc.compute, 0.0)
        t = t + np.where(has, host + cost.memory_bound_s(tokens * per_tok), 0.0)
    round_over = p.round_overhead_us * 1e-6
    per_nic, n_nics, nic = cost.nic_layout(gpn, cluster.nodes)
    port, lat = p.nvlink_gbps * 1e9, p.link_latency_us * 1e-6
    for r in range(1, max(n_rounds, n_stages) + 1):
        msgs = np.zeros(n)
        sel = np.flatnonzero(f_round == r) if r <= n_rounds else np.zeros(0, dtype=np.int64)
        if sel.size:
            msgs = np.bincount(f_src[sel], minlength=n) + np.bincount(f_dst[sel[~local[sel]]], minlength=n)
        busy = msgs > 0
        if round_over:
            t = t + round_over * busy
        host = host + np.where(busy, hc.launch + hc.message * msgs, 0.0)
        post = np.maximum(t, host)
        if r - 1 < n_stages:
            c = comp[:, r - 1]
            host = host + np.where(c > 0, hc.compute, 0.0)
            t = np.where(c > 0, np.maximum(t, host) + c, t)
        host = host + np.where(busy, hc.wait, 0.0)
        t = np.where(busy, np.maximum(t, host), t)
        if r <= n_rounds:
            if sel.size:
                src, dst, b = f_src[sel], f_dst[sel], f_bytes[sel]
                start = np.maximum(post[src], post[dst]) + np.where(local[sel], 0.0, lat)
                cross = (src // gpn) != (dst // gpn)
                drain = np.maximum(np.bincount(src, weights=b, minlength=n)[src],
                                   np.bincount(dst, weights=b, minlength=n)[dst]) / port
                if cross.any():
                    out_n = np.bincount(src[cross] // per_nic, weights=b[cross], minlength=n_nics)
                    in_n = np.bincount(dst[cross] // per_nic, weights=b[cross], minlength=n_nics)
                    drain = np.where(cross, np.maximum(drain, np.maximum(out_n[src // per_nic],
                                                                         in_n[dst // per_nic]) / nic), drain)
                fin = start + np.where(local[sel], 0.0, drain)
                done = np.zeros(n)
                np.maximum.at(done, src, fin)
                np.maximum.at(done, dst, fin)
                t = np.maximum(t, done)  # both ends wait for every flow of the round
            m = n_merges[:, r] > 0
            host = host + hc.reduce * n_merges[:, r]
            t = np.where(m, np.maximum(t, host), t) + red[:, r]
    return t
