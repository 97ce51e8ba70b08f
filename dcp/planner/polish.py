"""The final choice's schedules, per direction, by simulation.

The search ranks whole candidates (a placement with its estimated-fastest schedule per direction) and
simulates the fastest few (``dcp.planner.budget.pick``). The estimate's error against the simulator is a
few per cent, so within a placement it can also pick the wrong one of two close schedules: a static
planner's own overlap degree against another, or dcp's stage count against the static plan's own schedule
— and then dcp loses to the very plan it started from (Magi at 6 chunks per rank, degree 4, LDC x1 causal,
A100: its own backward simulates 2.5 % faster than the schedule estimated 0.1 % faster). ``polish`` runs
the chosen placement's close alternatives (``Candidate.alternatives``: within ``POLISH_WITHIN`` of each
direction's best estimate, over every candidate of that placement, e.g. a warm start and its "/staged"
version, and the schedule each of those candidates holds; one schedule simulated once) through the
simulator, one direction at a time (a direction's time depends on its own program only), and keeps per
direction the fastest simulated schedule — so the plan is never slower, by the simulator, than any of those
schedules of its placement. The result keeps the memory budget: the fastest
pair of schedules (of the ``POLISH_PAIRS`` fastest per direction) whose transient buffers fit it wins; when
none does before the current pair, the choice stands.

The placement's *direct* schedules compete too (``direct_schedule``): every input straight from its home
and every partial straight home, the remote work in ``degree`` groups that each hide behind the previous
stage -- the schedule Magi runs its own placements with (``dcp.baselines.magi.staged_schedule``), applied
to any placement, at each degree of ``DIRECT_DEGREES``, with the remote blocks grouped in token order or
ring-shifted (``DIRECT_ORDERS``) and, on several nodes, also with a unit entering a remote node once. dcp's
round builder (``dcp.schedule.stages``) relays units inside a node to save NIC bytes, at the price of a
round and a relay's busy egress; where a placement's transfers are few and large (a packing's backward,
whose dKV partials all leave after its last stage) straight transfers in fewer, longer stages are faster.
In the backward each direct schedule, and each of the placement's own, also competes with its *tail*
variant (``hold_back_local``, ``tail_alternatives``): a device whose tiles send partials home keeps
``TAIL_LOCAL_SHARE`` of its local work (tiles whose inputs are all home) for a stage after its last remote
one, so the partials' trip home -- and the home's wait for them -- hides behind that work instead of ending
the backward (dcp's own stages keep about one stage's share of local work for their last stage,
``dcp.schedule.stages``); the rest of the local work still covers the first inputs' arrival.
They are simulated only for the chosen placement and the next few simulated finalists (``fastest_polished``,
``DCPPlanner._polish_finalists``): estimating them for every widened candidate instead doubled the
planning time for about a per cent in the micro grid's geomean.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dcp.planner.budget import MemoryBudget, plan_transient
from dcp.planner.candidates import Candidate, close_alternatives, schedule_bytes

DIRECTIONS = ("forward", "backward")
#: overlap degrees of the direct schedules (Magi's own: ``dcp.baselines.magi.VARIANT_DEGREES``)
DIRECT_DEGREES = (1, 2, 3, 4)
#: direct schedules estimated more than this above a direction's fastest estimate are not simulated
DIRECT_WITHIN = 0.1
#: per direction, the fastest simulated schedules whose pairs are checked against the transient budget
POLISH_PAIRS = 3
#: the orders in which a device's remote KV blocks are cut into overlap groups: "direct", in token order (as
#: Magi groups them); "shifted", by the ring distance from the device to the block's home first, so that in
#: each round the devices read from different homes (the shifted all-to-all: no home serves many at once)
DIRECT_ORDERS = ("direct", "shifted")
#: the share of a device's local backward work (by FLOPs, largest tiles first) a tail variant holds back for
#: after its last remote stage (``hold_back_local``; dcp-only micro grid: 0.5 made 73 A100 and 63 H100 batches
#: faster, none slower; 0.3 and 0.7 were each slower than 0.5 in about half the batches)
TAIL_LOCAL_SHARE = 0.5
#: how many of the simulated finalists other than the choice get their schedules re-chosen by simulation too
#: (the fastest as simulated first), those within ``POLISH_FINALISTS_WITHIN`` of the polished choice
#: (``DCPPlanner._polish_finalists``; a layered plan polishes fewer: ``dcp.planner.layered``)
POLISH_FINALISTS = 3
POLISH_FINALISTS_WITHIN = 0.1


def direct_schedule(cand: Candidate, cluster, degree: int, hierarchical: bool, order: str = "direct"):
    """(tile stage, routes) of ``cand``'s placement under the direct schedule at ``degree`` (module
    docstring) with its remote KV grouped in ``order`` (``DIRECT_ORDERS``); ``hierarchical``: a unit enters a
    remote node once and is relayed inside it."""
    from dcp.baselines.magi import staged_schedule

    if order not in DIRECT_ORDERS:
        raise ValueError(f"order must be one of {DIRECT_ORDERS}, got {order!r}")
    home = np.asarray(cand.home, dtype=np.int64)
    device = np.asarray(cand.tile_device, dtype=np.int64)
    key = cand.tiles.kv_tb.astype(np.int64)
    if order == "shifted":
        key = (home[key] - device) % cluster.n_devices * cand.layout.n_token_blocks + key
    return staged_schedule(cand.layout, cand.tiles, home, device, key, degree,
                           cluster.gpus_per_node if hierarchical else None)


def hold_back_local(cand: Candidate, tile_stage: np.ndarray, share: float = TAIL_LOCAL_SHARE) -> np.ndarray:
    """The backward tile stages of a schedule's *tail* variant: on every device with remote tiles (each sends a
    partial home), ``share`` of its local work (tiles whose q and kv blocks are both home there; by backward
    FLOPs, largest first) moves to the stage after its last remote tile's. Inputs and partials travel as before
    (a local tile needs and sends nothing), so the schedule's routes stay valid."""
    tiles = cand.tiles
    home = np.asarray(cand.home, dtype=np.int64)
    dev = np.asarray(cand.tile_device, dtype=np.int64)
    stage = np.asarray(tile_stage, dtype=np.int64)
    local = (home[tiles.q_tb] == dev) & (home[tiles.kv_tb] == dev)
    last = np.full(int(dev.max(initial=0)) + 1, -1, dtype=np.int64)
    np.maximum.at(last, dev[~local], stage[~local])
    out = stage.copy()
    work = np.asarray(tiles.bwd_flops, dtype=float)
    for d in np.flatnonzero(last >= 0).tolist():
        mine = np.flatnonzero(local & (dev == d))
        if mine.size < 2:
            continue
        mine = mine[np.argsort(-work[mine], kind="stable")]
        cum = np.cumsum(work[mine])
        out[mine[cum <= cum[-1] * share]] = last[d] + 1
    return out


