"""The reference simulator: ``dcp.sim.simulate``'s model, run the slow and obvious way, as a test oracle.

It walks the instruction view of a plan (``Plan.program``: one object per instruction and transfer)
device by device, charges each ``Compute`` its ``CostModel.fused_call_s`` when it first runs, and
shares bandwidth with ``FluidNetwork``, which recomputes every active flow's max-min rate at every
event. ``dcp.sim.simulate`` reads the columnar program instead, precomputes every duration at once and
recomputes rates only in the component of the network that changed; tests demand both give the same
timeline. The model itself is documented in ``dcp.sim.simulator``.
"""
from __future__ import annotations

import heapq
import time

import numpy as np

from dcp.cost import CostModel
from dcp.ir.instructions import CommLaunch, CommWait, Compute, Reduce
from dcp.ir.plan import Plan
from dcp.layout.units import Kind, bytes_per_token
from dcp.sim.events import DIRECTIONS, SimEvent, SimResult, _resources
from dcp.sim.network import FluidNetwork
from dcp.sim.simulator import _delta_s, ideal_time_s


def simulate_reference(plan: Plan, cost: CostModel, direction: str = "forward", *, coalesce: bool = True,
             nic: str | None = None, record_events: bool = True) -> SimResult:
    """Simulate one direction of ``plan`` under ``cost`` (see the module docstring for the model).

    Raises ``ValueError`` for an unknown direction or NIC model, or when the program cannot finish
    (a wait whose transfers never start: a send without a matching launch on the peer, a deadlock).
    """
    started = time.perf_counter()
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if nic not in (None, "node", "rail"):
        raise ValueError(f"nic must be None (the profile's), 'node' or 'rail', got {nic!r}")
    prof = cost.profile
    n_dev = plan.n_devices
    gpn = plan.cluster.gpus_per_node
    n_nodes = plan.cluster.nodes
    programs = plan.program(direction)
    latency = prof.link_latency_us * 1e-6
    tiles = plan.tiles
    t_flops = tiles.bwd_flops if direction == "backward" else tiles.fwd_flops
    t_group = cost.tile_groups(plan.layout, tiles)
    bpt = {int(k): int(v) for k, v in bytes_per_token(plan.spec, plan.layout).items()}
    tb_len = plan.layout.tb_len.tolist()

    # --- flows: one per (round, src, dst) [coalesce] or per transfer -------------------------------
    flow_key: dict[tuple, int] = {}
    f_round, f_src, f_dst, f_bytes, f_units = [], [], [], [], []
    dev_round_flows: dict[tuple[int, int], list[int]] = {}
    n_transfers = 0
    for p in programs:
        d = p.device
        for ins in p.instructions:
            if not isinstance(ins, CommLaunch):
                continue
            for i, (unit, peer) in enumerate(ins.sends):
                nbytes = bpt[int(unit.kind)] * tb_len[unit.tb]
                n_transfers += 1
                key = (ins.round, d, peer) if coalesce else (ins.round, d, peer, i)
                f = flow_key.get(key)
                if f is None:
                    f = flow_key[key] = len(f_round)
                    f_round.append(ins.round)
                    f_src.append(d)
                    f_dst.append(peer)
                    f_bytes.append(0)
                    f_units.append(0)
                    dev_round_flows.setdefault((d, ins.round), []).append(f)
                    if peer != d:
                        dev_round_flows.setdefault((peer, ins.round), []).append(f)
                f_bytes[f] += nbytes
                f_units[f] += 1
    n_flows = len(f_round)
    f_start = [np.nan] * n_flows
    f_end = [np.nan] * n_flows
    f_posted = [0] * n_flows
    pending = {k: len(v) for k, v in dev_round_flows.items()}  # unfinished flows of (device, round)
    post_time: dict[tuple[int, int], float] = {}

    per_nic, n_nics, nic_cap = cost.nic_layout(gpn, n_nodes, nic)
    caps = [prof.nvlink_gbps * 1e9] * (2 * n_dev) + [nic_cap] * (2 * n_nics)
    net = FluidNetwork(caps)
    net_flow_of: dict[int, int] = {}  # network flow id -> our flow id
    starts: list[tuple[float, int]] = []  # heap of (time entering the network, flow)

    # --- per-device stream state ----------------------------------------------------------------------
    clock = [0.0] * n_dev
    pc = [0] * n_dev
    blocked: dict[int, tuple[int, float]] = {}  # device -> (round it waits for, time it started waiting)
    compute_s = np.zeros(n_dev)
    reduce_s = np.zeros(n_dev)
    wait_s = np.zeros(n_dev)
    events: list[SimEvent] = []
    compute_cache: dict[int, float] = {}
    merge_durs: dict[tuple[int, int], float] = {}  # (device, instruction index) -> seconds, per run of merges

    round_over = prof.round_overhead_us * 1e-6
    # an asynchronous device's host issues its instructions in order (GPUProfile.host_*): host[d] is when it
    # has issued device d's last one; an instruction starts on the device no earlier
    hc = cost.host_s()
    host = [hc.program if programs[d].instructions else 0.0 for d in range(n_dev)]
    if prof.program_overhead_us:
        for d in range(n_dev):
            if programs[d].instructions:
                clock[d] = prof.program_overhead_us * 1e-6
    if direction == "backward":
        delta = _delta_s(plan, cost)
        for d in range(n_dev):
            if delta[d] > 0:
                if not programs[d].instructions:
                    clock[d] = prof.program_overhead_us * 1e-6
                    host[d] = hc.program
                host[d] += hc.compute  # issuing the delta
                clock[d] += host[d]
                start = clock[d]
                clock[d] += float(delta[d])
                reduce_s[d] += float(delta[d])
                if record_events:
                    events.append(SimEvent(d, "delta", "delta (home rows)", start, clock[d]))

    def finish_flow(f: int, t: float) -> None:
        f_end[f] = t
        for d in {f_src[f], f_dst[f]}:
            key = (d, f_round[f])
            pending[key] -= 1
            if pending[key] == 0 and d in blocked and blocked[d][0] == f_round[f]:
                rnd, since = blocked.pop(d)
                resume = max(t, since)
                if resume > since:
                    wait_s[d] += resume - since
                    if record_events:
                        events.append(SimEvent(d, "wait", f"wait r{rnd}", since, resume, round=rnd))
                clock[d] = resume
                run_device(d)

    def post(d: int, rnd: int, t: float) -> None:
        post_time[d, rnd] = t
        for f in dev_round_flows.get((d, rnd), ()):
            f_posted[f] += 1
            if f_posted[f] == (1 if f_src[f] == f_dst[f] else 2):
                s = max(post_time[f_src[f], rnd], post_time[f_dst[f], rnd])
                f_start[f] = s
                if f_src[f] == f_dst[f]:
                    heapq.heappush(starts, (s, f))  # a local copy: done when posted
                else:
                    heapq.heappush(starts, (s + latency, f))

    def run_device(d: int) -> None:
        ins_list = programs[d].instructions
        t = clock[d]
        while pc[d] < len(ins_list):
            ins = ins_list[pc[d]]
            if isinstance(ins, Compute):
                dur = compute_cache.get(id(ins))
                if dur is None:
                    idx = np.fromiter(ins.tiles, dtype=np.int64, count=len(ins.tiles))
                    dur = compute_cache[id(ins)] = cost.fused_call_s(
                        t_flops[idx], tiles.full[idx], tiles.q_tb[idx], tiles.kv_tb[idx], t_group[idx],
                        plan.layout.tb_len, backward=direction == "backward", unmasked=tiles.unmasked[idx],
                        shapes=cost.tile_shapes(tiles, idx))
                if dur > 0:
                    host[d] += hc.compute
                    t = max(t, host[d])
                    compute_s[d] += dur
                    if record_events:
                        events.append(SimEvent(d, "compute", f"stage {ins.stage} ({len(ins.tiles)} tiles)", t, t + dur))
                    t += dur
            elif isinstance(ins, CommLaunch):
                msgs = len(dev_round_flows.get((d, ins.round), ()))
                if round_over and msgs:
                    t += round_over  # packing and posting this round's messages (host-side executors)
                if msgs:
                    host[d] += hc.launch + hc.message * msgs
                post(d, ins.round, max(t, host[d]))
            elif isinstance(ins, CommWait):
                if (d, ins.round) in dev_round_flows:
                    host[d] += hc.wait
                    t = max(t, host[d])
                if pending.get((d, ins.round), 0) > 0:
                    blocked[d] = (ins.round, t)
                    clock[d] = t
                    pc[d] += 1
                    return
            elif isinstance(ins, Reduce):
                if pc[d] == 0 or not isinstance(ins_list[pc[d] - 1], Reduce):  # the round's merges, issued together
                    j = pc[d]
                    while j < len(ins_list) and isinstance(ins_list[j], Reduce):
                        j += 1
                    run = ins_list[pc[d]:j]
                    durs = cost.merges_s(np.zeros(len(run), np.int64), [r.unit.kind != Kind.O for r in run],
                                         [len(r.sources) for r in run],
                                         [bpt[int(r.unit.kind)] * tb_len[r.unit.tb] for r in run])
                    merge_durs.update(((d, i), x) for i, x in zip(range(pc[d], j), durs.tolist()))
                    host[d] += float(hc.merges_s(j - pc[d]))
                    t = max(t, host[d])
                dur = merge_durs[(d, pc[d])]
                reduce_s[d] += dur
                if record_events:
                    u = ins.unit
                    events.append(SimEvent(d, "reduce", f"reduce {u.kind.name}[{u.tb},{u.hb}] <- {list(ins.sources)}",
                                           t, t + dur))
                t += dur
            else:
                raise TypeError(f"device {d}: unknown instruction {ins!r}")
            pc[d] += 1
        clock[d] = t

    for d in range(n_dev):
        run_device(d)

    # --- event loop: flows entering the network and finishing ------------------------------------------
    while True:
        t_start = starts[0][0] if starts else np.inf
        t_done = net.next_completion()
        if not np.isfinite(t_start) and not np.isfinite(t_done):
            break
        if t_start <= t_done:
            for fid, tf in net.advance(t_start):  # flows finishing exactly at t_start
                finish_flow(net_flow_of.pop(fid), tf)
            batch = []
            while starts and starts[0][0] <= t_start:
                batch.append(heapq.heappop(starts)[1])
            local = [f for f in batch if f_src[f] == f_dst[f]]
            remote = [f for f in batch if f_src[f] != f_dst[f]]
            if remote:
                ids = net.add_flows([_resources(f_src[f], f_dst[f], gpn, n_dev, n_nics, per_nic) for f in remote],
                                    [f_bytes[f] for f in remote])
                net_flow_of.update(zip(ids.tolist(), remote))
            for f in local:
                finish_flow(f, t_start)
        else:
            for fid, tf in net.advance(t_done):
                finish_flow(net_flow_of.pop(fid), tf)

    if blocked or any(pc[d] < len(programs[d].instructions) for d in range(n_dev)):
        stuck = sorted(blocked.items())[:4]
        raise ValueError(f"{direction}: simulation cannot finish; devices blocked (device, (round, since)): {stuck}"
                         " — a transfer whose peer never posts that round, or a deadlock")

    comm = np.zeros(n_dev, dtype=np.int64)
    if n_flows:
        fb = np.asarray(f_bytes, dtype=np.int64)
        comm += np.bincount(np.asarray(f_src), weights=fb, minlength=n_dev).astype(np.int64)
        comm += np.bincount(np.asarray(f_dst), weights=fb, minlength=n_dev).astype(np.int64)
    if record_events:
        for f in range(n_flows):
            events.append(SimEvent(f_src[f], "transfer", f"r{f_round[f]} {f_src[f]}->{f_dst[f]} ({f_units[f]} units)",
                                   f_start[f], f_end[f], f_src[f], f_dst[f], f_bytes[f], f_round[f], f_units[f]))
    end = np.asarray(clock, dtype=float)
    makespan = float(max(end.max(initial=0.0), max(f_end, default=0.0)))
    return SimResult(makespan, end, compute_s, reduce_s, wait_s, comm, ideal_time_s(plan, cost, direction),
                     prof.name, direction, plan.planner, n_transfers, n_flows, tuple(events),
                     time.perf_counter() - started)
