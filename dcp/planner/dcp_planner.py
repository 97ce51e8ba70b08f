"""dcp's planner: ``DCPPlanner`` and ``plan`` (``BatchSpec`` + ``Cluster`` → a validated ``Plan``).

Candidate placements — packings (``dcp.planner.pack``) at several compute tolerances, the two-level
hypergraph partition (``dcp.planner.assign``) and the static baselines' placements (``dcp.planner.warm``) —
are each scheduled (``dcp.schedule``) and scored by the estimated makespan (``dcp.cost.estimate``) under the
memory budget (``dcp.planner.budget``); the few fastest are simulated and the fastest kept, its schedules
then chosen per direction by simulation among its placement's close alternatives (``dcp.planner.polish``). The static
baselines (``dcp.baselines``) implement the same ``Planner`` interface (``dcp.schedule.assemble``) and emit
plans in the same IR, so every comparison runs through the same validator, statistics and executors.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from typing import NamedTuple

import numpy as np

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import InvalidConfigError, PartitionerError, TooFewBlocksError
from dcp.ir.plan import Plan
from dcp.layout.blocks import BlockLayout, TileSet, uniform_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.partition import GreedyPartitioner
from dcp.planner.assign import SLACK_COST, start_assign
from dcp.planner.budget import MemoryBudget, pick
from dcp.planner.budget import report as report_budget
from dcp.planner.budget import token_note, within_tokens
from dcp.planner.candidates import Candidate, evaluate, same_placement, same_plan, sequence_times, widen
from dcp.planner.pack import SequenceProfiles, pack, pack_aligned
from dcp.planner.polish import POLISH_FINALISTS, POLISH_FINALISTS_WITHIN, fastest_polished, one_placement, polish
from dcp.planner.refine import refine_packing
from dcp.planner.warm import warm_candidates
from dcp.schedule.assemble import Planner, assemble, check_inputs
from dcp.spec import BatchSpec


def check_config(config) -> None:
    """A named error for a configuration that is not a ``PlannerConfig`` (a dict gets a hint)."""
    if not isinstance(config, PlannerConfig):
        hint = f" (write dcp.PlannerConfig(**{config!r}))" if isinstance(config, dict) else ""
        raise InvalidConfigError(f"expected a dcp.PlannerConfig, got {type(config).__name__}{hint}")


@dataclasses.dataclass(frozen=True)
class DCPPlanner(Planner):
    """dcp's planner: candidate placements — packings (``dcp.planner.pack``) at several compute tolerances and
    the two-level hypergraph partition (``dcp.planner.assign``) — each scheduled per direction at several stage
    counts (``dcp.schedule``), scored by the estimated makespan (``dcp.cost.estimate``) or by bytes, as
    ``config.search`` says; the partitioner works in its process while the packings are evaluated here."""

    config: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    name = "dcp"

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        """A validated ``Plan``; for a layered batch (``spec.kinds``) a ``dcp.ir.layered.LayeredPlan``: one
        placement searched for every kind's layers together (``dcp.planner.layered``)."""
        started = time.perf_counter()
        check_inputs(spec, cluster, layered=True)
        check_config(self.config)
        if spec.layered:
            from dcp.planner.layered import plan_layered

            return plan_layered(self, spec, cluster, started)
        search = self.search(spec, cluster)
        return self.assemble(spec, cluster, search.best, search, started)

    def search(self, spec: BatchSpec, cluster: Cluster) -> "Search":
        """The candidates of a one-kind batch and the one chosen (``Search``), before programs are built."""
        cfg = self.config
        layout = uniform_layout(spec, cfg.block_size, cfg.hypergraph_head_block_size(spec.num_heads, spec.num_kv_heads))
        if layout.n_token_blocks < cluster.n_devices and not cfg.allow_idle_devices:
            raise TooFewBlocksError(
                f"{layout.n_token_blocks} token blocks for {cluster.n_devices} devices: lower block_size "
                f"(now {cfg.block_size}) or set allow_idle_devices=True")
        tiles = enumerate_tiles(spec, layout)
        layout, tiles = self._hypergraph_blocks(spec, layout, tiles)
        pending = None
        notes: list[str] = []
        skipped: list[str] = []
        budget = MemoryBudget.of(spec, cluster, cfg)
        if cfg.search.hypergraph and not self._hypergraph_misses_budget(spec, cluster, layout, budget, skipped):
            pending = self._start_assign(spec, cluster, layout, tiles, cfg.partitioner, cfg.time_budget_s)
        try:
            cands, packings = self._packings(spec, cluster, layout, tiles)
            if pending is not None:
                job, pending = pending, None
                try:
                    cands.append(self._hypergraph(spec, cluster, layout, tiles, job, notes, bool(cands)))
                except _Dropped:
                    pass
        finally:
            if pending is not None:  # an error before the partitioner's result was taken
                pending.cancel()
        warm_names = self._warm(spec, cluster, layout, tiles, cands, packings, budget, skipped)
        memo: dict = {}  # programs, transient peaks and simulated times of candidates, across the choices below
        cands = self._widen(spec, cluster, cands, budget, packings)
        best, memory_notes = choose(cands, cfg, budget, spec, cluster, memo)
        lead = self._resizable_lead(best, cands, packings, budget)
        if lead is not None:
            best, memory_notes = self._resize(spec, cluster, lead, cands, packings, budget, memo, best)
        if cfg.search.objective == "time" and best.label in packings and cfg.search.refine_evaluations:
            best, memory_notes = self._refine(spec, cluster, best, cands, *packings[best.label][:2], budget, memo)
        if cfg.search.objective == "time" and cfg.search.simulate_top > 1:
            polished = self._polish_finalists(spec, cluster, best, cands, budget, memo)
            if polished is not best:
                cands.append(polished)
                best = polished
        return Search(best, cands, tuple(notes), tuple(memory_notes), tuple(warm_names), tuple(skipped), budget, memo)

    def _polish_finalists(self, spec: BatchSpec, cluster: Cluster, best: Candidate, cands: list[Candidate],
                          budget: MemoryBudget, memo: dict) -> Candidate:
        """``best`` with its schedules re-chosen by simulation (``dcp.planner.polish``), or one of the next
        ``POLISH_FINALISTS`` simulated finalists (the fastest others within the transient budget, as simulated
        within ``POLISH_FINALISTS_WITHIN`` of the polished choice) so polished when that then simulates faster:
        a placement whose own schedules the estimate served worse can gain more from its direct schedules
        (micro grid, dcp only: the runner-up alone made 33 of 192 batches faster, none slower; three, 15 more,
        none slower. H100 LDC x2 causal b1: TE's placement at head-parallel 2, the third finalist at 9.39 ms,
        polishes to 8.76 where the choice polishes to 9.09). A finalist of a placement polished already, or the
        very plan of one (``same_plan``), is passed over: its polish would search the same schedules."""
        from dcp.planner.budget import _simulated_step_s, candidate_programs

        cfg = self.config
        finalists = []
        for sim, cand in sorted(((got[1], got[2]) for got in memo.values() if got[1] is not None
                                 and got[2].label != best.label and budget.fits_transient(got[0][0])),
                                key=lambda f: f[0]):
            # a twin, or another schedule of a placement polished already, would polish alike
            if not any(same_plan(c, cand) or one_placement(c, cand) for c in [best, *(f[1] for f in finalists)]):
                finalists.append((sim, cand))

        def step(cand):
            return _simulated_step_s(candidate_programs(cand, spec, cluster), cand, cfg.cost_model,
                                     cfg.search.token_time_s)

        return fastest_polished(best, finalists, POLISH_FINALISTS, POLISH_FINALISTS_WITHIN,
                                lambda c: polish(c, cands, spec, cluster, cfg.cost_model, budget), step)

    def assemble(self, spec: BatchSpec, cluster: Cluster, best: Candidate, search: "Search", started: float,
                 memory_notes: tuple[str, ...] | None = None) -> Plan:
        """The chosen candidate as a validated ``Plan``, with the search's notes and metadata."""
        memory_notes = search.memory_notes if memory_notes is None else memory_notes
        report_budget(list(memory_notes), search.budget)
        plan = assemble(spec, cluster, best.layout, best.tiles, best.home, best.tile_device,
                        best.forward.tile_stage, best.forward.routes, self.name, started,
                        search.notes + best.notes + tuple(memory_notes), backward=best.backward)
        plan.meta.update(search_warm_starts=",".join(search.warm_names), search_skipped="; ".join(search.skipped),
                         token_budget=round(search.budget.tokens, 3))
        plan.meta.update(search_objective=self.config.search.objective, search_chosen=best.label,
                         est_forward_ms=round(best.forward_s * 1e3, 5), est_backward_ms=round(best.backward_s * 1e3, 5),
                         search_candidates=json.dumps({c.label: c.summary() for c in search.cands}, sort_keys=True))
        return plan

    def _hypergraph_blocks(self, spec: BatchSpec, layout: BlockLayout, tiles: TileSet) -> tuple[BlockLayout, TileSet]:
        """The hypergraph candidate's blocks: with the time objective, the block size doubles while the
        tiles exceed ``SearchConfig.hypergraph_max_tiles`` (partitioning time grows faster than linearly
        in them, and long sequences are served by packings anyway); the bytes objective keeps the
        configured block size."""
        cfg = self.config
        cap = cfg.search.hypergraph_max_tiles
        block = cfg.block_size
        while cfg.search.objective == "time" and cap and tiles.n_tiles > cap and block < max(spec.seqlens):
            block *= 2
            layout = uniform_layout(spec, block, layout.head_block_size)
            tiles = enumerate_tiles(spec, layout)
        return layout, tiles

    def _warm(self, spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet, cands: list[Candidate],
              packings: dict, budget: MemoryBudget, skipped: list[str]) -> list[str]:
        """Add the static planners' placements to ``cands`` (``dcp.planner.warm``); returns the planners whose plans
        entered the search (directly or as an identical earlier plan) and notes the skipped ones."""
        cfg = self.config
        if not cfg.search.warm_starts:
            return []
        warm, groups, warm_skipped, aliases = warm_candidates(
            spec, cluster, cfg.search.warm_starts, cfg.cost_model, cfg.two_phase, cfg.search.warm_start_max_tiles,
            budget.tokens)
        seq_w = sequence_times(cfg.cost_model, layout, tiles, spec.num_seqs)
        for cand in warm:
            cands.append(cand)
            packings[cand.label] = (groups[cand.label], seq_w, None)
        skipped += [f"warm start {w}" for w in warm_skipped]
        names = [c.label[5:-1].replace("@budget", "") for c in warm] + [name for name, _ in aliases]
        return list(dict.fromkeys(names))

    def _hypergraph_misses_budget(self, spec: BatchSpec, cluster: Cluster, layout: BlockLayout,
                                  budget: MemoryBudget, skipped: list[str]) -> bool:
        """Whether the time search skips the hypergraph candidate: its homes are whole token blocks, so
        when a block is larger than the memory budget's slack over the mean it can rarely keep every
        device within the budget (packings cut sequences at any token) and would cost the most planning
        time for a candidate the budget then rejects. Other candidates must exist."""
        cfg, search = self.config, self.config.search
        if search.objective != "time" or not (search.pack_epsilons or search.aligned_groups or search.warm_starts):
            return False
        slack = budget.tokens - spec.total_tokens / cluster.n_devices
        block = int(layout.tb_len.max())
        if block <= slack:
            return False
        skipped.append(f"hypergraph: its {block}-token blocks exceed the memory budget's slack of "
                     f"{slack:.0f} tokens per device (epsilon_memory={cfg.epsilon_memory:g})")
        return True

    def _stage_counts(self) -> tuple[int, ...]:
        """Stage counts every candidate is first scheduled at: the middle of the search's (the ``WIDEN_TOP`` best
        candidates then get the rest, ``_widen``), or ``max_stages`` for the bytes objective."""
        cfg = self.config
        counts = cfg.search.stage_counts
        if cfg.search.objective != "time":
            return (cfg.max_stages,)
        return (counts[len(counts) // 2],) if len(counts) > 2 else counts

    def _widen(self, spec: BatchSpec, cluster: Cluster, cands: list[Candidate], budget: MemoryBudget,
               packings: dict) -> list[Candidate]:
        """The candidates plus the ``WIDEN_TOP`` estimated fastest, each direction's ``WIDEN_PER_DIRECTION``
        fastest and the fastest packing (of those within the token budget) scheduled at every stage count of
        the search ("<label>/staged"; ``packings`` learns their labels)."""
        cfg = self.config
        if cfg.search.objective != "time" or len(cfg.search.stage_counts) <= 2:
            return cands
        # a static plan this large keeps its own schedule (rescheduling its tiles would cost seconds)
        fits = {id(c) for c in within_tokens(cands, budget)[0] if c.tiles.n_tiles <= WIDEN_MAX_TILES}
        ranked: list[int] = []
        for i in sorted((i for i in range(len(cands)) if id(cands[i]) in fits),
                        key=lambda i: cands[i].step_s(cfg.search.token_time_s)):
            if not any(same_plan(cands[j], cands[i]) for j in ranked):  # a twin would widen alike
                ranked.append(i)
        out = list(cands)
        top = ranked[:WIDEN_TOP]
        # and each direction's fastest few: a placement whose own schedule is slow in the other direction may
        # still be the fastest once dcp schedules that direction too (and one alone is easily displaced by a
        # new warm start)
        top += sorted(ranked, key=lambda i: cands[i].forward_s)[:WIDEN_PER_DIRECTION]
        top += sorted(ranked, key=lambda i: cands[i].backward_s)[:WIDEN_PER_DIRECTION]
        # the fastest packing too: warm starts can fill the top few, and a packing is what the block-size
        # rebuild (``_resize``) then starts from
        top += [i for i in ranked if cands[i].label in packings and packings[cands[i].label][2] is not None][:1]
        for i in dict.fromkeys(top):
            wide = widen(cands[i], spec, cluster, cfg.cost_model, cfg.search.stage_counts, cfg.two_phase)
            if wide.stages == cands[i].stages:
                continue  # no other stage count was estimated faster
            # both stay: the widened schedules are estimated faster, but may hold more transient buffers
            label = cands[i].label + "/staged"
            out.append(dataclasses.replace(wide, label=label))
            if cands[i].label in packings:
                packings[label] = packings[cands[i].label]
        return out

    def _resizable_lead(self, best: Candidate, cands: list[Candidate], packings: dict,
                        budget: MemoryBudget) -> Candidate | None:
        """The packing ``_resize`` rebuilds at other block sizes: the chosen candidate when it is one, else the
        fastest packing within the token budget (a warm start chosen over a packing can lose to that packing at
        another block size, estimated 15 % slower at the configured one: micro grid, LongAlign x2 causal-blockwise,
        H100); None when there is none, or no other block size to try."""
        cfg = self.config
        if not cfg.search.block_size_factors:
            return None
        resizable = lambda c: c.label in packings and packings[c.label][2] is not None  # noqa: E731
        if resizable(best):
            return best
        if cfg.search.objective != "time":
            return None
        token_s = cfg.search.token_time_s
        fits = [c for c in within_tokens(cands, budget)[0] if resizable(c)]
        return min(fits, key=lambda c: c.step_s(token_s), default=None)

    def _resize(self, spec: BatchSpec, cluster: Cluster, best: Candidate, cands: list[Candidate], packings: dict,
                budget: MemoryBudget, memo: dict, chosen: Candidate | None = None) -> tuple[Candidate, list[str]]:
        """The packing ``best`` rebuilt at each block size of ``SearchConfig.block_size_factors`` x the
        configured one (tile size decides kernel efficiency and stage granularity; the cost model scores
        it), scheduled at its stage counts; the fastest of all stays chosen, the rebuilt ones and the choice
        so far (``chosen``, default ``best``) simulated wherever they rank."""
        cfg = self.config
        keep = [chosen or best]
        for factor in cfg.search.block_size_factors:
            size = max(64, int(round(cfg.block_size * factor)))
            if size == cfg.block_size:
                continue
            pk = packings[best.label][2](block_size=size)
            label = f"{best.label}@B{size}"
            cands.append(evaluate(label, spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, cfg.cost_model,
                                  (), cfg.two_phase, per_direction=best.stages))
            keep.append(cands[-1])
            packings[label] = (pk.groups, packings[best.label][1], None)
        return choose(cands, cfg, budget, spec, cluster, memo, tuple(keep))

    def _refine(self, spec: BatchSpec, cluster: Cluster, best: Candidate, cands: list[Candidate], groups,
                weights, budget: MemoryBudget, memo: dict) -> tuple[Candidate, list[str]]:
        """Refine the chosen packing or warm start (``dcp.planner.refine``) within the token budget; it stays
        chosen only if it still wins."""
        cfg = self.config
        cap = max(float(best.max_tokens), budget.tokens)
        refined = refine_packing(best, groups, weights, spec, cluster, cfg.cost_model, cfg.two_phase, cap,
                                 cfg.search.refine_evaluations, token_time_s=cfg.search.token_time_s)
        keep = [best]
        if refined is not best:
            cands.append(dataclasses.replace(refined, label=best.label + "+refined"))
            keep.append(cands[-1])
        return choose(cands, cfg, budget, spec, cluster, memo, tuple(keep))

    def _packings(self, spec: BatchSpec, cluster: Cluster, layout: BlockLayout,
                  tiles: TileSet) -> tuple[list[Candidate], dict]:
        """The packing candidates, and per label its sequence groups and weights (for refinement) and how to
        build it at another block size (None: not rebuilt)."""
        cfg, search = self.config, self.config.search
        epsilons = search.pack_epsilons
        if search.objective == "bytes":  # only packings within the compute tolerance
            epsilons = tuple(e for e in epsilons if 1 + e <= cfg.compute_tolerance * (1 + 1e-9))
        out: list[Candidate] = []
        groups: dict = {}
        token_s = search.token_time_s if search.objective == "time" else 0.0
        aligned = search.aligned_groups and search.objective == "time"
        attention = sequence_times(cfg.cost_model, layout, tiles, spec.num_seqs) if epsilons or aligned else None
        # what a packing balances: each sequence's attention; when the search scores the tokens' own work
        # too, also attention + that work as one weight (a step pays the larger of two maxima, which
        # neither weighting alone tracks), each with memory held to the tolerance
        weightings = [("", attention, None)]
        if token_s > 0 and attention is not None:
            token_work = token_s * np.asarray(spec.seqlens, dtype=float)
            weightings.append((",tokens", attention + token_work, token_work / np.maximum(attention + token_work, 1e-300)))
        weights, token_part = weightings[-1][1], weightings[-1][2]
        profiles = SequenceProfiles(spec)
        budget_eps = cfg.budget_ratio(spec.total_tokens, cluster.n_devices) - 1
        for suffix, w, part in weightings:
            for eps in epsilons:
                # memory stays within the budget; when the tokens' own work is scored, the compute
                # tolerance tightens it further (the linear layers wait for the device with the most)
                mem_eps = min(eps, budget_eps) if token_s > 0 else budget_eps
                pk = pack(spec, cluster, cfg.block_size, cfg.head_block_size, eps, mem_eps, w,
                          cfg.cost_model.profile.half_rows, part, overfill_whole=token_s == 0, profiles=profiles)
                if any(same_placement(c, pk.layout, pk.home) for c in out):
                    continue
                label = f"pack(eps={eps:g}{suffix})"
                out.append(evaluate(label, spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device,
                                    cfg.cost_model, self._stage_counts(), cfg.two_phase))
                groups[label] = (pk.groups, w, functools.partial(
                    pack, spec, cluster, head_block_size=cfg.head_block_size, epsilon=eps, epsilon_memory=mem_eps,
                    weights=w, half_extent=cfg.cost_model.profile.half_rows, token_share=part,
                    overfill_whole=token_s == 0, profiles=profiles))
        if aligned:
            pk = pack_aligned(spec, cluster, cfg.block_size, cfg.head_block_size, weights, token_part)
            if not any(same_placement(c, pk.layout, pk.home) for c in out):
                out.append(evaluate("pack(aligned)", spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device,
                                    cfg.cost_model, self._stage_counts(), cfg.two_phase))
                groups["pack(aligned)"] = (pk.groups, weights, None)
        return out, groups

    def _start_assign(self, spec, cluster, layout, tiles, partitioner, time_budget_s):
        """The two-level hypergraph placement of ``tiles`` with ``partitioner`` (``dcp.planner.assign.start_assign``),
        balancing exact work (FLOPs): the executors run each stage as one fused call whose speed depends on
        merged extents, not on how finely tiles are cut."""
        cfg = self.config
        # memory is balanced at two levels (nodes, then the GPUs of each): each gets the square root of the
        # budget's slack so that a device stays within it
        budget = cfg.budget_ratio(spec.total_tokens, cluster.n_devices)
        per_level = float(np.sqrt(max(budget, 1.0))) - 1 if cluster.nodes > 1 else budget - 1
        return start_assign(spec, layout, tiles, tiles.fwd_flops + tiles.bwd_flops, cluster.nodes,
                            cluster.gpus_per_node, partitioner, cfg.epsilon_inter, cfg.epsilon_intra,
                            max(per_level, 0.0), cfg.seed, time_budget_s)

    def _hypergraph(self, spec, cluster, layout, tiles, pending, notes: list[str], others: bool) -> Candidate:
        cfg = self.config
        try:
            placed = pending.result()
        except PartitionerError as err:
            # a timed-out or failed partitioner: the packings stand; alone, the greedy partition stands in
            msg = f"{cfg.partitioner.name}: {err}; the hypergraph candidate " + \
                ("was dropped" if others else "fell back to the greedy partitioner")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            notes.append(msg)
            if others:
                raise _Dropped from None
            placed = self._start_assign(spec, cluster, layout, tiles, GreedyPartitioner(), None).result()
        for note in placed.fallbacks:
            warnings.warn(note, RuntimeWarning, stacklevel=3)
        return evaluate("hypergraph", spec, cluster, layout, tiles, placed.home, placed.tile_device, cfg.cost_model,
                        self._stage_counts(), cfg.two_phase, placed.fallbacks)


class Search(NamedTuple):
    """What ``DCPPlanner.search`` found: the chosen candidate, every candidate scored, the notes (search,
    memory), the warm starts that entered, what was skipped, the memory budget and the final choice's
    per-candidate results (``dcp.planner.budget.pick``'s memo: transient peaks, simulated step times)."""

    best: Candidate
    cands: list
    notes: tuple[str, ...]
    memory_notes: tuple[str, ...]
    warm_names: tuple[str, ...]
    skipped: tuple[str, ...]
    budget: MemoryBudget
    memo: dict


#: candidates with more tiles than this are not rescheduled at other stage counts (``DCPPlanner._widen``)
WIDEN_MAX_TILES = 65536
#: candidates rescheduled at every stage count. A warm start's own schedule can be estimated well above dcp's
#: schedule of the same placement, so ranking by the former misses good placements: with two, adding
#: Megatron's static CP (ranked first at its own schedule) pushed out a Magi placement whose dcp schedule
#: wins (micro grid, LongAlign x2 causal, A100, batch 0)
WIDEN_TOP = 3
#: and this many of the estimated fastest in each direction alone
WIDEN_PER_DIRECTION = 2


class _Dropped(Exception):
    """Internal: the hypergraph candidate was dropped (its note is recorded)."""


def choose(cands: list[Candidate], cfg: PlannerConfig, budget: MemoryBudget | None = None, spec=None,
           cluster: Cluster | None = None, memo: dict | None = None, keep: tuple = ()) -> tuple[Candidate, list[str]]:
    """The candidate ``cfg.search`` asks for (``SearchConfig``) among those within the memory budget
    (``dcp.planner.budget``; ties go to the earlier candidate; with the time objective the fastest few by the
    estimate are simulated and the fastest simulated one wins, ``dcp.planner.budget.pick``), and the notes saying
    where it is over budget. ``keep``: candidates the final choice simulates wherever they rank (``pick``)."""
    notes: list[str] = []
    if budget is not None:
        cands, ok = within_tokens(cands, budget)
        if not ok:
            notes.append(token_note(cands[0], budget, cluster.n_devices))
    search = cfg.search
    cap = search.max_compute_imbalance
    if search.objective == "bytes":
        cap = cfg.compute_tolerance if cap is None else min(cap, cfg.compute_tolerance)
    fits = [c for c in cands if cap is None or c.compute_imbalance <= cap * (1 + 1e-9)]
    if not fits:
        ranked = sorted(cands, key=lambda c: c.compute_imbalance)
    elif search.objective == "bytes":  # the fewest bytes; within 3 % of them, the better balanced
        fewest = min(c.comm_bytes for c in fits)
        near = [c for c in fits if c.comm_bytes <= (1 + SLACK_COST) * fewest]
        ranked = sorted(near, key=lambda c: (c.compute_imbalance, c.comm_bytes))
    else:
        ranked = sorted(fits, key=lambda c: c.step_s(search.token_time_s))
    if budget is None:
        return ranked[0], notes
    simulate_top = search.simulate_top if search.objective == "time" else 0
    best, more = pick(ranked, budget, spec, cluster, cfg.cost_model, simulate_top, search.token_time_s, memo, keep)
    if not ok:
        notes[0] = token_note(best, budget, cluster.n_devices)
    return best, notes + more


def plan(spec: BatchSpec, cluster: Cluster, config: PlannerConfig | None = None, *, progress: bool = True) -> Plan:
    """Plan a batch with dcp's planner: ``dcp.plan(spec, cluster, config) -> Plan`` (validated).

    ``progress``: a call that runs past ``PROGRESS_AFTER_S`` seconds says so on stderr (``dcp.plan: planning
    ... ...`` then ``...: done in X s``), as the command line does; quick calls stay silent; False: never."""
    planner = DCPPlanner(config or PlannerConfig())
    if not progress:
        return planner.plan(spec, cluster)
    from dcp.report import progress as announce

    label = (f"dcp.plan: planning {spec.num_seqs} sequence{'s' * (spec.num_seqs != 1)} "
             f"({spec.total_tokens:,} tokens) for {cluster.n_devices} devices")
    with announce(label, after_s=PROGRESS_AFTER_S):
        return planner.plan(spec, cluster)


#: seconds after which ``plan`` says that it is still planning
PROGRESS_AFTER_S = 3.0
