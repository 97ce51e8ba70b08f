"""Candidate plans and how the planner scores them.

A *candidate* is a placement (a block layout, the home of every token block, the device of every tile)
with one schedule per direction. ``evaluate`` schedules a placement at every stage count it is given,
estimates each schedule's makespan with ``dcp.cost.estimate`` (the simulator's program and cost rules,
vectorized; milliseconds), and keeps the fastest per direction, so the planner can compare many
balance/communication trade-offs for about the cost of one hypergraph partition.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dcp.cluster import Cluster
from dcp.cost import CostModel
from dcp.cost.estimate import estimate_device_ends_s
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.layout.units import Kind, bytes_per_token
from dcp.schedule.stages import Schedule, schedule
from dcp.spec import BatchSpec

_OUT_KINDS = {"forward": (Kind.O, None), "backward": (Kind.DQ, Kind.DKV)}
_IN_KINDS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}


@dataclass(frozen=True, eq=False)
class Candidate:
    """A placement with its best schedule per direction and what they are estimated to cost."""

    label: str
    layout: BlockLayout
    tiles: TileSet
    home: np.ndarray
    tile_device: np.ndarray
    forward: Schedule
    backward: Schedule
    forward_s: float
    backward_s: float
    comm_bytes: int
    compute_imbalance: float
    stages: tuple[int, int]
    notes: tuple[str, ...] = ()
    forward_ends: np.ndarray | None = None
    backward_ends: np.ndarray | None = None
    max_tokens: int = 0
    #: per direction, the schedules of this placement estimated within ``POLISH_WITHIN`` of its best (at most
    #: ``POLISH_TOP``, fastest first): ``((estimate s, stage count, Schedule, device ends), ...)``, for the
    #: final choice's per-direction simulation (``dcp.planner.polish``)
    alternatives: tuple = ((), ())

    @property
    def time_s(self) -> float:
        """Estimated forward + backward makespan (seconds)."""
        return self.forward_s + self.backward_s

    def summary(self) -> dict:
        return {"forward_ms": round(self.forward_s * 1e3, 4), "backward_ms": round(self.backward_s * 1e3, 4),
                "comm_bytes": int(self.comm_bytes), "compute_imbalance": round(self.compute_imbalance, 4),
                "max_tokens": int(self.max_tokens), "stages": list(self.stages)}

    def step_s(self, token_time_s: float) -> float:
        """Estimated attention time plus the non-attention work of the device with the most tokens."""
        return self.time_s + token_time_s * self.max_tokens


def tile_times(cost: CostModel, layout: BlockLayout, tiles: TileSet, direction: str) -> np.ndarray:
    """Modelled seconds of every tile alone in ``direction`` (orders stages and transfers;
    ``CostModel.tile_alone_s``)."""
    return cost.tile_alone_s(layout, tiles, direction)


def sequence_times(cost: CostModel, layout: BlockLayout, tiles: TileSet, n_seqs: int) -> np.ndarray:
    """Modelled forward + backward attention seconds of every sequence run whole, each direction in one
    fused call (no launch cost)."""
    seq = layout.tb_seq[tiles.q_tb].astype(np.int64)
    total = np.zeros(n_seqs)
    for flops, backward in ((tiles.fwd_flops, False), (tiles.bwd_flops, True)):
        t = cost.fused_calls_s(flops, tiles.full, tiles.q_tb, tiles.kv_tb, cost.tile_groups(layout, tiles),
                               layout.tb_len, seq, n_seqs, backward=backward, unmasked=tiles.unmasked)
        total += np.maximum(t - cost.profile.kernel_overhead_us * 1e-6, 0.0)
    return total


def schedule_bytes(spec: BatchSpec, layout: BlockLayout, sched: Schedule) -> int:
    """Bytes every transfer of the schedule moves (inputs and partial outputs), as ``plan.stats()``."""
    bpt = bytes_per_token(spec, layout)
    total = 0
    for rows, kinds in ((sched.routes.inputs, _IN_KINDS[sched.direction]),
                        (sched.routes.outputs, _OUT_KINDS[sched.direction])):
        for side in (0, 1):
            if kinds[side] is None or rows.size == 0:
                continue
            sel = rows[:, 0] == side
            total += int(bpt[kinds[side]] * layout.tb_len[rows[sel, 1]].astype(np.int64).sum())
    return total


def evaluate(label: str, spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet, home: np.ndarray,
             tile_device: np.ndarray, cost: CostModel, stage_counts: tuple[int, ...], two_phase: bool,
             notes: tuple[str, ...] = (), per_direction: tuple[int, int] | None = None,
             own: tuple = ()) -> Candidate:
    """Schedule a placement at each stage count, per direction keep the one estimated fastest
    (``per_direction``: one given stage count for the forward and one for the backward instead).
    ``own``: schedules the placement came with (a static plan's, each with ``tile_stage`` and ``routes``, e.g.
    its ``StaticParts`` and their ``schedule_variants``; stage count 0, -1, -2, ... in that order) that compete
    with dcp's, per direction."""
    home = np.asarray(home, dtype=np.int64)
    tile_device = np.asarray(tile_device, dtype=np.int64)
    best, seen = {}, {"forward": [], "backward": []}
    for i, direction in enumerate(("forward", "backward")):
        tt = tile_times(cost, layout, tiles, direction)
        counts = stage_counts if per_direction is None else (per_direction[i],)
        for s in tuple(-j for j in range(len(own))) + tuple(c for c in counts if c > 0):
            if s <= 0:
                sched = Schedule(direction, own[-s].tile_stage, own[-s].routes)
            else:
                sched = schedule(spec, cluster, layout, tiles, home, tile_device, tt, cost, direction, s, two_phase)
            ends = estimate_device_ends_s(spec, cluster, layout, tiles, home, tile_device, sched, cost)
            est = float(ends.max(initial=0.0))
            seen[direction].append((est, s, sched, ends))
            if direction not in best or est < best[direction][0]:
                best[direction] = (est, s, sched, ends)
    flops = np.bincount(tile_device, weights=tiles.fwd_flops, minlength=cluster.n_devices)
    imbalance = float(flops.max() / flops.mean()) if flops.sum() > 0 else 1.0
    fwd, bwd = best["forward"], best["backward"]
    comm = schedule_bytes(spec, layout, fwd[2]) + schedule_bytes(spec, layout, bwd[2])
    tokens = np.bincount(home, weights=layout.tb_len, minlength=cluster.n_devices)
    return Candidate(label, layout, tiles, home, tile_device, fwd[2], bwd[2], fwd[0], bwd[0], comm, imbalance,
                     (fwd[1], bwd[1]), tuple(notes), fwd[3], bwd[3], int(tokens.max()),
                     (close_alternatives(seen["forward"]), close_alternatives(seen["backward"])))


