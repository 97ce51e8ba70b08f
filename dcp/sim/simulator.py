"""Discrete-event simulation of a plan's forward or backward program on a modelled cluster.

Model (all times from ``CostModel``; every number it produces is *simulated*, not measured):

- **Streams.** Each device runs its instruction stream in program order on one compute stream.
  ``CommLaunch(r)`` posts round r's transfers and costs nothing on the stream. ``Compute`` occupies the
  stream for one fused kernel call over its tiles (``CostModel.fused_call_s``: one launch overhead,
  each (sequence, head block) group at the efficiency of its merged q/kv extents -- each q token
  block's for profiles with ``efficiency_group="q_block"``, the CPU kernel), so plans are not charged
  for how finely their tiles are cut. ``CommWait(r)`` blocks until every transfer of round r this
  device sends or receives has finished. ``Reduce(unit, sources)`` reads the local accumulator and
  each received partial and writes the accumulator, ``(2 + len(sources)) * unit_bytes`` through HBM
  (``CostModel.merges_s``): an O merge is one kernel, ``memory_bound_s`` of those bytes; the dQ/dKV sums
  of one round run as one grouped add per layer (the executor's ``torch._foreach_add_``), so they pay
  the kernel's fixed cost once per layer of the round, not once per unit. In the backward each device
  first computes delta = rowsum(O * dO) for its home tokens: ``memory_bound_s(home_tokens * Hq * (2 * D * elem + 4))``
  (read O and dO, write fp32 delta), one op at t=0. Communication kernels do not slow compute down.
  Host-side executors (the CPU) also pay ``program_overhead_us`` once per program (before the delta)
  and ``round_overhead_us`` when they post a round they send or receive in (both 0 in GPU profiles).
- **Transfers.** Grouped point-to-point semantics: a transfer of round r starts when both its sender
  and its receiver have posted ``CommLaunch(r)``; after ``link_latency_us`` its bytes
  (``dcp.layout.units.unit_bytes``, one head block) enter a fluid network. By default the transfers of one
  round between one (sender, receiver) pair are coalesced into one flow (one NCCL connection carries
  them back to back; ``coalesce=False`` makes every unit its own flow).
- **Network.** A flow crosses the sender GPU's egress port and the receiver GPU's ingress port
  (``nvlink_gbps`` each, per direction); across nodes also the sender's NIC egress and the receiver's
  NIC ingress. By default a node's NIC is one pool (``nic_gbps_per_node`` per direction, shared by all
  the node's flows); a profile with ``nics_per_node`` splits it into that many NICs, each reached only
  by its own GPUs (p4d: 4 x 100 Gbps, 2 GPUs per NIC; ``CostModel.nic_layout``); ``nic="node"`` forces
  the pool, ``nic="rail"`` gives every GPU its own ``nic_gbps_per_node / gpus_per_node``, as
  ``CostModel.transfer_s`` assumes. Rates are max-min fair, recomputed whenever a flow starts or ends
  (``dcp.sim.network.FluidNetwork``; ``dcp.sim.flows.ComponentNetwork`` recomputes only the changed
  component, with the same result).
- **Scale.** ``simulate`` reads the columnar program (``dcp.ir.program``): every compute, merge and delta
  duration is computed up front in one vectorized pass, each device then steps only through the rounds
  in which it computes, merges or transfers, and an event touches only the devices and flows it
  involves. ``dcp.sim.reference.simulate_reference`` runs the same model over the instruction view, one
  instruction at a time (the tests' oracle). Without recorded events the event loop runs in C++
  (csrc/sim.cpp, the same operations as ``dcp.sim.streams`` and ``dcp.sim.flows``: the same times).
- **Ideal.** ``ideal_s`` = total tile FLOPs / (n_devices x the large-tile attention rate of the
  direction, ``attn_fwd_tflops`` or ``attn_bwd_tflops``): perfect balance, no overhead, no small-tile
  penalty, no communication. Every simulated makespan is at least this.
"""
from __future__ import annotations

import time

import numpy as np

from dcp.cost import CostModel
from dcp.cost.estimate import stage_compute_s
from dcp.ir.plan import Plan
from dcp.ir.program import DST, HB, KIND, ROUND, SRC, TB
from dcp.layout.units import LSE_BYTES, unit_bytes
from dcp.sim.events import DIRECTIONS, SimResult
from dcp.sim.streams import Streams


def simulate_both(plan: Plan, cost: CostModel, **kwargs) -> tuple[SimResult, SimResult]:
    """``(simulate(plan, cost, "forward"), simulate(plan, cost, "backward"))``."""
    return simulate(plan, cost, "forward", **kwargs), simulate(plan, cost, "backward", **kwargs)


