"""A fast estimate of one direction's simulated makespan, from a schedule's arrays (no programs, no events).

The planner compares many candidate placements and schedules; the discrete-event simulator
(``dcp.sim.simulate``, ~0.1 s per direction) is too slow for that, so this estimate follows the same
program structure (``dcp.schedule.build``: per round r, launch r, compute stage r−1, wait r, merge what arrived)
and the same cost rules (``CostModel.fused_call_s`` per stage, ``merges_s`` for the merges, the
backward's delta first), round by round: ``rounds_end_s_reference`` in numpy, vectorized over devices,
and the same loop in C++ (``dcp._C.estimate_rounds``), which the planner uses when the extension is
built. Only the network is simplified: a round's flows (coalesced per sender and receiver, as the
simulator does) all start at the later of their two ends' launches plus the link latency, and each
finishes when the busiest resource it crosses (sender port, receiver port, and across nodes the two
NICs, as the profile groups GPUs onto NICs) has drained that round's bytes. Rounds do not contend with
each other. The estimate ranks plans like the simulator does (tests compare them);
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

try:  # the C++ loop, when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE = hasattr(_C, "estimate_rounds")
except ImportError:
    _C, _NATIVE = None, False

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
    # merges per (receiver, round, unit) over (2 + sources) units (``CostModel.merges_s``)
    red = np.zeros((n, n_rounds + 1))
    n_merges = np.zeros((n, n_rounds + 1))
    if outs.size:
        o = outs[keep]
        okind = kinds[-1]
        ukey = ((o[:, 4] * (n_rounds + 1) + o[:, 5]) * 2 + o[:, 0]) * layout.n_token_blocks * layout.n_head_blocks \
            + o[:, 1] * layout.n_head_blocks + o[:, 2]
        uk, first, cnt = np.unique(ukey, return_index=True, return_counts=True)
        ub = per_token[okind[first]] * layout.tb_len[o[first, 1]]
        step = o[first, 4] * (n_rounds + 1) + o[first, 5]
        np.add.at(red, (o[first, 4], o[first, 5]), cost.merges_s(step, okind[first] != int(Kind.O), cnt, ub))
        np.add.at(n_merges, (o[first, 4], o[first, 5]), 1)
    t0 = np.full(n, p.program_overhead_us * 1e-6)
    hc = cost.host_s()
    # the host's merge time per (receiver, round): per unit and per step (the C++ loop multiplies it by 1)
    merge_host = hc.merges_s(n_merges)
    host0 = np.full(n, hc.program)  # when each device's host has issued its last instruction (GPUProfile.host_*)
    if direction == "backward":
        tokens = np.bincount(home, weights=layout.tb_len, minlength=n)
        per_tok = spec.num_heads * (2 * spec.head_dim * spec.element_bytes + LSE_BYTES)
        has = tokens > 0
        host0 = host0 + np.where(has, hc.compute, 0.0)
        t0 = t0 + np.where(has, host0 + cost.memory_bound_s(tokens * per_tok), 0.0)
    per_nic, _, nic = cost.nic_layout(gpn, cluster.nodes)
    args = (tr[:, 5], tr[:, 3], tr[:, 4], np.asarray(nbytes, np.float64), comp, red, merge_host, t0, host0, hc,
            p.round_overhead_us * 1e-6, p.link_latency_us * 1e-6, p.nvlink_gbps * 1e9, nic, gpn, per_nic)
    return rounds_end_s(*args) if _NATIVE else rounds_end_s_reference(*args)


def rounds_end_s(round_, src, dst, nbytes, comp, red, merge_host, t0, host0, hc, round_over, latency, port, nic,
                 gpus_per_node, per_nic) -> np.ndarray:
    """``rounds_end_s_reference`` in C++ (``dcp._C.estimate_rounds``, csrc/estimate.cpp): the same times."""
    import torch

    i64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    f64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))  # noqa: E731
    return _C.estimate_rounds(i64(round_), i64(src), i64(dst), f64(nbytes), f64(comp), f64(red), f64(merge_host),
                              f64(t0), f64(host0), [hc.launch, hc.message, hc.wait, hc.compute, 1.0],
                              float(round_over), float(latency), float(port), float(nic), int(gpus_per_node),
                              int(per_nic)).numpy()


def rounds_end_s_reference(round_, src, dst, nbytes, comp, red, merge_host, t0, host0, hc, round_over, latency, port,
                           nic, gpus_per_node, per_nic) -> np.ndarray:
    """float ``[n_devices]``: when each device's stream ends, round by round (module docstring).

    ``round_``/``src``/``dst``/``nbytes``: one entry per transfer (coalesced here per round, sender and
    receiver); ``comp`` ``[n, n_stages]`` stage compute seconds; ``red``/``merge_host`` ``[n, n_rounds + 1]``
    the merges' device and host seconds per (receiver, round) (host time > 0 marks a round with merges);
    ``t0``/``host0`` ``[n]`` when stream and host start; ``hc``: ``HostCosts`` (its ``reduce`` unused: the
    host's merge time comes in ``merge_host``); ``port``/``nic`` in bytes/s, ``per_nic`` GPUs share a NIC."""
    n, gpn = t0.size, gpus_per_node
    n_rounds, n_stages = red.shape[1] - 1, comp.shape[1]
    fkey = (np.asarray(round_, np.int64) * n + src) * n + dst
    fk, f_inv = np.unique(fkey, return_inverse=True)
    f_bytes = np.bincount(f_inv, weights=nbytes, minlength=fk.size)
    f_round, f_src, f_dst = fk // (n * n), fk // n % n, fk % n
    local = f_src == f_dst
    n_nics = n // per_nic
    t, host = np.array(t0, dtype=float), np.array(host0, dtype=float)
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
                src_s, dst_s, b = f_src[sel], f_dst[sel], f_bytes[sel]
                start = np.maximum(post[src_s], post[dst_s]) + np.where(local[sel], 0.0, latency)
                cross = (src_s // gpn) != (dst_s // gpn)
                drain = np.maximum(np.bincount(src_s, weights=b, minlength=n)[src_s],
                                   np.bincount(dst_s, weights=b, minlength=n)[dst_s]) / port
                if cross.any():
                    out_n = np.bincount(src_s[cross] // per_nic, weights=b[cross], minlength=n_nics)
                    in_n = np.bincount(dst_s[cross] // per_nic, weights=b[cross], minlength=n_nics)
                    drain = np.where(cross, np.maximum(drain, np.maximum(out_n[src_s // per_nic],
                                                                         in_n[dst_s // per_nic]) / nic), drain)
                fin = start + np.where(local[sel], 0.0, drain)
                done = np.zeros(n)
                np.maximum.at(done, src_s, fin)
                np.maximum.at(done, dst_s, fin)
                t = np.maximum(t, done)  # both ends wait for every flow of the round
            m = merge_host[:, r] > 0
            host = host + merge_host[:, r]
            t = np.where(m, np.maximum(t, host), t) + red[:, r]
    return t
