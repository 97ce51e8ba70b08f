"""dcp's planner for a model whose layers differ (``BatchSpec(..., masks={kind: ...}, layers={kind: n})``).

The tokens' homes are shared by every layer (activations live there); what a layer computes and moves
follows its kind's masks. So the search is over placements, scored by the step's attention time
Σ_kind layers × (forward + backward) of that kind's program on the placement, plus the non-attention work
of the device with the most tokens once per layer (``SearchConfig.token_time_s``):

1. the ordinary search (``DCPPlanner.search``) runs for the *heaviest* kind (layers × attended pairs):
   its packings, hypergraph partition and warm starts are the candidate placements;
2. when the other kinds take at least ``JOINT_SHARE`` of the lead's own choice's step time, packings
   that balance every sequence's layer-weighted time over all kinds join them (a placement balanced for
   the full layers leaves the windowed layers' work, which follows the tokens, uneven);
3. the lead's choice, its ``LAYERED_POOL`` best candidates within the memory budget (``LIGHT_POOL`` when
   the other kinds weigh less than ``JOINT_SHARE``), every joint packing, and the candidate holding the
   fewest tokens on its busiest device, are scheduled for every other kind with every token on the same
   home (its blocks cut where a query block elsewhere needs only part of one, ``kind_layout``; a tile runs
   on its q block's home) and scored by the estimate; the best two (one when light) are rescheduled at
   every stage count; of those whose every kind keeps transient buffers within the budget, the few
   estimated fastest are simulated (every kind) and the fastest simulated one wins;
4. every kind's schedules are then re-chosen by simulation on that placement (``dcp.planner.polish``, its
   direct schedules included), and on the next few simulated finalists' (``_polish_layered``), the fastest
   kept, as for a one-kind plan (``DCPPlanner._polish_finalists``).

Every kind's plan is assembled and validated on its own; ``LayeredPlan`` checks that the homes agree.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from dcp.cluster import Cluster
from dcp.ir.layered import LayeredPlan
from dcp.layout.blocks import BlockLayout, make_layout, uniform_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.planner.budget import SIMULATE_WITHIN, _simulated_step_s, candidate_programs, pick, within_tokens
from dcp.planner.candidates import Candidate, evaluate, same_placement, sequence_times, widen
from dcp.planner.pack import SequenceProfiles, pack, sequence_areas
from dcp.planner.polish import fastest_polished, polish
from dcp.spec import BatchSpec

#: candidates of the heaviest kind's search (best first, within the memory budget) scored for every kind;
#: ``LIGHT_POOL`` when the other kinds weigh less than ``JOINT_SHARE`` of the lead's step
LAYERED_POOL = 6
LIGHT_POOL = 3
#: the best scored placements whose other kinds are rescheduled at every stage count of the search (1 when
#: the other kinds weigh less than ``JOINT_SHARE``)
WIDEN_TOP = 2
#: the simulated finalists besides the choice whose every kind is polished too, those within
#: ``LAYERED_POLISH_WITHIN`` of the polished choice: each costs a polish per kind, so fewer and closer ones
#: than a one-kind plan's (``dcp.planner.polish.POLISH_FINALISTS``), to keep a two-kind plan within 1.5x
#: one kind's planning time (3 within 10 %: 1.52x at worst on the planner-layers benchmark; these: 1.46x)
LAYERED_POLISH_FINALISTS = 2
LAYERED_POLISH_WITHIN = 0.05
#: compute tolerances of the packings balancing every kind's layers together
JOINT_EPSILONS = (0.05, 0.2)
#: the other kinds' least share of the lead's own choice's step time for which those packings are tried
JOINT_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class Scored:
    """A placement's candidate per kind (``spec.kinds`` order) and its layer-weighted step time (s)."""

    per_kind: tuple[Candidate, ...]
    step_s: float


def _token_s(cfg) -> float:
    """Seconds of non-attention work per home token per layer that the score adds (time objective only)."""
    return cfg.search.token_time_s if cfg.search.objective == "time" else 0.0


def _step_s(per_kind, spec: BatchSpec, cfg) -> float:
    """The layer-weighted score of a placement's per-kind candidates: Σ layers × (fwd + bwd) plus every
    layer's token work on the device with the most tokens (the same on every kind: homes agree); the bytes
    objective: Σ layers × bytes moved."""
    if cfg.search.objective == "bytes":
        return float(sum(n * c.comm_bytes for n, c in zip(spec.layers, per_kind)))
    return float(sum(n * c.time_s for n, c in zip(spec.layers, per_kind))
                 + sum(spec.layers) * _token_s(cfg) * per_kind[0].max_tokens)


