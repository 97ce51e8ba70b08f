"""Static plans as starting points of dcp's search.

Every static baseline (ring, zigzag, TransformerEngine a2a+p2p, LoongTrain, Megatron-Core dynamic CP) is a
placement in dcp's IR: a block layout, the home of every token block, the device of every tile. dcp's
search takes each as a candidate (``warm(<name>)``), scored like any other: its own schedule first (and
the same placement under the planner's other schedule settings, ``Planner.schedule_variants``, per
direction: Magi's overlap degree), and
when it is among the fastest candidates, dcp's schedules at every stage count of the search compete with
it per direction (``dcp.planner.candidates.evaluate``, ``widen``), and a chosen
warm start is refined like a packing (whole sequences moved off the device estimated to finish last,
``dcp.planner.refine``). So dcp's estimated time is never above the best of the static plans it starts from —
within the memory budget, which is applied to every candidate alike.

A warm start is skipped when its planner estimates more than ``SearchConfig.warm_start_max_tiles`` tiles
(static plans cut every sequence over every device, so on large clusters their tile tables grow with
P^2 per sequence, and scheduling them would dominate planning; such plans are also far from the best on
those clusters), or when its planner cannot plan the batch (e.g. heads that do not divide); the plan's
``meta["search_warm_starts"]`` names those that entered, ``meta["search_skipped"]`` the others.
"""
from __future__ import annotations

import numpy as np

from dcp.cluster import Cluster
from dcp.errors import DcpError
from dcp.planner.candidates import Candidate, evaluate, same_placement
from dcp.spec import BatchSpec


def warm_candidates(spec: BatchSpec, cluster: Cluster, planners, cost, two_phase: bool, max_tiles: int,
                    token_budget: float) -> tuple[list[Candidate], dict, list, list]:
    """(candidates, groups per label for refinement, skipped planners with the reason, (planner, label of
    the earlier candidate) for planners whose plan was identical to an earlier one) of ``planners`` (and
    of a Megatron planner capped at the token budget, ``_with_token_caps``)."""
    out: list[Candidate] = []
    groups: dict = {}
    skipped: list[str] = []
    aliases: list[tuple[str, str]] = []
    seen: dict = {}  # label -> parts of the warm starts evaluated so far
    points = []
    for planner, suffix in _with_token_caps(planners, token_budget):
        got = planner.warm_points(spec, cluster, token_budget)
        if not got:  # e.g. no static CP group size keeps its devices within the budget
            skipped.append(f"{planner.label()} (no setting within the memory budget of {token_budget:.0f} tokens)")
        points += [(point, suffix) for point in got]
    for planner, suffix in points:
        name = planner.label()  # several points of one planner's grid may start the search
        try:
            n_tiles = planner.estimated_tiles(spec, cluster)
            if n_tiles > max_tiles:
                skipped.append(f"{name} (~{n_tiles} tiles > {max_tiles})")
                continue
            parts = planner.static_parts(spec, cluster)
        except (DcpError, ValueError) as err:
            skipped.append(f"{name} ({type(err).__name__}: {err})")
            continue
        if parts.layout.grouped:  # a grouped layout is the plan a ring runs, not a placement to search from
            skipped.append(f"{name} (grouped shards)")
            continue
        label = f"warm({name}{suffix})"
        twin = next((lab for lab, other in seen.items() if _same_plan(other, parts)), None)
        if twin is not None:  # the very plan an earlier warm start gave: contained already
            aliases.append((name, twin))
            continue
        seen[label] = parts
        # its own schedule first; the search's widening schedules the fastest candidates by dcp too
        own = (parts, *planner.schedule_variants(spec, cluster, parts))
        cand = evaluate(label, spec, cluster, parts.layout, parts.tiles, parts.home, parts.tile_device, cost,
                        (), two_phase, notes=(f"dcp's search started from {name}'s placement",), own=own)
        out.append(cand)
        groups[label] = sequence_groups(cand)
    return out, groups, skipped, aliases


def _with_token_caps(planners, token_budget: float):
    """(planner, label suffix) for ``planners``, each Megatron dynamic CP planner without a
    ``max_seqlen_per_rank`` followed by one capped at the token budget ("@budget"): its packer then keeps
    every device within dcp's memory budget where it can (uncapped it fills devices to the mean and
    overflows them when a sequence fits no group)."""
    from dcp.baselines import MegatronDynCPPlanner

    for planner in planners:
        yield planner, ""
        if isinstance(planner, MegatronDynCPPlanner) and planner.max_seqlen_per_rank is None:
            yield MegatronDynCPPlanner(max_seqlen_per_rank=max(int(token_budget), 1)), "@budget"


def _same_plan(a, b) -> bool:
    """Whether two static planners' parts are the same plan (placement and own schedule)."""
    return (same_placement(a, b.layout, b.home) and np.array_equal(a.layout.tb_len, b.layout.tb_len)
            and a.layout.n_head_blocks == b.layout.n_head_blocks
            and np.array_equal(a.tile_device, b.tile_device) and np.array_equal(a.tile_stage, b.tile_stage)
            and np.array_equal(a.routes.inputs, b.routes.inputs) and np.array_equal(a.routes.outputs, b.routes.outputs))


def sequence_groups(cand: Candidate) -> tuple[tuple[int, ...], ...]:
    """The devices homing each sequence's token blocks (one device: a whole sequence ``dcp.planner.refine`` may
    move)."""
    ptr = cand.layout.seq_tb_ptr
    return tuple(tuple(np.unique(cand.home[ptr[s]:ptr[s + 1]]).tolist()) for s in range(ptr.size - 1))
