"""What a plan achieves: communication, balance, idle devices. Pure functions of the plan."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from dcp.ir.program import DST, KIND, ROUND, SRC, TB
from dcp.layout.units import unit_bytes

if TYPE_CHECKING:
    from dcp.ir.plan import Plan


@dataclass(frozen=True)
class PlanStats:
    """Bytes count both directions (forward + backward) unless the name says otherwise.

    ``max_device_comm_bytes``: the largest bytes sent plus received by one device;
    ``compute_imbalance``: max / mean of forward tile FLOPs per device (backward FLOPs are 2.5× per tile,
    the same ratio); ``memory_imbalance``: max / mean resident (home) tokens per device; ``warnings``:
    what a user should know before running the plan (e.g. idle devices). Memory (``dcp.ir.memory``):
    ``max_resident_tokens``/``mean_resident_tokens``: home tokens per device; ``peak_transient_bytes_<dir>``:
    the largest over devices of a direction's peak transient buffer bytes (received inputs, accumulators
    of units homed elsewhere, received partials); the ``*_per_device`` tuples hold every device's value.
    ``split_sequences``: sequences whose tokens live on more than one device.
    """

    planner: str
    n_devices: int
    n_tiles: int
    n_token_blocks: int
    planning_time_s: float
    comm_bytes_total: int
    comm_bytes_inter_node: int
    comm_bytes_forward: int
    comm_bytes_backward: int
    max_device_comm_bytes: int
    compute_imbalance: float
    memory_imbalance: float
    idle_devices: int
    rounds_forward: int
    valid: bool
    warnings: tuple[str, ...] = ()
    max_resident_tokens: int = 0
    mean_resident_tokens: float = 0.0
    peak_transient_bytes_forward: int = 0
    peak_transient_bytes_backward: int = 0
    resident_tokens_per_device: tuple[int, ...] = ()
    peak_transient_per_device_forward: tuple[int, ...] = ()
    peak_transient_per_device_backward: tuple[int, ...] = ()
    split_sequences: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def transfer_table(plan: Plan, direction: str) -> np.ndarray:
    """int64 ``[n, 4]`` rows (src, dst, round, bytes) of every transfer of a direction."""
    tr = plan.columns(direction).transfers.astype(np.int64)
    nbytes = unit_bytes(plan.spec, plan.layout, tr[:, KIND], tr[:, TB])
    return np.stack([tr[:, SRC], tr[:, DST], tr[:, ROUND], nbytes], axis=1)


def plan_stats(plan: Plan) -> PlanStats:
    from dcp.errors import PlanValidationError
    from dcp.ir.memory import memory_report
    from dcp.ir.validate import validate

    n = plan.n_devices
    gpn = plan.cluster.gpus_per_node
    per_dev = np.zeros(n)
    totals, inter = {}, 0
    rounds_fwd = 0
    for direction in ("forward", "backward"):
        t = transfer_table(plan, direction)
        totals[direction] = int(t[:, 3].sum())
        inter += int(t[:, 3][t[:, 0] // gpn != t[:, 1] // gpn].sum())
        per_dev += np.bincount(t[:, 0], weights=t[:, 3], minlength=n) + np.bincount(t[:, 1], weights=t[:, 3], minlength=n)
        if direction == "forward" and t.size:
            rounds_fwd = int(t[:, 2].max())
    flops = np.bincount(plan.tile_device, weights=plan.tiles.fwd_flops, minlength=n)
    mem = memory_report(plan)
    res, peak_f, peak_b = (mem[k] for k in ("resident_tokens", "peak_transient_bytes_forward",
                                             "peak_transient_bytes_backward"))
    tokens = res.astype(float)
    valid = plan.meta.get("valid")
    if valid is None:
        try:
            validate(plan)
            valid = True
        except PlanValidationError:
            valid = False
    idle = int(((flops == 0) & (tokens == 0)).sum())
    # sequences whose token blocks live on more than one device (a plan with none moves data only for
    # sequences that a tile elsewhere reads whole; distributed tests check that plans really split)
    lay, home = plan.layout, plan.home.astype(np.int64)
    if lay.grouped:  # a block groups pieces of several sequences: a piece lives where its block does
        lay, home = lay.pieces, home[lay.piece_block]
    seq_home = np.unique(np.c_[lay.tb_seq.astype(np.int64), home], axis=0)
    split = int((np.bincount(seq_home[:, 0], minlength=plan.spec.num_seqs) > 1).sum())
    notes = []
    if idle:
        notes.append(f"{idle} of {n} devices are idle (no token and no tile): the batch holds only "
                     f"{plan.layout.n_token_blocks} token blocks (at most {int(plan.layout.tb_len.max())} tokens "
                     f"each) for {n} devices, so the busy ones carry {flops.max() / flops.mean():.1f}x the mean "
                     f"compute; use smaller blocks (block_size), fewer devices, or a bigger batch")
    return PlanStats(
        planner=plan.planner, n_devices=n, n_tiles=plan.tiles.n_tiles, n_token_blocks=plan.layout.n_token_blocks,
        planning_time_s=float(plan.planning_time_s), comm_bytes_total=totals["forward"] + totals["backward"],
        comm_bytes_inter_node=inter, comm_bytes_forward=totals["forward"], comm_bytes_backward=totals["backward"],
        max_device_comm_bytes=int(per_dev.max()) if n else 0,
        compute_imbalance=float(flops.max() / flops.mean()) if flops.sum() > 0 else 1.0,
        memory_imbalance=float(tokens.max() / tokens.mean()) if tokens.sum() > 0 else 1.0,
        idle_devices=idle, rounds_forward=rounds_fwd, valid=bool(valid), warnings=tuple(notes),
        max_resident_tokens=int(res.max(initial=0)), mean_resident_tokens=float(res.mean()) if n else 0.0,
        peak_transient_bytes_forward=int(peak_f.max(initial=0)), peak_transient_bytes_backward=int(peak_b.max(initial=0)),
        resident_tokens_per_device=tuple(res.tolist()), peak_transient_per_device_forward=tuple(peak_f.tolist()),
        peak_transient_per_device_backward=tuple(peak_b.tolist()), split_sequences=split)