def tile_times(plan: Plan, cost: CostModel, direction: str) -> np.ndarray:
    """Modelled seconds of every tile of the plan in ``direction`` (``CostModel.tile_alone_s``)."""
    return cost.tile_alone_s(plan.layout, plan.tiles, direction)


def ideal_time_s(plan: Plan, cost: CostModel, direction: str) -> float:
    p = cost.profile
    if direction == "forward":
        flops, rate = float(plan.tiles.fwd_flops.sum()), p.attn_fwd_tflops
    else:
        flops, rate = float(plan.tiles.bwd_flops.sum()), p.attn_bwd_tflops
    return flops / (max(plan.n_devices, 1) * rate * 1e12)


def _delta_s(plan: Plan, cost: CostModel) -> np.ndarray:
    spec = plan.spec
    tokens = np.bincount(plan.home, weights=plan.layout.tb_len, minlength=plan.n_devices)
    per_token = spec.num_heads * (2 * spec.head_dim * spec.element_bytes + LSE_BYTES)
    return np.where(tokens > 0, cost.memory_bound_s(tokens * per_token), 0.0)


def _flow_table(plan: Plan, direction: str, coalesce: bool) -> dict[str, np.ndarray]:
    """Flows of a direction, ordered by (src, round, dst): int64 ``src``, ``dst``, ``round``, ``units``
    (data units carried) and ``bytes``, one per (round, src, dst) when coalesced, else one per transfer."""
    tr = plan.columns(direction).transfers.astype(np.int64)
    nbytes = unit_bytes(plan.spec, plan.layout, tr[:, KIND], tr[:, TB])
    order = np.lexsort((tr[:, HB], tr[:, TB], tr[:, KIND], tr[:, DST], tr[:, ROUND], tr[:, SRC]))
    tr, nbytes = tr[order], nbytes[order]
    if coalesce and tr.shape[0]:
        first = np.flatnonzero(np.r_[True, (tr[1:][:, [SRC, ROUND, DST]] != tr[:-1][:, [SRC, ROUND, DST]]).any(axis=1)])
        units = np.diff(np.r_[first, tr.shape[0]])
        nbytes = np.add.reduceat(nbytes, first)
        tr = tr[first]
    else:
        units = np.ones(tr.shape[0], dtype=np.int64)
    return {"src": tr[:, SRC], "dst": tr[:, DST], "round": tr[:, ROUND], "units": units, "bytes": nbytes}


def simulate(plan: Plan, cost: CostModel, direction: str = "forward", *, coalesce: bool = True,
             nic: str | None = None, record_events: bool = True, native: bool | None = None) -> SimResult:
    """Simulate one direction of ``plan`` under ``cost`` (see the module docstring for the model).

    Raises ``ValueError`` for an unknown direction or NIC model, or a program whose tables are malformed
    (``dcp.ir.validate_arrays.check_columns``: a device, block or round out of range). The canonical streams
    always finish (``dcp.ir.program``), so an unvalidated plan simulates too; it may compute nonsense.
    ``native``: the event loop in C++ (``dcp._C.simulate_streams``, same results) -- None: when built and
    ``record_events`` is False; True: required (unless recording events); False: the Python loop.
    """
    from dcp.ir.validate_arrays import Problems, check_columns

    started = time.perf_counter()
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if nic not in (None, "node", "rail"):
        raise ValueError(f"nic must be None (the profile's), 'node' or 'rail', got {nic!r}")
    pb = Problems(limit=3)
    check_columns(plan, direction, pb)
    if pb.items:
        raise ValueError(f"cannot simulate the {direction} program: " + "; ".join(pb.items))
    n_dev = plan.n_devices
    prog = plan.columns(direction)
    flows = _flow_table(plan, direction, coalesce)
    comp = stage_compute_s(plan.layout, plan.tiles, np.asarray(plan.tile_device), prog.tile_stage, cost,
                           direction, n_dev)
    t0 = _delta_s(plan, cost) if direction == "backward" else np.zeros(n_dev)
    streams = Streams(plan, prog, flows, comp, t0, cost, nic, record_events, native)
    streams.run(direction)
    comm = np.zeros(n_dev, dtype=np.int64)
    if flows["src"].size:
        comm += np.bincount(flows["src"], weights=flows["bytes"], minlength=n_dev).astype(np.int64)
        comm += np.bincount(flows["dst"], weights=flows["bytes"], minlength=n_dev).astype(np.int64)
    end = np.asarray(streams.clock, dtype=float)
    makespan = float(max(end.max(initial=0.0), streams.last_end()))
    return SimResult(makespan, end, *(np.asarray(a, dtype=float) for a in (streams.compute_s, streams.reduce_s,
                                                                              streams.wait_s)), comm,
                     ideal_time_s(plan, cost, direction), cost.profile.name, direction, plan.planner,
                     int(prog.transfers.shape[0]), int(flows["src"].size), tuple(streams.events),
                     time.perf_counter() - started)