def _alternative(cand: Candidate, label, sched, spec, cluster, cost) -> tuple:
    """``sched`` of ``cand``'s placement as an alternative ``(estimate s, label, Schedule, device ends)``."""
    from dcp.cost.estimate import estimate_device_ends_s

    ends = estimate_device_ends_s(spec, cluster, cand.layout, cand.tiles, cand.home, cand.tile_device, sched, cost)
    return float(ends.max(initial=0.0)), label, sched, ends


def _tail(cand: Candidate, label, sched, spec, cluster, cost) -> tuple | None:
    """The tail variant (``hold_back_local``) of backward schedule ``sched`` as an alternative labelled
    ``"<label>t"``, or None when it moves nothing."""
    from dcp.schedule.stages import Schedule

    tail = hold_back_local(cand, sched.tile_stage)
    if np.array_equal(tail, sched.tile_stage):
        return None
    return _alternative(cand, f"{label}t", Schedule("backward", tail, sched.routes), spec, cluster, cost)


def direct_alternatives(cand: Candidate, spec, cluster, cost) -> tuple[tuple, tuple]:
    """Per direction, every direct schedule of ``cand``'s placement as an alternative ``(estimate s, label,
    Schedule, device ends)``; the label, ``"<order><degree>"`` (``h`` appended: hierarchical; ``t``: the
    backward's tail variant, ``hold_back_local``), stands where dcp's alternatives have their stage count."""
    from dcp.schedule.stages import Schedule

    out: tuple[list, list] = ([], [])
    for order in DIRECT_ORDERS:
        for hierarchical in (False, True) if cluster.nodes > 1 else (False,):
            for degree in DIRECT_DEGREES:
                stage, routes = direct_schedule(cand, cluster, degree, hierarchical, order)
                label = f"{order}{degree}" + ("h" if hierarchical else "")
                for i, direction in enumerate(DIRECTIONS):
                    out[i].append(_alternative(cand, label, Schedule(direction, stage, routes), spec, cluster, cost))
                tail = _tail(cand, label, out[1][-1][2], spec, cluster, cost)
                if tail is not None:
                    out[1].append(tail)
    return tuple(out[0]), tuple(out[1])


