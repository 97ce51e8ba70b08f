"""The final choice's schedules, per direction, by simulation.

The search ranks whole candidates (a placement with its estimated-fastest schedule per direction) and
simulates the fastest few (``dcp.planner.budget.pick``). The estimate's error against the simulator is a
few per cent, so within a placement it can also pick the wrong one of two close schedules: a static
planner's own overlap degree against another, or dcp's stage count against the static plan's own schedule
— and then dcp loses to the very plan it started from (Magi at 6 chunks per rank, degree 4, LDC x1 causal,
A100: its own backward simulates 2.5 % faster than the schedule estimated 0.1 % faster). ``polish`` runs
the chosen placement's close alternatives (``Candidate.alternatives``: within ``POLISH_WITHIN`` of each
direction's best estimate, over every candidate of that placement, e.g. a warm start and its "/staged"
version) through the simulator, one direction at a time (a direction's time depends on its own program
only), and keeps per direction the fastest simulated schedule — so the plan is never slower, by the
simulator, than any of those schedules of its placement. The result keeps the memory budget: when the
combination's transient buffers exceed it, the choice stands.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dcp.planner.budget import MemoryBudget, plan_transient
from dcp.planner.candidates import Candidate, close_alternatives, schedule_bytes

DIRECTIONS = ("forward", "backward")


def placement_alternatives(best: Candidate, cands: list[Candidate]) -> tuple[tuple, tuple]:
    """Per direction, the close alternatives (``close_alternatives``) of every candidate with ``best``'s
    placement (its layout object, homes and tile devices), the current schedule included."""
    same = [c for c in cands if c.layout is best.layout and np.array_equal(c.home, best.home)
            and np.array_equal(c.tile_device, best.tile_device)]
    if not any(c is best for c in same):
        same.append(best)
    out = []
    for i, direction in enumerate(DIRECTIONS):
        current = (getattr(best, f"{direction}_s"), best.stages[i], getattr(best, direction),
                   getattr(best, f"{direction}_ends"))
        pool = [current] + [a for c in same for a in c.alternatives[i]]
        alts = close_alternatives(pool)
        if not any(a[1] == best.stages[i] for a in alts):  # the current schedule always competes
            alts = (current,) + alts[:-1] if alts else (current,)
        out.append(alts)
    return out[0], out[1]


def polish(best: Candidate, cands: list[Candidate], spec, cluster, cost, budget: MemoryBudget) -> Candidate:
    """``best`` with each direction's schedule the fastest simulated among its placement's close
    alternatives (``placement_alternatives``); ``best`` itself when it has none other in either direction,
    when none simulates faster, or when the faster combination exceeds the transient budget. A changed
    candidate is labelled ``<label>/sim``."""
    from dcp.ir.plan import Plan
    from dcp.schedule.build import build_program
    from dcp.sim import simulate

    alts = placement_alternatives(best, cands)
    if all(len(a) < 2 for a in alts):
        return best
    home32 = np.asarray(best.home, dtype=np.int32)
    device32 = np.asarray(best.tile_device, dtype=np.int32)
    programs = {(d, a[1]): None for d, per in zip(DIRECTIONS, alts) for a in per}

    def program(direction, alt):
        key = (direction, alt[1])
        if programs[key] is None:
            programs[key] = build_program(direction, alt[2].tile_stage, alt[2].routes)
        return programs[key]

    def plan_of(fwd_alt, bwd_alt):
        return Plan(spec, cluster, best.layout, best.tiles, home32, device32, program("forward", fwd_alt),
                    program("backward", bwd_alt), "candidate", 0.0, ())

    current = {d: next(a for a in per if a[1] == best.stages[i]) for i, (d, per) in enumerate(zip(DIRECTIONS, alts))}
    chosen, gained = {}, False
    for i, direction in enumerate(DIRECTIONS):
        timed = []
        for alt in alts[i]:
            pair = (alt, current["backward"]) if direction == "forward" else (current["forward"], alt)
            timed.append((simulate(plan_of(*pair), cost, direction, record_events=False).makespan_s,
                          alt[1] != best.stages[i], alt))
        t, changed, alt = min(timed, key=lambda x: x[:2])  # ties keep the current schedule
        chosen[direction] = alt
        gained |= changed
    if not gained:
        return best
    fwd, bwd = chosen["forward"], chosen["backward"]
    if budget.transient_bytes is not None:
        peak = int(plan_transient(plan_of(fwd, bwd)).max(initial=0))
        if peak > budget.transient_bytes * (1 + 1e-9):
            return best
    comm = schedule_bytes(spec, best.layout, fwd[2]) + schedule_bytes(spec, best.layout, bwd[2])
    return dataclasses.replace(best, label=best.label + "/sim", forward=fwd[2], forward_s=fwd[0], forward_ends=fwd[3],
                               backward=bwd[2], backward_s=bwd[0], backward_ends=bwd[3], stages=(fwd[1], bwd[1]),
                               comm_bytes=comm, alternatives=alts)
