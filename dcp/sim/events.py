"""What the simulator returns: timeline events and per-direction results, and the network resources a
transfer occupies (shared by the simulator, its stream engine and the reference simulator)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

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
