"""The time-optimizing planner: packings, the relay scheduler, the makespan estimate, refinement and the
candidate search. Heuristics are tested by invariants plus a few pinned cases; the estimate against the
discrete-event simulator it stands in for."""
import dataclasses
import json

import numpy as np
import pytest
from _budget import n_examples
from hypothesis import given, settings
from hypothesis import strategies as st

import dcp
from dcp import masks as M
from dcp.cost import CostModel
from dcp.cost.estimate import estimate_makespan_s
from dcp.ir.serialize import execution_digest
from dcp.layout.blocks import uniform_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.partition import GreedyPartitioner
from dcp.planner.candidates import evaluate, tile_times
from dcp.planner.pack import pack, pack_aligned, zigzag_cuts
from dcp.planner.refine import refine_packing
from dcp.schedule.stages import schedule
from dcp.sim import simulate_both

A100 = CostModel.named("a100")
FAST = dict(partitioner=GreedyPartitioner(), time_budget_s=None)


def lognormal_lengths(seed: int, total: int, low: int = 64, high: int = 40000) -> list[int]:
    rng = np.random.default_rng(seed)
    out, left = [], total
    while left > 0:
        n = int(np.clip(rng.lognormal(7.5, 1.3), low, high))
        out.append(min(n, left))
        left -= out[-1]
    return out


# ------------------------------------------------------------------------------------------- packing

@settings(max_examples=n_examples(30, 300), deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=12), st.sampled_from([(1, 4), (2, 2), (2, 4)]),
       st.sampled_from([0.0, 0.1, 0.4]), st.sampled_from(["causal", "lambda", "full"]))
def test_packing_invariants(lens, shape, eps, mask):
    mk = {"causal": M.CausalMask(), "lambda": M.LambdaMask(8, 64), "full": M.FullMask()}[mask]
    spec = dcp.BatchSpec(lens, mk, 4, 2, 16)
    cluster = dcp.Cluster(*shape)
    pk = pack(spec, cluster, 256, None, eps, 0.1 + eps)
    lay = pk.layout
    # the layout covers every sequence exactly, every block has one home on the cluster
    assert int(lay.tb_len.sum()) == spec.total_tokens and (lay.tb_len > 0).all()
    assert pk.home.shape == (lay.n_token_blocks,) and 0 <= pk.home.min() and pk.home.max() < cluster.n_devices
    assert (pk.tile_device == pk.home[pk.tiles.q_tb]).all()  # q-stationary
    for s, group in enumerate(pk.groups):
        homes = set(pk.home[lay.seq_tb_ptr[s]:lay.seq_tb_ptr[s + 1]].tolist())
        assert homes <= set(group)
        if len(group) == 1:  # whole sequences are cut at the block size
            assert (lay.tb_len[lay.seq_tb_ptr[s]:lay.seq_tb_ptr[s + 1]] <= 256).all()
    # tiles cover the masks: the plan built on it validates
    plan = dcp.plan(spec, cluster, dcp.PlannerConfig(block_size=256, search=dcp.SearchConfig(
        pack_epsilons=(eps,), hypergraph=False, aligned_groups=False, refine_evaluations=0), **FAST))
    dcp.validate(plan)


def test_packing_keeps_sequences_whole_when_they_fit():
    spec = dcp.BatchSpec([1000, 1000, 1000, 1000], M.CausalMask(), 4, 2, 16)
    pk = pack(spec, dcp.Cluster(1, 4), 512, None, 0.0, 0.1)
    assert sorted(len(g) for g in pk.groups) == [1, 1, 1, 1]
    assert sorted(g[0] for g in pk.groups) == [0, 1, 2, 3]  # one sequence per device: nothing moves


def test_split_sequence_is_balanced_and_stays_in_a_node_when_it_can():
    spec = dcp.BatchSpec([40000, 2000, 2000, 2000, 2000], M.CausalMask(), 8, 2, 128)
    cluster = dcp.Cluster(2, 4)
    pk = pack(spec, cluster, 1024, None, 0.1, 0.5)
    load = np.bincount(pk.tile_device, weights=pk.tiles.fwd_flops, minlength=8)
    assert load.max() / load.mean() < 1.2
    members = pk.groups[0]
    assert len(members) > 1


