"""The memory budget every candidate of dcp's search is held to, the static plans it starts from, and the
searched block size (``dcp.planner.budget``, ``dcp.planner.warm``, ``dcp.planner.pack``)."""
import json
import warnings

import numpy as np
import pytest

import dcp
import dcp.masks as M
from dcp.baselines import MegatronDynCPPlanner, RingPlanner, TEA2AP2PPlanner, ZigzagPlanner, default_warm_planners
from dcp.cost import CostModel
from dcp.planner.pack import _clamp_cuts, _cut_shares, pack, sequence_profile, zigzag_cuts
from dcp.sim import simulate_both

CPU = CostModel.named("cpu_amd_epyc_2c")
FAST = dict(partitioner=dcp.GreedyPartitioner(), time_budget_s=None)


def _plan(spec, cluster, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dcp.plan(spec, cluster, dcp.PlannerConfig(**{**FAST, **kw}))
    return plan, [str(w.message) for w in caught if "memory budget" in str(w.message)]


def _tokens(plan):
    return np.bincount(plan.home, weights=plan.layout.tb_len, minlength=plan.n_devices)


CASES = [
    ([9000, 600, 300, 120], M.CausalMask(), dcp.Cluster(1, 4), 256),
    ([4000, 3000, 2500, 900, 64], M.LambdaMask(16, 256), dcp.Cluster(2, 2), 256),
    ([6144], M.SlidingWindowMask(384), dcp.Cluster(1, 2), 512),
    ([2000, 1500, 400, 300, 200], M.SharedQuestionMask(0.2, 3), dcp.Cluster(2, 4), 128),
    ([430, 300, 250, 200, 180, 160, 150, 120, 64], M.CausalMask(), dcp.Cluster(2, 4), 256),
]


@pytest.mark.parametrize("lens, mask, cluster, block", CASES)
def test_every_plan_keeps_resident_tokens_within_the_budget(lens, mask, cluster, block):
    spec = dcp.BatchSpec(lens, mask, 4, 2, 32)
    plan, notes = _plan(spec, cluster, block_size=block)
    tokens = _tokens(plan)
    assert not notes
    assert tokens.max() <= 1.1 * tokens.mean() + 1e-9
    assert plan.stats().memory_imbalance <= 1.1 + 1e-9
    assert plan.stats().max_resident_tokens == int(tokens.max())
    # every candidate the search compared reports its tokens; the chosen one is within the budget
    cands = json.loads(plan.meta["search_candidates"])
    assert cands[plan.meta["search_chosen"]]["max_tokens"] <= plan.meta["token_budget"]


def test_an_explicit_token_cap_is_the_budget_when_smaller():
    spec = dcp.BatchSpec([6000, 1000, 500, 300], M.CausalMask(), 4, 2, 32)
    plan, notes = _plan(spec, dcp.Cluster(1, 4), block_size=256, max_tokens_per_device=2000)
    assert not notes and _tokens(plan).max() <= 2000
    assert plan.meta["token_budget"] == 2000


def test_an_impossible_budget_warns_naming_the_device_or_raises_when_strict():
    spec = dcp.BatchSpec([100], M.CausalMask(), 2, 1, 16)
    plan, notes = _plan(spec, dcp.Cluster(1, 2), block_size=64, max_tokens_per_device=10)
    assert notes and "resident tokens within 10 per device" in notes[0] and "device" in notes[0]
    assert any("memory budget" in n for n in plan.notes)  # the plan says so too
    with pytest.raises(dcp.MemoryBudgetError, match="resident tokens"):
        dcp.plan(spec, dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=64, max_tokens_per_device=10,
                                                            strict_memory=True, **FAST))


def test_transient_buffers_are_budgeted_too():
    spec = dcp.BatchSpec([3000, 2000, 1000], M.CausalMask(), 4, 2, 32)
    free, _ = _plan(spec, dcp.Cluster(1, 4), block_size=256, transient_budget=None)
    peak = max(free.stats().peak_transient_bytes_forward, free.stats().peak_transient_bytes_backward)
    assert peak > 0  # the plan moves data, so there is something to budget
    tight, notes = _plan(spec, dcp.Cluster(1, 4), block_size=256, transient_budget=1e-6)
    assert notes and "transient buffers" in notes[0]
    with pytest.raises(dcp.MemoryBudgetError, match="transient"):
        dcp.plan(spec, dcp.Cluster(1, 4), dcp.PlannerConfig(block_size=256, transient_budget=1e-6,
                                                            strict_memory=True, **FAST))


@pytest.mark.parametrize("bad", [dict(max_tokens_per_device=0), dict(max_tokens_per_device=1.5),
                                 dict(transient_budget=0), dict(transient_budget="big"), dict(strict_memory=1)])