def tail_alternatives(cand: Candidate, alts: tuple, spec, cluster, cost) -> tuple:
    """The tail variants (``_tail``) of the placement's own backward schedules in ``alts`` (dcp's stage counts
    and a static plan's own schedules; the direct ones have theirs, ``direct_alternatives``), labelled
    ``"<stage count>t"`` (dcp-only micro grid: 20 A100 and 4 H100 batches faster, none slower)."""
    tails = (_tail(cand, label, sched, spec, cluster, cost) for _, label, sched, _ in alts
             if not isinstance(label, str))
    return tuple(t for t in tails if t is not None)


def one_placement(a: Candidate, b: Candidate) -> bool:
    """Whether ``a`` and ``b`` are one placement to ``polish`` (one layout object, the same homes and tile
    devices): their close alternatives are pooled, so polishing one polishes the other."""
    return a.layout is b.layout and np.array_equal(a.home, b.home) and np.array_equal(a.tile_device, b.tile_device)


def placement_alternatives(best: Candidate, cands: list[Candidate]) -> tuple[tuple, tuple]:
    """Per direction, the close alternatives (``close_alternatives``) of every candidate with ``best``'s
    placement (``one_placement``) and each such candidate's current schedule, ``best``'s first: polishing
    one of them then covers what polishing another would (a warm start and its "/staged" version)."""
    same = [best] + [c for c in cands if c is not best and one_placement(c, best)]
    out = []
    for i, direction in enumerate(DIRECTIONS):
        currents = [(getattr(c, f"{direction}_s"), c.stages[i], getattr(c, direction), getattr(c, f"{direction}_ends"))
                    for c in same]
        alts = list(close_alternatives(currents + [a for c in same for a in c.alternatives[i]]))
        for cur in currents:  # every schedule the search chose for this placement competes
            if not any(a[1] == cur[1] for a in alts):
                alts.append(cur)
        out.append(tuple(alts))
    return out[0], out[1]


def _distinct(alts: tuple, current_label) -> tuple:
    """``alts`` without repeats of one schedule (its tile stages and routes), the current one kept first."""
    seen, out = set(), []
    for alt in sorted(alts, key=lambda a: a[1] != current_label):  # stable: the current schedule first
        sched = alt[2]
        key = (sched.tile_stage.tobytes(), sched.routes.inputs.shape, sched.routes.inputs.tobytes(),
               sched.routes.outputs.shape, sched.routes.outputs.tobytes())
        if key not in seen:
            seen.add(key)
            out.append(alt)
    return tuple(out)