def test_zigzag_cuts_balance_causal_work_and_tokens():
    ranges = M.CausalMask().kv_ranges(10000)
    members = np.arange(4)
    cuts, owner = zigzag_cuts(ranges, members, np.full(4, 0.25), block_size=1024)
    assert cuts[0] == 0 and cuts[-1] == 10000 and (np.diff(cuts) > 0).all() and (np.diff(cuts) <= 1024).all()
    work = (ranges[:, 0, 1] - ranges[:, 0, 0]).astype(float)
    per_member = np.zeros(4)
    tokens = np.zeros(4)
    for a, b, d in zip(cuts[:-1], cuts[1:], owner):
        per_member[d] += work[a:b].sum()
        tokens[d] += b - a
    assert per_member.max() / per_member.mean() < 1.01
    assert tokens.max() / tokens.mean() < 1.01  # a causal zigzag pair's work is proportional to its length
    # member 0 holds the first and the last tokens (the outermost pair)
    assert owner[0] == 0 and owner[-1] == 0


def test_aligned_packing_uses_power_of_two_groups_at_aligned_offsets():
    spec = dcp.BatchSpec([9000, 5000, 3000, 1000, 800, 600, 300], M.CausalMask(), 4, 2, 16)
    pk = pack_aligned(spec, dcp.Cluster(2, 4), 512, None)
    for g in pk.groups:
        size = len(g)
        assert size & (size - 1) == 0 and g[0] % size == 0 and list(g) == list(range(g[0], g[0] + size))


# ------------------------------------------------------------------------------------------ schedule

def _q_stationary_plan(spec, cluster, eps=0.1):
    return pack(spec, cluster, 1024, None, eps, 0.2)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_relays_spread_a_popular_unit_instead_of_a_star(direction):
    """One long causal sequence zigzagged over 8 GPUs behind a slow link, so rounds are capacity
    limited: early KV blocks are needed by everyone, and relays take their sending off the homes."""
    spec = dcp.BatchSpec([32768], M.CausalMask(), 8, 2, 128)
    cluster = dcp.Cluster(1, 8)
    slow = CostModel(dataclasses.replace(A100.profile, nvlink_gbps=4.0))
    pk = _q_stationary_plan(spec, cluster, 0.0)
    tt = tile_times(slow, pk.layout, pk.tiles, direction)
    relay = schedule(spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, tt, slow, direction, 8, True)
    star = schedule(spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, tt, slow, direction, 8, False)
    ins_relay, ins_star = relay.routes.inputs, star.routes.inputs
    # the same deliveries, but sources differ: relays take load off the homes
    assert ins_relay.shape == ins_star.shape
    home_src = pk.home[ins_relay[:, 1]]
    assert (ins_relay[:, 3] != home_src).any()
    assert (ins_star[:, 3] == pk.home[ins_star[:, 1]]).all()
    sends_relay = np.bincount(ins_relay[:, 3], minlength=8)
    sends_star = np.bincount(ins_star[:, 3], minlength=8)
    assert sends_relay.max() < sends_star.max()


def test_schedules_make_valid_plans_in_both_directions_and_differ_per_direction():
    spec = dcp.BatchSpec(lognormal_lengths(3, 60000), M.CausalMask(), 8, 2, 128)
    plan = dcp.plan(spec, dcp.Cluster(2, 4), dcp.PlannerConfig(**FAST))
    dcp.validate(plan)
    fwd = sum(1 for p in plan.program("forward") for i in p.instructions if type(i).__name__ == "Compute")
    bwd = sum(1 for p in plan.program("backward") for i in p.instructions if type(i).__name__ == "Compute")
    assert fwd > 0 and bwd > 0


def test_devices_without_late_transfers_run_at_most_two_fused_calls():
    """Whole sequences on every device and nothing to send after round 1: one call for local work."""
    spec = dcp.BatchSpec([3000, 3000, 3000, 3000], M.CausalMask(), 4, 2, 16)
    plan = dcp.plan(spec, dcp.Cluster(1, 4), dcp.PlannerConfig(**FAST))
    for direction in ("forward", "backward"):
        for p in plan.program(direction):
            assert sum(1 for i in p.instructions if type(i).__name__ == "Compute") <= 2


# ------------------------------------------------------------------------------------------ estimate

@settings(max_examples=n_examples(12, 120), deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["causal", "lambda"]), st.sampled_from([(1, 4), (2, 4), (4, 2)]),
       st.sampled_from([1, 2, 4, 8]))
