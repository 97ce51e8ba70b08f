"""Discrete-event simulation of a plan's forward or backward program on a modelled cluster.

Model (all times from ``CostModel``; every number it produces is *simulated*, not measured):

- **Streams.** Each device runs its instruction stream in program order on one compute stream.
  ``CommLaunch(r)`` posts round r's transfers and costs nothing on the stream. ``Compute`` occupies the
  stream for one fused kernel call over its tiles (``CostModel.fused_call_s``: one launch overhead,
  each (sequence, head block) group at the efficiency of its merged q/kv extents -- each q token
  block's for profiles with ``efficiency_group="q_block"``, the CPU kernel), so plans are not charged
  for how finely their tiles are cut. ``CommWait(r)`` blocks until every transfer of round r this
  device sends or receives has finished. ``Reduce(unit, sources)`` is one fused memory-bound merge
  kernel: it reads the local accumulator and each received partial and writes the accumulator,
  ``memory_bound_s((2 + len(sources)) * unit_bytes)``. In the backward each device first computes
  delta = rowsum(O * dO) for its home tokens: ``memory_bound_s(home_tokens * Hq * (2 * D * elem + 4))``
  (read O and dO, write fp32 delta), one op at t=0. Communication kernels do not slow compute down.
  Host-side executors (the CPU) also pay ``program_overhead_us`` once per program (before the delta)
  and ``round_overhead_us`` when they post a round they send or receive in (both 0 in GPU profiles).
- **Transfers.** Grouped point-to-point semantics: a transfer of round r starts when both its sender
  and its receiver have posted ``CommLaunch(r)``; after ``link_latency_us`` its bytes
  (``dcp.units.unit_bytes``, one head block) enter a fluid network. By default the transfers of one
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
- **Scale.** ``simulate`` reads the columnar program (``dcp.program``): every compute, merge and delta
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
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from dcp.cost import CostModel
from dcp.plan import Plan
from dcp.program import DST, HB, KIND, ROUND, SRC, TB
from dcp.sim.estimate import stage_compute_s
from dcp.units import LSE_BYTES, unit_bytes

DIRECTIONS = ("forward", "backward")
EVENT_KINDS = ("compute", "reduce", "wait", "transfer", "delta")


class SimEvent(NamedTuple):
    """One interval of the simulated timeline. Stream events (compute, reduce, wait, delta) belong to
    ``device``; a transfer event is a flow (``device`` = ``src``) from when both ends posted its round
    (``start_s``) to when its last byte arrived (``end_s``); ``units`` counts the data units it carries."""

    device: int
    kind: str
    label: str
    start_s: float
    end_s: float
    src: int = -1
    dst: int = -1
    bytes: int = 0
    round: int = -1
    units: int = 0


@dataclass(frozen=True, eq=False)
class SimResult:
    """Simulated timeline of one direction of a plan. Per-device arrays are indexed by device.

    ``end_s``: when the device's stream finished; ``compute_s``: time running tiles; ``reduce_s``: time in
    memory-bound ops (merges, and delta in the backward); ``wait_s``: time blocked in ``CommWait``;
    ``comm_bytes``: bytes sent plus received.
    """

    makespan_s: float
    end_s: np.ndarray
    compute_s: np.ndarray
    reduce_s: np.ndarray
    wait_s: np.ndarray
    comm_bytes: np.ndarray
    ideal_s: float
    profile: str
    direction: str
    planner: str
    n_transfers: int
    n_flows: int
    events: tuple[SimEvent, ...] = field(repr=False)
    sim_time_s: float = 0.0

    @property
    def n_devices(self) -> int:
        return int(self.end_s.size)

    @property
    def efficiency(self) -> float:
        """ideal / makespan (1.0: perfectly balanced, fully hidden communication, large tiles)."""
        return self.ideal_s / self.makespan_s if self.makespan_s > 0 else 1.0

    def summary(self) -> str:
        ms = 1e3
        wait_mean = float(self.wait_s.mean()) if self.wait_s.size else 0.0
        return (f"simulated ({self.profile}) {self.direction} {self.planner}: makespan {self.makespan_s * ms:.3f} ms, "
                f"ideal {self.ideal_s * ms:.3f} ms ({100 * self.efficiency:.1f}% of ideal), "
                f"compute max {self.compute_s.max(initial=0) * ms:.3f} ms, "
                f"wait max {self.wait_s.max(initial=0) * ms:.3f} / mean {wait_mean * ms:.3f} ms, "
                f"comm {self.comm_bytes.sum() / 2 / 1e9:.3f} GB in {self.n_flows} flows, {self.n_devices} devices")

    def to_dict(self) -> dict:
        """Plain numbers (no events) for JSON reports."""
        return {"makespan_s": self.makespan_s, "ideal_s": self.ideal_s, "efficiency": self.efficiency,
                "profile": self.profile, "direction": self.direction, "planner": self.planner,
                "simulated": True, "end_s": self.end_s.tolist(), "compute_s": self.compute_s.tolist(),
                "reduce_s": self.reduce_s.tolist(), "wait_s": self.wait_s.tolist(),
                "comm_bytes": self.comm_bytes.tolist(), "n_transfers": self.n_transfers, "n_flows": self.n_flows}


def iteration_time_s(fwd: SimResult, bwd: SimResult) -> float:
    """Simulated attention time of one training iteration: forward makespan + backward makespan."""
    return fwd.makespan_s + bwd.makespan_s


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


def _resources(src: int, dst: int, gpn: int, n_dev: int, n_nics: int, per_nic: int) -> tuple[int, ...]:
    """Resource ids: [0, n) GPU egress, [n, 2n) GPU ingress, then the ``n_nics`` NICs' egress and ingress;
    device d reaches NIC ``d // per_nic`` (``CostModel.nic_layout``: a NIC never spans two nodes)."""
    if src // gpn == dst // gpn:
        return (src, n_dev + dst)
    return (src, n_dev + dst, 2 * n_dev + src // per_nic, 2 * n_dev + n_nics + dst // per_nic)


def _resource_table(src: np.ndarray, dst: np.ndarray, gpn: int, n_dev: int, n_nics: int, per_nic: int) -> np.ndarray:
    """``_resources`` of many flows at once: int64 ``[n_flows, 4]``, rows padded with -1 (within a node)."""
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    res = np.stack([src, n_dev + dst, 2 * n_dev + src // per_nic, 2 * n_dev + n_nics + dst // per_nic], axis=1)
    res[src // gpn == dst // gpn, 2:] = -1
    return res


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
    (``dcp.validate_arrays.check_columns``: a device, block or round out of range). The canonical streams
    always finish (``dcp.program``), so an unvalidated plan simulates too; it may compute nonsense.
    ``native``: the event loop in C++ (``dcp._C.simulate_streams``, same results) -- None: when built and
    ``record_events`` is False; True: required (unless recording events); False: the Python loop.
    """
    from dcp.sim.streams import Streams
    from dcp.validate_arrays import Problems, check_columns

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
