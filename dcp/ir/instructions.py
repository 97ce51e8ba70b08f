"""The instruction view of a plan (``Plan.program(direction)``): frozen objects, one per instruction and
transfer, built from the columnar programs for readers and tests (see ``dcp.ir.plan`` for their meaning)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union

from dcp.layout.units import Kind


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