def test_estimate_tracks_the_simulator(seed, mask, shape, stages):
    mk = M.CausalMask() if mask == "causal" else M.LambdaMask(64, 2048)
    spec = dcp.BatchSpec(lognormal_lengths(seed, 40000), mk, 8, 2, 128)
    cluster = dcp.Cluster(*shape)
    cfg = dcp.PlannerConfig(block_size=1024, search=dcp.SearchConfig(stage_counts=(stages,), refine_evaluations=0),
                            **FAST)
    plan = dcp.plan(spec, cluster, cfg)
    fwd, bwd = simulate_both(plan, A100, record_events=False)
    assert plan.meta["est_forward_ms"] == pytest.approx(fwd.makespan_s * 1e3, rel=0.25)
    assert plan.meta["est_backward_ms"] == pytest.approx(bwd.makespan_s * 1e3, rel=0.25)


def test_estimate_is_exact_without_communication():
    spec = dcp.BatchSpec([5000, 3000], M.CausalMask(), 8, 2, 128)
    cluster = dcp.Cluster(1, 2)
    pk = pack(spec, cluster, 1024, None, 0.5, 1.0)
    assert len(pk.groups[0]) == len(pk.groups[1]) == 1
    for direction in ("forward", "backward"):
        tt = tile_times(A100, pk.layout, pk.tiles, direction)
        sched = schedule(spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, tt, A100, direction, 4)
        assert sched.routes.inputs.size == 0
        est = estimate_makespan_s(spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, sched, A100)
        plan = dcp.schedule.assemble(spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, sched.tile_stage,
                                    sched.routes, "t", 0.0)
        sim = simulate_both(plan, A100, record_events=False)[0 if direction == "forward" else 1]
        assert est == pytest.approx(sim.makespan_s, rel=1e-9)


# ----------------------------------------------------------------------------------- search, refinement

def test_the_chosen_candidate_has_the_least_estimated_time():
    spec = dcp.BatchSpec(lognormal_lengths(5, 80000), M.CausalMask(), 8, 2, 128)
    # a loose memory budget (the hypergraph's 1024-token blocks fit its slack) and no transient limit: the
    # fastest candidate within the token budget is chosen
    cfg = dcp.PlannerConfig(epsilon_memory=0.5, transient_budget=None, **FAST)
    plan = dcp.plan(spec, dcp.Cluster(2, 4), cfg)
    cands = json.loads(plan.meta["search_candidates"])
    assert {"hypergraph", "pack(eps=0)", "warm(ring)", "warm(megatron_dyncp)"} <= set(cands)
    budget = plan.meta["token_budget"]
    total = {k: v["forward_ms"] + v["backward_ms"] for k, v in cands.items() if v["max_tokens"] <= budget}
    chosen = plan.meta["search_chosen"]
    assert total[chosen] == pytest.approx(min(total.values()))
    assert plan.stats().memory_imbalance <= 1.5 + 1e-9
    assert plan.meta["est_forward_ms"] + plan.meta["est_backward_ms"] == pytest.approx(total[chosen], rel=1e-4)


def test_bytes_objective_keeps_the_fewest_bytes_within_tolerance():
    spec = dcp.BatchSpec(lognormal_lengths(7, 50000), M.CausalMask(), 8, 2, 128)
    cfg = dcp.PlannerConfig(epsilon_inter=0.2, epsilon_intra=0.1, search=dcp.SearchConfig(objective="bytes"), **FAST)
    plan = dcp.plan(spec, dcp.Cluster(2, 4), cfg)
    cands = json.loads(plan.meta["search_candidates"])
    fits = {k: v["comm_bytes"] for k, v in cands.items() if v["compute_imbalance"] <= cfg.compute_tolerance + 1e-9}
    chosen = cands[plan.meta["search_chosen"]]
    assert chosen["comm_bytes"] <= 1.03 * min(fits.values())  # within 3 % of the fewest, the best balanced
    near = [v for k, v in cands.items() if k in fits and v["comm_bytes"] <= 1.03 * min(fits.values())]
    assert chosen["compute_imbalance"] == min(v["compute_imbalance"] for v in near)
    assert plan.stats().comm_bytes_total == cands[plan.meta["search_chosen"]]["comm_bytes"]
    assert plan.stats().compute_imbalance <= cfg.compute_tolerance + 1e-9