def heaviest_kind(spec: BatchSpec) -> str:
    """The kind with the most attention work over the model: layers × attended (q, kv) pairs."""
    work = [n * float(sequence_areas(spec.for_kind(k)).sum()) for k, n in zip(spec.kinds, spec.layers)]
    return spec.kinds[int(np.argmax(work))]


def plan_layered(planner, spec: BatchSpec, cluster: Cluster, started: float) -> LayeredPlan:
    """``DCPPlanner.plan`` of a layered batch: one placement, one validated plan per kind."""
    cfg = planner.config
    lead = heaviest_kind(spec)
    lead_spec = spec.for_kind(lead)
    search = planner.search(lead_spec, cluster)
    specs = {k: spec.for_kind(k) for k in spec.kinds}
    own = _score(search.best, lead, specs, spec, cluster, planner)
    # the other kinds' share of the lead's own choice: when they weigh little, placements other than the
    # lead's best few rarely win, and one balancing all kinds together is the lead's own (scoring more would
    # cost planning time for nothing)
    others = sum(n * c.time_s for k, n, c in zip(spec.kinds, spec.layers, own.per_kind) if k != lead)
    heavy = others >= JOINT_SHARE * own.step_s
    pool = [c for c in _pool(search, cfg, LAYERED_POOL if heavy else LIGHT_POOL) if c is not search.best]
    scored = [own] + [_score(c, lead, specs, spec, cluster, planner) for c in pool]
    if heavy:
        joint = _joint_packings(search, cfg, planner, specs, spec, cluster, lead, [search.best] + pool)
        scored += [_score(c, lead, specs, spec, cluster, planner) for c in joint]
    scored.sort(key=lambda s: s.step_s)
    scored = _widen_top(scored, lead, specs, spec, cluster, planner, WIDEN_TOP if heavy else 1)
    chosen, memory_notes, finalists = _within_transient(scored, search.budget, specs, spec, cluster, cfg,
                                                        search.memo)
    if cfg.search.objective == "time" and cfg.search.simulate_top > 1:
        # every kind's schedules re-chosen by simulation on the chosen placement, its direct ones too (the lead
        # kind's search polished its own choice; a kind's programs are simulated and budgeted on their own);
        # so are the next few simulated finalists' (``DCPPlanner._polish_finalists``), the fastest kept
        chosen = _polish_layered(chosen, finalists, scored, specs, spec, cluster, cfg, search.budget)
    plans = []
    for k, cand in zip(spec.kinds, chosen.per_kind):
        own = search if k == lead else search._replace(cands=[s.per_kind[spec.kinds.index(k)] for s in scored],
                                                       notes=(), warm_names=(), skipped=())
        plans.append(planner.assemble(specs[k], cluster, cand, own, started, memory_notes))
    elapsed = time.perf_counter() - started
    plans = tuple(dataclasses.replace(p, planning_time_s=elapsed) for p in plans)
    meta = {"layered_lead_kind": lead, "layered_chosen": chosen.per_kind[0].label,
            "est_step_ms": round(chosen.step_s * 1e3, 5),
            "layered_candidates": json.dumps({s.per_kind[0].label: round(s.step_s * 1e3, 5) for s in scored},
                                             sort_keys=True)}
    return LayeredPlan(spec, plans, planner.name, elapsed, meta)


def _pool(search, cfg, size: int) -> list[Candidate]:
    """The lead kind's placements scored for every kind (module docstring, steps 1 and 3): its ``size`` best
    within the memory budget, its choice, and the one holding the fewest tokens."""
    token_s = _token_s(cfg)
    fits, _ = within_tokens(search.cands, search.budget)
    ranked = sorted(fits, key=lambda c: c.step_s(token_s))
    pool = ranked[:size]
    if search.best not in pool:
        pool.insert(0, search.best)
    fewest = min(fits, key=lambda c: (c.max_tokens, c.step_s(token_s)))
    if fewest not in pool:
        pool.append(fewest)
    return pool


