"""The plan: a batch, its blocks and tiles, their placement, and a forward and a backward ``Program``.

Each program is columnar (``dcp.ir.program``: tile stages, transfer rows, merge rows). Per device it reads
as an ordered instruction stream; ``Plan.program(direction)`` builds that view, from these frozen
instruction objects, for readers and tests (executors, the validator and the simulator read the tables):
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

import numpy as np

from dcp.cluster import Cluster
from dcp.ir.instructions import DevicePlan
from dcp.ir.program import Program, device_plans
from dcp.ir.serialize import plan_fields_from_bytes, plan_to_bytes
from dcp.ir.stats import plan_stats
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.spec import BatchSpec


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything an executor needs: the batch, its blocks and tiles, placement, and both programs.

    ``home``: int32 ``[n_token_blocks]``, the device holding each token block (its tokens' q/k/v/o and
    gradients); ``tile_device``: int32 ``[n_tiles]``, where each tile runs (both directions);
    ``forward``/``backward``: the columnar programs (``dcp.ir.program.Program``), each with its own tile
    stages, transfers and merges. ``planning_time_s`` is the wall-clock time of the call that made it;
    it is not part of the plan's bytes (``to_bytes``), which depend on the inputs alone.
    """

    spec: BatchSpec
    cluster: Cluster
    layout: BlockLayout
    tiles: TileSet
    home: np.ndarray
    tile_device: np.ndarray
    forward: Program
    backward: Program
    planner: str
    planning_time_s: float = 0.0
    notes: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n_devices(self) -> int:
        return self.cluster.n_devices

    def _contiguous(self) -> tuple[BlockLayout, np.ndarray]:
        """(ordinary layout, home per block): a grouped layout's pieces with their blocks' homes."""
        lay = self.layout
        if lay.grouped:
            return lay.pieces, self.home[lay.piece_block]
        return lay, self.home

    def token_device(self) -> np.ndarray:
        """int32 ``[total_tokens]``: the home device of every token of the packed batch."""
        lay, home = self._contiguous()
        return np.repeat(home, lay.tb_len).astype(np.int32)

    def local_blocks(self, device: int) -> np.ndarray:
        """Token blocks homed on ``device``, in the order their rows are stacked locally."""
        return np.flatnonzero(self.home == device)

    def local_token_index(self, device: int) -> np.ndarray:
        """int64 rows of the packed batch that ``device`` holds, in local order (increasing rows: its
        blocks in order; a grouped layout's pieces in order)."""
        lay, home = self._contiguous()
        blocks = np.flatnonzero(home == device)
        if blocks.size == 0:
            return np.zeros(0, dtype=np.int64)
        starts, lens = lay.tb_start[blocks], lay.tb_len[blocks]
        offs = np.repeat(starts - np.r_[0, np.cumsum(lens)[:-1]], lens)
        return offs + np.arange(int(lens.sum()))

    @property
    def tile_stage(self) -> np.ndarray:
        """int32 ``[n_tiles]``: the forward compute stage of every tile (``forward.tile_stage``)."""
        return self.forward.tile_stage

    def columns(self, direction: str) -> Program:
        """The columnar program of ``direction`` ("forward" or "backward")."""
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def index(self, direction: str):
        """Per-device index ranges of a direction's program (``dcp.ir.program.DeviceIndex``, cached)."""
        return self.columns(direction).index(self.tile_device, self.n_devices)

    def program(self, direction: str) -> tuple[DevicePlan, ...]:
        """The instruction view of a direction: one ``DevicePlan`` per device (built once, then cached;
        one Python object per instruction and transfer, so meant for reading and tests, not for scale)."""
        prog = self.columns(direction)
        got = self._views.get(direction)
        if got is None or got[0] is not prog:
            got = self._views[direction] = (prog, device_plans(prog, self.tile_device, self.n_devices))
        return got[1]

    def stats(self):
        """``dcp.ir.stats.PlanStats``: bytes moved, balance, memory, validity."""
        return plan_stats(self)

    def to_bytes(self, compress: bool | None = None) -> bytes:
        """Serialized plan (``dcp.ir.serialize``); ``compress``: zlib-wrapped (None: when large)."""
        return plan_to_bytes(self, compress)

    @staticmethod
    def from_bytes(data: bytes) -> "Plan":
        """The plan ``to_bytes`` wrote (``SerializationError`` for anything else)."""
        return Plan(**plan_fields_from_bytes(data))

    def __repr__(self) -> str:
        return (f"Plan(planner={self.planner!r}, devices={self.n_devices}, seqs={self.spec.num_seqs}, "
                f"tokens={self.spec.total_tokens}, token_blocks={self.layout.n_token_blocks}, "
                f"tiles={self.tiles.n_tiles})")