def test_max_compute_imbalance_is_respected():
    spec = dcp.BatchSpec(lognormal_lengths(9, 50000), M.CausalMask(), 8, 2, 128)
    cfg = dcp.PlannerConfig(search=dcp.SearchConfig(max_compute_imbalance=1.05), **FAST)
    plan = dcp.plan(spec, dcp.Cluster(2, 4), cfg)
    cands = json.loads(plan.meta["search_candidates"])
    if any(v["compute_imbalance"] <= 1.05 for v in cands.values()):
        assert plan.stats().compute_imbalance <= 1.05 + 1e-9


def test_default_planning_is_deterministic():
    spec = dcp.BatchSpec(lognormal_lengths(11, 70000), M.LambdaMask(64, 4096), 8, 2, 128)
    a = dcp.plan(spec, dcp.Cluster(2, 4))
    b = dcp.plan(spec, dcp.Cluster(2, 4))
    assert execution_digest(a) == execution_digest(b)
    assert a.meta["search_candidates"] == b.meta["search_candidates"]
    assert a.planning_time_s > 0 and a.to_bytes() == b.to_bytes()  # the timing is not part of the bytes


def test_refinement_never_makes_the_estimate_worse():
    spec = dcp.BatchSpec(lognormal_lengths(13, 30000, high=3000), M.CausalMask(), 16, 16, 128)
    cluster = dcp.Cluster(1, 8)
    from dcp.planner.candidates import sequence_times

    lay = uniform_layout(spec, 1024)
    weights = sequence_times(A100, lay, enumerate_tiles(spec, lay), spec.num_seqs)
    pk = pack(spec, cluster, 1024, None, 0.2, 0.3, weights, 256)
    cand = evaluate("p", spec, cluster, pk.layout, pk.tiles, pk.home, pk.tile_device, A100, (1, 2), True)
    refined = refine_packing(cand, pk.groups, weights, spec, cluster, A100, True, token_cap=1e12,
                             max_evaluations=8)
    assert refined.time_s <= cand.time_s
    moved = refined.home != cand.home
    if moved.any():  # only whole sequences moved, each entirely
        seq = pk.layout.tb_seq[moved]
        for s in np.unique(seq):
            assert len(pk.groups[s]) == 1
            assert len(set(refined.home[pk.layout.tb_seq == s].tolist())) == 1


@pytest.mark.parametrize("bad", [dict(objective="speed"), dict(pack_epsilons=(-0.1,)), dict(stage_counts=()),
                                 dict(stage_counts=(0,)),
                                 dict(pack_epsilons=(), hypergraph=False, aligned_groups=False, warm_starts=()),
                                 dict(max_compute_imbalance=0.5), dict(refine_evaluations=-1),
                                 dict(token_time_s=-1.0), dict(hypergraph="yes")])
def test_bad_search_config_is_refused(bad):
    with pytest.raises(dcp.InvalidConfigError):
        dcp.SearchConfig(**bad)


def test_token_time_balances_tokens_for_training_steps():
    """Scored with the non-attention work of each device's tokens, the chosen plan holds no more tokens
    on its busiest device than the attention-only choice."""
    spec = dcp.BatchSpec(lognormal_lengths(17, 60000), M.LambdaMask(64, 4096), 8, 2, 128)
    cluster = dcp.Cluster(2, 4)
    plain = dcp.plan(spec, cluster, dcp.PlannerConfig(**FAST))
    steps = dcp.plan(spec, cluster, dcp.PlannerConfig(search=dcp.SearchConfig(token_time_s=2e-6), **FAST))
    tokens = lambda p: np.bincount(p.home, weights=p.layout.tb_len, minlength=8).max()  # noqa: E731
    assert tokens(steps) <= tokens(plain)


def test_popular_key_positions_get_their_own_block():
    """A lambda mask's 64-token sink is read by every query: a split cuts a block boundary there."""
    from dcp.planner.pack import popular_boundaries

    ranges = M.LambdaMask(64, 512).kv_ranges(4096)
    assert 64 in popular_boundaries(ranges).tolist()
    assert popular_boundaries(M.CausalMask().kv_ranges(4096)).size == 0
    cuts, owner = zigzag_cuts(ranges, np.arange(4), np.full(4, 0.25), block_size=1024)
    assert 64 in cuts.tolist()
    # sliding-window work is even along the sequence: contiguous chunks, one per member
    assert (np.diff(owner) >= 0).all() and sorted(set(owner.tolist())) == [0, 1, 2, 3]