def _joint_packings(search, cfg, planner, specs: dict, spec: BatchSpec, cluster: Cluster, lead: str,
                    pool: list[Candidate]) -> list[Candidate]:
    """Packings balancing every sequence's layer-weighted time over all kinds (module docstring, step 2)."""
    token_s = _token_s(cfg)
    lead_spec = specs[lead]
    total_layers = sum(spec.layers)
    # each sequence's attention time per layer, averaged over the layers (and its tokens' own work)
    weights = token_s * np.asarray(spec.seqlens, dtype=float)
    for k, n in zip(spec.kinds, spec.layers):
        layout = uniform_layout(specs[k], cfg.block_size, cfg.head_block_size)
        tiles = enumerate_tiles(specs[k], layout)
        weights += n / total_layers * sequence_times(cfg.cost_model, layout, tiles, spec.num_seqs)
    budget_eps = cfg.budget_ratio(spec.total_tokens, cluster.n_devices) - 1
    profiles = SequenceProfiles(lead_spec)
    out: list[Candidate] = []
    for eps in JOINT_EPSILONS:
        pk = pack(lead_spec, cluster, cfg.block_size, cfg.head_block_size, eps, budget_eps, weights,
                  cfg.cost_model.profile.half_rows, None, overfill_whole=token_s == 0, profiles=profiles)
        if any(same_placement(c, pk.layout, pk.home) for c in pool + out):
            continue
        cand = evaluate(f"pack(eps={eps:g},layers)", lead_spec, cluster, pk.layout, pk.tiles, pk.home,
                        pk.tile_device, cfg.cost_model, planner._stage_counts(), cfg.two_phase)
        if cand.max_tokens <= search.budget.tokens * (1 + 1e-9):
            out.append(cand)
    return out


def kind_layout(kind_spec: BatchSpec, layout: BlockLayout, home: np.ndarray) -> tuple[BlockLayout, np.ndarray]:
    """(a layout for ``kind_spec`` on the placement ``layout``/``home``, its blocks' homes): every token keeps
    its home, but a block is cut where a query block on another device needs only part of it (a windowed
    layer reads the last ``window`` keys of its neighbour's block, not the whole block, so it moves only
    those). Cut points: per query block and range slot of ``kind_spec``'s masks, the smallest start and the
    largest end of its rows' key ranges, kept where they fall inside a block homed elsewhere. A grouped
    layout is returned as it is."""
    if layout.grouped:
        return layout, home
    bounds_per_seq, homes = [], []
    for s in range(kind_spec.num_seqs):
        lo_b, hi_b = int(layout.seq_tb_ptr[s]), int(layout.seq_tb_ptr[s + 1])
        bounds, dev = layout.seq_bounds(s), np.asarray(home[lo_b:hi_b])
        if bounds.size > 2 and np.unique(dev).size > 1:
            bounds = _cut_bounds(kind_spec.kv_ranges(s), bounds, dev)
        bounds_per_seq.append(bounds)
        parent = np.searchsorted(layout.seq_bounds(s), bounds[:-1], side="right") - 1
        homes.append(dev[parent])
    refined = make_layout(kind_spec, bounds_per_seq, layout.head_block_size)
    return refined, np.concatenate(homes).astype(np.int64)


def _cut_bounds(ranges_tr2: np.ndarray, bounds: np.ndarray, dev: np.ndarray) -> np.ndarray:
    """``bounds`` with the cut points of ``kind_layout`` added (one sequence)."""
    lo, hi = ranges_tr2[:, :, 0].astype(np.int64), ranges_tr2[:, :, 1].astype(np.int64)
    empty = hi <= lo
    big = np.iinfo(np.int64).max
    starts = bounds[:-1]
    lo_min = np.minimum.reduceat(np.where(empty, big, lo), starts, axis=0)   # [q blocks, R]
    hi_max = np.maximum.reduceat(np.where(empty, -1, hi), starts, axis=0)
    q_dev = np.repeat(dev, lo_min.shape[1])
    cuts = np.concatenate([lo_min.ravel(), hi_max.ravel()])
    owner = np.concatenate([q_dev, q_dev])
    ok = (cuts > 0) & (cuts < bounds[-1])
    cuts, owner = cuts[ok], owner[ok]
    block = np.searchsorted(bounds, cuts, side="right") - 1
    inside = (cuts > bounds[block]) & (dev[block] != owner)   # strictly inside a block homed elsewhere
    return np.union1d(bounds, cuts[inside])


def _score(cand: Candidate, lead: str, specs: dict, spec: BatchSpec, cluster: Cluster, planner) -> Scored:
    """``cand`` (a placement for the lead kind) scheduled for every kind, and its layer-weighted step time."""
    cfg = planner.config
    per_kind = []
    for k in spec.kinds:
        if k == lead:
            per_kind.append(cand)
            continue
        layout, home = kind_layout(specs[k], cand.layout, np.asarray(cand.home, dtype=np.int64))
        tiles = enumerate_tiles(specs[k], layout)
        per_kind.append(evaluate(cand.label, specs[k], cluster, layout, tiles, home, home[tiles.q_tb],
                                 cfg.cost_model, planner._stage_counts(), cfg.two_phase, cand.notes))
    return Scored(tuple(per_kind), _step_s(per_kind, spec, cfg))