def test_bad_memory_settings_are_refused(bad):
    with pytest.raises(dcp.InvalidConfigError):
        dcp.PlannerConfig(**bad)


# ---------------------------------------------------------------------------------- static warm starts

ISSUE_CASES = [  # the like-for-like issue's cases, where a static plan beat dcp on this machine's profile
    ([3072, 1536, 256], M.LambdaMask(16, 256), 256),
    ([4096, 1024, 256, 128], M.CausalMask(), 512),
    ([6144], M.SlidingWindowMask(384), 512),
]


@pytest.mark.parametrize("lens, mask, block", ISSUE_CASES)
def test_dcp_is_never_slower_than_a_static_plan_it_starts_from(lens, mask, block):
    spec = dcp.BatchSpec(lens, mask, 4, 2, 64, dtype="float32")
    cluster = dcp.Cluster(1, 2)
    plan, _ = _plan(spec, cluster, block_size=block, cost_model=CPU)
    warm = plan.meta["search_warm_starts"].split(",")
    assert {"ring", "zigzag", "te_a2a_p2p", "megatron_dyncp"} <= set(warm)
    fwd, bwd = simulate_both(plan, CPU, record_events=False)
    mine = fwd.makespan_s + bwd.makespan_s
    planners = {p.label(): p for p in default_warm_planners()}  # several points of one grid have labels
    # and Megatron's packer capped at dcp's token budget
    planners.update({p.label(): p for p in [MegatronDynCPPlanner(int(plan.meta["token_budget"]))]})
    for name in warm:
        other = planners[name].plan(spec, cluster)
        if other.stats().memory_imbalance > 1.1 + 1e-9:
            continue  # outside dcp's memory budget: not a plan dcp may choose
        f, b = simulate_both(other, CPU, record_events=False)
        assert mine <= (f.makespan_s + b.makespan_s) * (1 + 1e-9), name


def test_warm_starts_are_skipped_above_their_tile_cap_and_can_be_turned_off():
    spec = dcp.BatchSpec([2000, 1000], M.CausalMask(), 8, 2, 32)
    cluster = dcp.Cluster(2, 4)
    assert TEA2AP2PPlanner().estimated_tiles(spec, cluster) == TEA2AP2PPlanner().plan(spec, cluster).tiles.n_tiles
    assert ZigzagPlanner().estimated_tiles(spec, cluster) == ZigzagPlanner().plan(spec, cluster).tiles.n_tiles
    capped, _ = _plan(spec, cluster, block_size=256, search=dcp.SearchConfig(warm_start_max_tiles=100))
    assert "zigzag" not in capped.meta["search_warm_starts"].split(",")
    assert "warm start zigzag (~" in capped.meta["search_skipped"]
    off, _ = _plan(spec, cluster, block_size=256, search=dcp.SearchConfig(warm_starts=()))
    assert off.meta["search_warm_starts"] == "" and "warm(" not in off.meta["search_candidates"]
    with pytest.raises(dcp.InvalidConfigError, match="warm_starts"):
        dcp.SearchConfig(warm_starts=("ring",))


def test_a_chosen_warm_start_is_its_static_plan_or_better_and_says_where_it_started():
    spec = dcp.BatchSpec([8192], M.CausalMask(), 4, 2, 64, dtype="float32")
    plan, _ = _plan(spec, dcp.Cluster(1, 2), block_size=1024, cost_model=CPU)
    cands = json.loads(plan.meta["search_candidates"])
    ring = RingPlanner().plan(spec, dcp.Cluster(1, 2))
    f, b = simulate_both(ring, CPU, record_events=False)
    # the warm start's estimate of its own schedule is the static plan's program, so it cannot be worse
    assert cands["warm(ring)"]["forward_ms"] + cands["warm(ring)"]["backward_ms"] > 0
    fwd, bwd = simulate_both(plan, CPU, record_events=False)
    assert fwd.makespan_s + bwd.makespan_s <= (f.makespan_s + b.makespan_s) * (1 + 1e-9)
    if plan.meta["search_chosen"].startswith("warm("):
        assert any("started from" in n for n in plan.notes)


# ------------------------------------------------------------------------------- packing caps, block size

def test_clamped_cuts_respect_member_caps_where_they_allow():
    xs = np.array([0, 70, 80, 100])  # member tokens 70, 10, 20 by work
    got = _clamp_cuts(xs, np.array([40.0, 40.0, 40.0]), 100, 1)
    assert np.diff(got).max() <= 40 and got[0] == 0 and got[-1] == 100 and (np.diff(got) >= 0).all()
    # zigzag pairs: member m takes 2 (x_m+1 - x_m) tokens, the last one the middle
    pairs = _clamp_cuts(np.array([0, 40, 45, 50]), np.array([30.0, 40.0, 40.0]), 100, 2)
    tok = [2 * (pairs[1] - pairs[0]), 2 * (pairs[2] - pairs[1]), 100 - 2 * pairs[2]]
    assert max(tok) <= 40 and sum(tok) == 100