def test_hypergraph_candidate_coarsens_blocks_on_big_batches():
    spec = dcp.BatchSpec([40000], M.CausalMask(), 8, 2, 128)
    only = dict(pack_epsilons=(), aligned_groups=False, warm_starts=())
    cfg = dcp.PlannerConfig(search=dcp.SearchConfig(**only, hypergraph_max_tiles=500), **FAST)
    plan = dcp.plan(spec, dcp.Cluster(1, 4), cfg)
    assert plan.tiles.n_tiles <= 500 < dcp.plan(spec, dcp.Cluster(1, 4), dcp.PlannerConfig(
        search=dcp.SearchConfig(**only, hypergraph_max_tiles=0), **FAST)).tiles.n_tiles


def test_resize_reaches_the_best_packing_when_a_warm_start_is_chosen():
    """A warm start chosen over a packing may lose to that packing at another block size: the fastest packing
    within the token budget is rebuilt at the other block sizes."""
    from dcp.planner.budget import MemoryBudget
    from dcp.planner.dcp_planner import DCPPlanner

    @dataclasses.dataclass(frozen=True)
    class Fake:
        label: str
        time: float
        max_tokens: int = 100

        def step_s(self, token_time_s):
            return self.time

    build = object()
    packings = {"pack(eps=0)": ((), None, build), "pack(eps=0.1)": ((), None, build),
                "pack(aligned)": ((), None, None), "warm(magi)": ((), None, None)}
    budget = MemoryBudget(100, None)
    warm, p0, p1, aligned = Fake("warm(magi)", 1.0), Fake("pack(eps=0)", 1.05), Fake("pack(eps=0.1)", 1.02), \
        Fake("pack(aligned)", 1.0)
    planner = DCPPlanner(dcp.PlannerConfig(**FAST))
    lead = planner._resizable_lead
    assert lead(p0, [warm, p0, p1], packings, budget) is p0  # a packing chosen: itself
    assert lead(warm, [warm, p0, p1, aligned], packings, budget) is p1  # the fastest rebuildable packing
    far = Fake("pack(eps=0.1)", 1.5)
    assert lead(warm, [warm, far], packings, budget) is far  # however far its estimate at this block size
    assert lead(warm, [warm, aligned], packings, budget) is None  # no packing that can be rebuilt
    over = Fake("pack(eps=0.1)", 1.0, max_tokens=200)
    assert lead(warm, [warm, over], packings, budget) is None  # over the token budget
    no_sizes = DCPPlanner(dcp.PlannerConfig(search=dcp.SearchConfig(block_size_factors=()), **FAST))
    assert no_sizes._resizable_lead(p0, [p0], packings, budget) is None


def test_resized_and_earlier_choices_are_simulated_wherever_they_rank():
    """``pick``'s ``keep``: a candidate far down the estimate's ranking is still simulated, and chosen when it
    simulates fastest (new candidates must not push an earlier, faster-simulated choice out)."""
    from dcp.planner.budget import MemoryBudget, candidate_programs, pick

    spec = dcp.BatchSpec(lognormal_lengths(3, 30000), M.CausalMask(), 8, 2, 64)
    cluster = dcp.Cluster(1, 4)
    search = dcp.DCPPlanner(dcp.PlannerConfig(cost_model=A100, transient_budget=None, **FAST)).search(spec, cluster)
    sims = {id(c): sum(r.makespan_s for r in simulate_both(candidate_programs(c, spec, cluster), A100,
                                                            record_events=False)) for c in search.cands}
    ranked = sorted(search.cands, key=lambda c: c.time_s)
    budget = MemoryBudget(float("inf"), None)
    fastest = min(ranked, key=lambda c: sims[id(c)])
    alone, _ = pick(ranked, budget, spec, cluster, A100, simulate_top=2)
    kept, _ = pick(ranked, budget, spec, cluster, A100, simulate_top=2, keep=(fastest,))
    assert sims[id(kept)] == min(sims[id(alone)], sims[id(fastest)])
    last = ranked[-1]
    got, _ = pick(ranked, budget, spec, cluster, A100, simulate_top=2, keep=(last,))
    assert sims[id(got)] <= min(sims[id(ranked[0])], sims[id(last)]) * (1 + 1e-12)