def _widen_top(scored: list[Scored], lead: str, specs: dict, spec: BatchSpec, cluster: Cluster,
               planner, top: int) -> list[Scored]:
    """The ``top`` best scored placements with every other kind's schedules the fastest over all the
    search's stage counts (``dcp.planner.candidates.widen``; the lead kind's were widened by its search),
    re-sorted."""
    cfg = planner.config
    if cfg.search.objective != "time":
        return scored
    out = list(scored)
    for i, s in enumerate(scored[:top]):
        per_kind = tuple(c if k == lead else widen(c, specs[k], cluster, cfg.cost_model, cfg.search.stage_counts,
                                                   cfg.two_phase) for k, c in zip(spec.kinds, s.per_kind))
        out[i] = Scored(per_kind, _step_s(per_kind, spec, cfg))
    return sorted(out, key=lambda s: s.step_s)


def _simulated_s(cand: Candidate, kind_spec: BatchSpec, cluster: Cluster, cost, token_s: float, memo: dict) -> float:
    """Simulated forward + backward + token time of one kind's candidate (the lead search's result reused)."""
    got = memo.get(id(cand))
    if got is not None and got[1] is not None and got[2] is cand:
        return got[1]
    sim = _simulated_step_s(candidate_programs(cand, kind_spec, cluster), cand, cost, token_s)
    peak = got[0] if got is not None and got[2] is cand else None
    if peak is not None:
        memo[id(cand)] = (peak, sim, cand)
    return sim


def _within_transient(scored: list[Scored], budget, specs: dict, spec: BatchSpec, cluster: Cluster,
                      cfg, memo: dict) -> tuple[Scored, tuple[str, ...]]:
    """The final choice: of the scored placements (best estimate first) whose every kind keeps transient
    buffers within the budget, the first ``simulate_top`` estimated within ``SIMULATE_WITHIN`` of the best
    compete by simulated step time (``dcp.sim``; every kind's programs), as ``dcp.planner.budget.pick`` does
    for one kind. When none fits, the fastest stands, with the notes saying where it is over."""
    first_notes: tuple[str, ...] | None = None
    top = cfg.search.simulate_top if cfg.search.objective == "time" else 0
    token_s = _token_s(cfg)
    fits: list[tuple[float, int, Scored]] = []
    for i, s in enumerate(scored):
        close = i < top and s.step_s <= scored[0].step_s * (1 + SIMULATE_WITHIN)
        if fits and not close:
            break
        notes: list[str] = []
        sim = 0.0
        for k, n, cand in zip(spec.kinds, spec.layers, s.per_kind):
            _, more = pick([cand], budget, specs[k], cluster, cfg.cost_model, 0, memo=memo)
            notes += [f"layer kind {k!r}: {x}" for x in more]
            if close and top > 1 and not more:
                sim += n * _simulated_s(cand, specs[k], cluster, cfg.cost_model, token_s, memo)
        if notes:
            first_notes = tuple(notes) if first_notes is None else first_notes
            continue
        fits.append((sim if close and top > 1 else float("inf"), i, s))
        if top <= 1:
            break
    if fits:
        fits.sort(key=lambda f: f[:2])
        return fits[0][2], (), [(sim, s) for sim, _, s in fits[1:] if sim < float("inf")]
    return scored[0], first_notes or (), []


def _polish_layered(chosen: Scored, finalists: list, scored: list[Scored], specs: dict, spec: BatchSpec,
                    cluster: Cluster, cfg, budget) -> Scored:
    """``chosen`` with every kind's schedules re-chosen by simulation (``dcp.planner.polish``), or one of the
    next ``LAYERED_POLISH_FINALISTS`` simulated ``finalists`` ((simulated step s, Scored), fastest first)
    within ``LAYERED_POLISH_WITHIN`` of it, so polished, when that simulates faster (layers-weighted, every
    kind)."""
    token_s = _token_s(cfg)

    def polished(s: Scored) -> Scored:
        per_kind = tuple(polish(c, [o.per_kind[i] for o in scored], specs[k], cluster, cfg.cost_model, budget)
                         for i, (k, c) in enumerate(zip(spec.kinds, s.per_kind)))
        return s if all(a is b for a, b in zip(per_kind, s.per_kind)) else dataclasses.replace(s, per_kind=per_kind)

    def step(s: Scored) -> float:
        return sum(n * _simulated_step_s(candidate_programs(c, specs[k], cluster), c, cfg.cost_model, token_s)
                   for k, n, c in zip(spec.kinds, spec.layers, s.per_kind))

    return fastest_polished(chosen, finalists, LAYERED_POLISH_FINALISTS, LAYERED_POLISH_WITHIN, polished, step)