def test_a_sliding_window_split_follows_the_token_caps():
    ranges = M.SlidingWindowMask(512).kv_ranges(4096)
    cuts, owner = zigzag_cuts(ranges, np.arange(4), np.full(4, 0.25), 256, token_caps=np.full(4, 1100.0))
    tokens = np.bincount(owner, weights=np.diff(cuts), minlength=4)
    assert tokens.sum() == 4096 and tokens.max() <= 1100
    free_cuts, free_owner = zigzag_cuts(ranges, np.arange(4), np.full(4, 0.25), 256)
    assert np.bincount(free_owner, weights=np.diff(free_cuts)).max() > 1100  # work alone would overfill member 0


def test_a_capped_members_shortfall_is_spread_over_the_members_after_it():
    # shared question: the first fifth (the question) is cheap per token, so the first member's token room
    # fills before it holds its share of the work; the work it could not take must not all land on the next
    ranges = M.SharedQuestionMask(0.2, 4).kv_ranges(16000)
    g, caps = 8, np.full(8, 1.1 * 16000 / 8)
    work = sequence_profile(ranges)[0]
    cuts, owner = zigzag_cuts(ranges, np.arange(g), np.full(g, 1 / g), 256, token_caps=caps)
    tokens = np.bincount(owner, weights=np.diff(cuts), minlength=g)
    assert tokens.sum() == 16000 and tokens.max() <= caps[0] + 1e-9
    share = _cut_shares(work, cuts, owner, np.arange(g))
    capped = tokens >= np.floor(caps) - 1
    assert capped[0] and share[0] < 0.5 / g  # the question's tokens fill its room: it took less than its share
    free = share[~capped]  # the members with room left share what the capped ones could not take, evenly
    assert free.size >= g - 2 and free.max() <= free.min() * 1.02
    # cutting without the re-targeting (the cumulative targets kept) piles the shortfall onto one member
    cum = np.concatenate([[0.0], np.cumsum(work / work.sum())])
    naive = np.maximum.accumulate(np.concatenate([[0], np.searchsorted(cum, np.arange(1, g) / g), [16000]]))
    naive_share = np.diff(cum[_clamp_cuts(naive, caps, 16000, 1)])
    assert naive_share.max() > free.max() * 1.15


def test_cut_shares_are_the_members_fractions_of_the_work():
    work = np.arange(1.0, 11.0)  # 10 tokens, work 1..10 (sum 55)
    bounds, owner = np.array([0, 3, 7, 10]), np.array([5, 2, 5])
    got = _cut_shares(work, bounds, owner, np.array([5, 2]))
    assert np.allclose(got, [(6 + 27) / 55, 22 / 55])
    # a token share spreads that part evenly: all of it gives the token fractions
    assert np.allclose(_cut_shares(work, bounds, owner, np.array([2, 5]), token_share=1.0), [0.4, 0.6])


def test_packings_split_a_short_sequence_that_fits_no_device():
    spec = dcp.BatchSpec([430, 120, 100, 90, 80], M.CausalMask(), 4, 2, 32)
    pk = pack(spec, dcp.Cluster(1, 4), 256, None, 0.0, 0.1)
    tokens = np.bincount(pk.home, weights=pk.layout.tb_len, minlength=4)
    assert tokens.max() <= 1.1 * tokens.mean() + 1e-9 and len(pk.groups[0]) > 1


def test_block_size_is_searched_and_can_be_fixed():
    spec = dcp.BatchSpec([12000, 3000, 2000, 700], M.CausalMask(), 4, 2, 64)
    cluster = dcp.Cluster(1, 4)
    kw = dict(block_size=512, search=dcp.SearchConfig(warm_starts=(), hypergraph=False))
    searched, _ = _plan(spec, cluster, **kw)
    cands = json.loads(searched.meta["search_candidates"])
    assert any(k.endswith(("@B256", "@B1024")) for k in cands)
    fixed, _ = _plan(spec, cluster, block_size=512, search=dcp.SearchConfig(warm_starts=(), hypergraph=False,
                                                                             block_size_factors=()))
    assert fixed.layout.tb_len.max() <= 512 and "@B" not in fixed.meta["search_candidates"]
    # the resized packings join the candidates the fixed search had (the choice polished, "/sim", is the choice's)
    fixed_cands = {k for k in json.loads(fixed.meta["search_candidates"]) if not k.endswith("/sim")}
    assert fixed_cands < {k for k in cands if not k.endswith("/sim")}
    with pytest.raises(dcp.InvalidConfigError, match="block_size_factors"):
        dcp.SearchConfig(block_size_factors=(0,))