#: a direction's schedules estimated within this of its fastest, at most ``POLISH_TOP`` of them, are kept as
#: alternatives and simulated for the final choice (``dcp.planner.polish``): the estimate's error against the
#: simulator is a few per cent, and it ranks a placement's own schedules (e.g. Magi's overlap degrees) and
#: dcp's stage counts differently from the simulator about as often as not within that band
POLISH_WITHIN = 0.03
POLISH_TOP = 3


def close_alternatives(seen) -> tuple:
    """The ``(estimate s, stage count, Schedule, ends)`` of ``seen`` within ``POLISH_WITHIN`` of the fastest,
    at most ``POLISH_TOP``, fastest first (one per stage count; ties keep the earlier)."""
    by_count: dict = {}
    for alt in seen:
        if alt[1] not in by_count or alt[0] < by_count[alt[1]][0]:
            by_count[alt[1]] = alt
    ranked = sorted(by_count.values(), key=lambda a: a[0])
    if not ranked:
        return ()
    limit = ranked[0][0] * (1 + POLISH_WITHIN)
    return tuple(a for a in ranked if a[0] <= limit)[:POLISH_TOP]


def widen(cand: Candidate, spec: BatchSpec, cluster: Cluster, cost: CostModel, stage_counts: tuple[int, ...],
          two_phase: bool) -> Candidate:
    """``cand`` with each direction's schedule the fastest over ``stage_counts`` and its own."""
    more = tuple(s for s in stage_counts if s not in cand.stages)
    if not more:
        return cand
    other = evaluate(cand.label, spec, cluster, cand.layout, cand.tiles, cand.home, cand.tile_device, cost, more,
                     two_phase, cand.notes)
    fwd = cand if cand.forward_s <= other.forward_s else other
    bwd = cand if cand.backward_s <= other.backward_s else other
    comm = schedule_bytes(spec, cand.layout, fwd.forward) + schedule_bytes(spec, cand.layout, bwd.backward)
    alts = tuple(close_alternatives(a + b) for a, b in zip(cand.alternatives, other.alternatives))
    return dataclasses.replace(cand, forward=fwd.forward, forward_s=fwd.forward_s, forward_ends=fwd.forward_ends,
                               backward=bwd.backward, backward_s=bwd.backward_s, backward_ends=bwd.backward_ends,
                               stages=(fwd.stages[0], bwd.stages[1]), comm_bytes=comm, alternatives=alts)


def same_placement(a: Candidate, layout: BlockLayout, home: np.ndarray) -> bool:
    """Whether a packing gave the same layout and homes as candidate ``a`` (skip re-evaluating it)."""
    return (a.layout.tb_len.size == layout.tb_len.size and np.array_equal(a.layout.tb_start, layout.tb_start)
            and np.array_equal(a.home, home))


def same_plan(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates are one plan: the same blocks, homes and tile devices, and the same chosen
    schedule in each direction. Two warm starts can reach one plan by different settings (Magi at
    1024-token chunks and at 4 chunks per rank, LDC x2 causal, H100): the second must not take a place
    among the simulated or polished few (``dcp.planner.budget.pick``, ``DCPPlanner._polish_finalists``)."""
    if a is b:
        return True
    if (a.forward_s, a.backward_s) != (b.forward_s, b.backward_s):  # one plan, one estimate: a cheap filter
        return False
    if not (same_placement(a, b.layout, b.home) and a.layout.n_head_blocks == b.layout.n_head_blocks
            and a.tile_device.shape == b.tile_device.shape and np.array_equal(a.tile_device, b.tile_device)):
        return False
    return all(x.tile_stage.shape == y.tile_stage.shape and np.array_equal(x.tile_stage, y.tile_stage)
               and _same_rows(x.routes.inputs, y.routes.inputs) and _same_rows(x.routes.outputs, y.routes.outputs)
               for x, y in ((a.forward, b.forward), (a.backward, b.backward)))


def _same_rows(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and np.array_equal(x, y)