def test_same_plan_needs_placement_and_both_schedules_alike():
    from dcp.planner.candidates import same_plan

    spec = dcp.BatchSpec(lognormal_lengths(3, 30000), M.CausalMask(), 8, 2, 64)
    search = dcp.DCPPlanner(dcp.PlannerConfig(cost_model=A100, **FAST)).search(spec, dcp.Cluster(1, 4))
    c = search.cands[0]
    assert same_plan(c, dataclasses.replace(c, label="twin"))
    moved = c.tile_device.copy()
    moved[0] = (moved[0] + 1) % 4
    assert not same_plan(c, dataclasses.replace(c, tile_device=moved))
    staged = c.backward.tile_stage.copy()
    staged[0] += 1
    assert not same_plan(c, dataclasses.replace(c, backward=dataclasses.replace(c.backward, tile_stage=staged)))
    others = [o for o in search.cands if o.label != c.label]
    assert all(not same_plan(c, o) for o in others if (o.forward_s, o.backward_s) != (c.forward_s, c.backward_s))


def test_a_twin_takes_no_simulation_slot():
    """``pick``: a plan ranked twice (two warm starts reaching one plan) is simulated once, and the next
    distinct plan takes the slot (with the twin simulated instead, a plan polished later could be left out:
    micro grid, LDC x2 causal, batch 1, H100)."""
    from dcp.planner.budget import MemoryBudget, pick

    spec = dcp.BatchSpec(lognormal_lengths(3, 30000), M.CausalMask(), 8, 2, 64)
    cluster = dcp.Cluster(1, 4)
    search = dcp.DCPPlanner(dcp.PlannerConfig(cost_model=A100, transient_budget=None, **FAST)).search(spec, cluster)
    first = min(search.cands, key=lambda c: c.time_s)
    twin = dataclasses.replace(first, label="twin")
    other = dataclasses.replace(first, label="other", forward_s=first.forward_s * 1.001)
    memo: dict = {}
    pick([first, twin, other], MemoryBudget(float("inf"), None), spec, cluster, A100, simulate_top=2, memo=memo)
    assert id(twin) not in memo
    assert memo[id(first)][1] is not None and memo[id(other)][1] is not None


def test_widening_schedules_each_directions_fastest(monkeypatch):
    """Placements whose own schedule is slow in one direction but among the ``WIDEN_PER_DIRECTION`` fastest in
    the other are rescheduled at every stage count even when ``WIDEN_TOP`` others are estimated faster overall
    (Magi's dynamic solver's placement, slow forward at its own overlap degree, won H100 shared-question
    batches once dcp scheduled its forward); over the token budget, not while others fit."""
    from types import SimpleNamespace

    import dcp.planner.dcp_planner as planner_mod
    from dcp.planner.budget import MemoryBudget

    def fake(label, fwd, bwd, max_tokens=100):
        return SimpleNamespace(label=label, forward_s=fwd, backward_s=bwd, max_tokens=max_tokens,
                               tiles=SimpleNamespace(n_tiles=10), stages=(4, 4),
                               step_s=lambda token_time_s, t=fwd + bwd: t)

    widened = []

    def record(cand, *args):
        widened.append(cand.label)
        return cand  # same stages: nothing is added

    monkeypatch.setattr(planner_mod, "widen", record)
    k = planner_mod.WIDEN_PER_DIRECTION
    top = [fake(f"warm(w{i})", 1.0, 2.0 + i / 10) for i in range(planner_mod.WIDEN_TOP)]
    fast_bwd = [fake(f"warm(b{i})", 1.5 + i, 1.9 - i / 100) for i in range(k)]   # slower overall than every top
    fast_fwd = [fake(f"warm(f{i})", 0.5 + i / 100, 3.0 + i) for i in range(k)]
    late = [fake("warm(next_bwd)", 9.0, 1.95), fake("warm(next_fwd)", 0.9, 9.0)]  # each direction's (k+1)-th
    over = fake("warm(over)", 0.1, 0.1, max_tokens=1000)
    planner = dcp.DCPPlanner(dcp.PlannerConfig(**FAST))
    out = planner._widen(None, None, [*top, *fast_bwd, *fast_fwd, *late, over], MemoryBudget(100, None), {})
    assert set(widened) == {c.label for c in (*top, *fast_bwd, *fast_fwd)}
    assert len(out) == len(top) + 2 * k + 3  # (over the budget, though fastest both ways: not widened)