def polish(best: Candidate, cands: list[Candidate], spec, cluster, cost, budget: MemoryBudget) -> Candidate:
    """``best`` with each direction's schedule the fastest simulated among its placement's close
    alternatives (``placement_alternatives``) and its direct schedules (``direct_alternatives``); ``best``
    itself when none simulates faster, or when no faster pair fits the transient budget. A changed candidate
    is labelled ``<label>/sim``."""
    from dcp.ir.plan import Plan
    from dcp.schedule.build import build_program
    from dcp.sim import simulate

    alts = placement_alternatives(best, cands)
    # and the direct schedules estimated within DIRECT_WITHIN of the direction's fastest estimate (simulating
    # all of them cost a large plan a third of a second)
    widened = []
    for i, (per, direct) in enumerate(zip(alts, direct_alternatives(best, spec, cluster, cost))):
        limit = min(a[0] for a in per + direct) * (1 + DIRECT_WITHIN)
        tails = tail_alternatives(best, per, spec, cluster, cost) if DIRECTIONS[i] == "backward" else ()
        widened.append(per + tails + tuple(d for d in direct if d[0] <= limit))
    # one simulation per distinct schedule: direct schedules of several degrees or orders often coincide (a
    # device with few remote blocks), and with dcp's own (a 64-GPU sweep plan: a third of its simulations)
    alts = tuple(_distinct(per, stage) for per, stage in zip(widened, best.stages))
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
    timed = []
    for i, direction in enumerate(DIRECTIONS):
        per = []
        for alt in alts[i]:
            pair = (alt, current["backward"]) if direction == "forward" else (current["forward"], alt)
            per.append((simulate(plan_of(*pair), cost, direction, record_events=False).makespan_s,
                        alt[1] != best.stages[i], alt))
        timed.append(sorted(per, key=lambda x: x[:2]))  # ties keep the current schedule
    # the fastest pair within the transient budget (a direct schedule at degree 1 receives all its inputs at
    # once); reaching the current pair, or none fitting, keeps the choice
    pairs = sorted(((f[0] + b[0], f[1] + b[1], f[2], b[2]) for f in timed[0][:POLISH_PAIRS]
                    for b in timed[1][:POLISH_PAIRS]), key=lambda x: x[:2])
    for _, changed, fwd, bwd in pairs:
        if not changed:
            return best
        # (without a transient budget the pair's peak is not measured)
        if budget.transient_bytes is None or budget.fits_transient(plan_transient(plan_of(fwd, bwd)).max(initial=0)):
            break
    else:
        return best
    comm = schedule_bytes(spec, best.layout, fwd[2]) + schedule_bytes(spec, best.layout, bwd[2])
    return dataclasses.replace(best, label=best.label + "/sim", forward=fwd[2], forward_s=fwd[0], forward_ends=fwd[3],
                               backward=bwd[2], backward_s=bwd[0], backward_ends=bwd[3], stages=(fwd[1], bwd[1]),
                               comm_bytes=comm, alternatives=alts)


def fastest_polished(chosen, finalists: list, count: int, within: float, polish_one, step):
    """``polish_one(chosen)``, or ``polish_one`` of one of the first ``count`` ``finalists`` ((simulated s,
    candidate), fastest first) simulated within ``within`` of it, whichever ``step`` (simulated s) finds
    fastest. ``polish_one`` returns its argument when it finds nothing faster: such a finalist is not
    simulated again (it lost to the choice as simulated, and a polished choice is no slower than the choice).
    Used for one kind (``DCPPlanner._polish_finalists``) and for every kind of a layered plan."""
    out = polish_one(chosen)
    if not finalists:
        return out
    out_s = step(out)
    limit = out_s * (1 + within)
    for sim, cand in finalists[:count]:
        if sim > limit:  # too far behind to catch up by its schedules alone
            break
        other = polish_one(cand)
        if other is cand:
            continue
        other_s = step(other)
        if other_s < out_s * (1 - 1e-9):
            out, out_s = other, other_s
    return out
