"""The plan IR: per device, an ordered instruction stream for the forward and for the backward pass.

Instructions (all frozen):
- ``CommLaunch(round, sends, recvs)``: post this round's transfers as one group (every device posts
  every round, possibly empty, so grouped p2p always matches);
- ``CommWait(round)``: block until this device's transfers of that round are done;
- ``Compute(stage, tiles)``: run attention (or its backward) for these tiles; each tile adds to the
  device's partial accumulator of its output unit(s);
- ``Reduce(unit, sources)``: merge partials of ``unit`` received from ``sources`` into the local
  accumulator (LSE merge for O, sums for dQ/dKV). A partial sent onwards is the merged one, so
  reduction trees (two-phase, rings) are expressible; the home's accumulator is the final output.
A ``Transfer(unit, peer)`` inside a launch sends (or receives) one data unit ``(kind, token block, head
block)``. An input may be relayed: a device may send an input it received in an earlier round.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Union

import numpy as np

from dcp.blocks import BlockLayout, TileSet
from dcp.cluster import Cluster
from dcp.spec import BatchSpec
from dcp.units import Kind


class Unit(NamedTuple):
    kind: Kind
    tb: int
    hb: int


class Transfer(NamedTuple):
    unit: Unit
    peer: int


@dataclass(frozen=True)
class CommLaunch:
    round: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


@dataclass(frozen=True)
class CommWait:
    round: int


@dataclass(frozen=True)
class Compute:
    stage: int
    tiles: tuple[int, ...]


@dataclass(frozen=True)
class Reduce:
    unit: Unit
    sources: tuple[int, ...]


Instruction = Union[CommLaunch, CommWait, Compute, Reduce]


@dataclass(frozen=True)
class DevicePlan:
    device: int
    instructions: tuple[Instruction, ...]

    def __str__(self) -> str:
        lines = [f"device {self.device}:"]
        for ins in self.instructions:
            if isinstance(ins, CommLaunch):
                lines.append(f"  launch r{ins.round}: send {len(ins.sends)}, recv {len(ins.recvs)}")
            elif isinstance(ins, CommWait):
                lines.append(f"  wait r{ins.round}")
            elif isinstance(ins, Compute):
                lines.append(f"  compute s{ins.stage}: {len(ins.tiles)} tiles")
            else:
                lines.append(f"  reduce {ins.unit.kind.name}[{ins.unit.tb},{ins.unit.hb}] <- {list(ins.sources)}")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything an executor needs: the batch, its blocks and tiles, placement, and both programs.

    ``home[tb]``: device holding token block ``tb`` (its tokens' q/k/v/o and gradients);
    ``tile_device[t]``/``tile_stage[t]``: where and in which compute stage of the forward tile ``t`` runs
    (the backward program may stage its tiles differently: its ``Compute`` instructions say how).
    """

    spec: BatchSpec
    cluster: Cluster
    layout: BlockLayout
    tiles: TileSet
    home: np.ndarray
    tile_device: np.ndarray
    tile_stage: np.ndarray
    forward: tuple[DevicePlan, ...]
    backward: tuple[DevicePlan, ...]
    planner: str
    planning_time_s: float = 0.0
    notes: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)

    @property
    def n_devices(self) -> int:
        return self.cluster.n_devices

    def token_device(self) -> np.ndarray:
        """int32 ``[total_tokens]``: the home device of every token of the packed batch."""
        return np.repeat(self.home, self.layout.tb_len).astype(np.int32)

    def local_blocks(self, device: int) -> np.ndarray:
        """Token blocks homed on ``device``, in the order their rows are stacked locally."""
        return np.flatnonzero(self.home == device)

    def local_token_index(self, device: int) -> np.ndarray:
        """int64 rows of the packed batch that ``device`` holds, in local order."""
        blocks = self.local_blocks(device)
        if blocks.size == 0:
            return np.zeros(0, dtype=np.int64)
        starts, lens = self.layout.tb_start[blocks], self.layout.tb_len[blocks]
        offs = np.repeat(starts - np.r_[0, np.cumsum(lens)[:-1]], lens)
        return offs + np.arange(int(lens.sum()))

    def program(self, direction: str) -> tuple[DevicePlan, ...]:
        return self.forward if direction == "forward" else self.backward

    def stats(self):
        from dcp.stats import plan_stats

        return plan_stats(self)

    def to_bytes(self) -> bytes:
        from dcp.serialize import plan_to_bytes

        return plan_to_bytes(self)

    @staticmethod
    def from_bytes(data: bytes) -> "Plan":
        from dcp.serialize import plan_from_bytes

        return plan_from_bytes(data)

    def __repr__(self) -> str:
        return (f"Plan(planner={self.planner!r}, devices={self.n_devices}, seqs={self.spec.num_seqs}, "
                f"tokens={self.spec.total_tokens}, token_blocks={self.layout.n_token_blocks}, "
                f"tiles={self.tiles.n_tiles})")
