"""Layer kinds: a batch with one mask per (sequence, layer kind), dcp's one placement for every kind, the
``LayeredPlan`` value (validation, serialization, stats) and its kinds' exactness against dense attention."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import dcp
from dcp.baselines import ZigzagPlanner
from dcp.errors import InvalidBatchError, InvalidPlanError
from dcp.ir.layered import LayeredPlan, select_kind
from dcp.layout.tiles import enumerate_tiles
from dcp.masks import CausalMask, SlidingWindowMask
from tests._dense import assert_matches_dense

KINDS = {"full": "causal", "sliding": SlidingWindowMask(64)}


def layered_spec(layers=None, dtype="float64", lens=(1500, 700, 300, 200)):
    return dcp.BatchSpec(list(lens), KINDS, 4, 2, 16, dtype, layers=layers or {"full": 2, "sliding": 3})


@pytest.fixture(scope="module")
def plan():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dcp.plan(layered_spec(), dcp.Cluster(1, 4), dcp.PlannerConfig(block_size=128), progress=False)


def test_spec_kinds_and_their_one_kind_batches():
    spec = layered_spec()
    assert spec.kinds == ("full", "sliding") and spec.layers == (2, 3) and spec.layered
    assert spec.masks == (CausalMask(),) * 4  # the first kind's
    sliding = spec.for_kind("sliding")
    assert not sliding.layered and sliding.masks == (SlidingWindowMask(64),) * 4
    assert spec.for_kind("sliding") is sliding  # cached
    assert dcp.BatchSpec.from_description(json.loads(json.dumps(spec.describe()))) == spec
    assert spec != dcp.BatchSpec(spec.seqlens, KINDS, 4, 2, 16, "float64", layers={"full": 2, "sliding": 4})
    one = dcp.BatchSpec([10], "causal", 2)
    assert not one.layered and one.kinds == () and one.layers == ()
    per_seq = dcp.BatchSpec([10, 20], {"a": ["causal", "full"], "b": "causal"}, 2)
    assert per_seq.for_kind("a").masks[1] == dcp.masks.FullMask() and per_seq.layers == (1, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(masks="causal", layers={"full": 1}), "layers= counts"),
    (dict(masks={}), "empty dict"),
    (dict(masks={"": "causal"}), "non-empty strings"),
    (dict(masks={"full": "causal"}, layers={"other": 1}), "layer count for every kind"),
    (dict(masks={"full": "causal"}, layers={"full": 0}), "positive int"),
    (dict(masks={"full": "causal"}, layers={"full": True}), "positive int"),
    (dict(masks={"full": ["causal"] * 3}), "layer kind 'full': got 3 masks for 2 sequences"),
    (dict(masks={"full": 3}), "layer kind 'full'"),
])
def test_spec_refuses_bad_layer_kinds(kwargs, match):
    with pytest.raises(InvalidBatchError, match=match):
        dcp.BatchSpec([10, 20], num_heads=2, **kwargs)


def test_unknown_kind_is_named():
    with pytest.raises(InvalidBatchError, match="no layer kind 'x'"):
        layered_spec().for_kind("x")


def test_one_placement_one_validated_plan_per_kind(plan):
    spec = layered_spec()
    assert isinstance(plan, LayeredPlan) and plan.kinds == spec.kinds and plan.spec == spec
    full, sliding = plan.kind("full"), plan.kind("sliding")
    for name, p in (("full", full), ("sliding", sliding)):
        assert p.spec == spec.for_kind(name) and p.meta["valid"]
        dcp.validate(p)
        # each kind's tiles are exactly those its masks give on the shared blocks
        want = enumerate_tiles(spec.for_kind(name), p.layout)
        got = sorted(zip(p.tiles.q_tb.tolist(), p.tiles.kv_tb.tolist(), p.tiles.hb.tolist()))
        assert got == sorted(zip(want.q_tb.tolist(), want.kv_tb.tolist(), want.hb.tolist()))
    for rank in range(4):
        assert np.array_equal(full.local_token_index(rank), sliding.local_token_index(rank))
        assert np.array_equal(plan.local_token_index(rank), full.local_token_index(rank))
    # the window attends fewer pairs (its blocks may be cut finer: ``kind_layout``, so not fewer tiles)
    assert sliding.tiles.fwd_flops.sum() < full.tiles.fwd_flops.sum()
    stats = plan.stats()
    assert set(stats) == {"full", "sliding"}
    # the plan crosses ranks, and the windowed layers move less than the full ones
    assert stats["full"].split_sequences >= 1 and stats["full"].comm_bytes_total > 0
    assert stats["sliding"].comm_bytes_total < stats["full"].comm_bytes_total
    assert plan.meta["layered_lead_kind"] in spec.kinds and plan.planning_time_s > 0


def test_layered_choice_is_no_worse_than_the_lead_kinds_own(plan):
    """The lead kind's own choice is among the scored placements: the chosen layer-weighted estimate is
    the least of them."""
    scored = json.loads(plan.meta["layered_candidates"])
    lead_plan = plan.kind(plan.meta["layered_lead_kind"])
    assert lead_plan.meta["search_chosen"] in scored
    assert plan.meta["est_step_ms"] == pytest.approx(min(scored.values()), abs=1e-4)
    assert scored[plan.meta["layered_chosen"]] == min(scored.values())


def test_sliding_heavy_model_picks_a_placement_at_least_as_good_for_its_windows():
    """With many windowed layers, the layered plan's sliding layers are estimated no slower than those of
    the placement chosen for the full layers alone."""
    spec = layered_spec(layers={"full": 1, "sliding": 12}, dtype="bfloat16", lens=(6000, 1000, 600, 400))
    cfg = dcp.PlannerConfig(block_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        both = dcp.plan(spec, dcp.Cluster(1, 4), cfg, progress=False)
        alone = dcp.plan(spec.for_kind("full"), dcp.Cluster(1, 4), cfg, progress=False)
    scored = json.loads(both.meta["layered_candidates"])
    assert alone.meta["search_chosen"] in scored
    assert both.meta["est_step_ms"] <= scored[alone.meta["search_chosen"]] + 1e-9


def test_every_kinds_schedules_are_polished_by_simulation(monkeypatch):
    """Each kind's schedules are re-chosen by simulation on the chosen placement (``dcp.planner.polish``): per
    kind and direction the plan simulates no slower than the same placement left as the estimate chose."""
    from dcp.cost import CostModel
    from dcp.planner import layered
    from dcp.sim import simulate_both

    spec = layered_spec(layers={"full": 1, "sliding": 12}, dtype="bfloat16", lens=(6000, 1000, 600, 400))
    cost = CostModel.named("a100")
    cfg = dcp.PlannerConfig(block_size=256, cost_model=cost)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        polished = dcp.plan(spec, dcp.Cluster(2, 2), cfg, progress=False)
        monkeypatch.setattr(layered, "polish", lambda best, *args: best)
        as_chosen = dcp.plan(spec, dcp.Cluster(2, 2), cfg, progress=False)
    assert polished.meta["layered_chosen"] == as_chosen.meta["layered_chosen"]
    for kind in spec.kinds:
        a, b = polished.kind(kind), as_chosen.kind(kind)
        assert np.array_equal(a.home, b.home) and np.array_equal(a.tile_device, b.tile_device)
        for got, was in zip(simulate_both(a, cost, record_events=False), simulate_both(b, cost, record_events=False)):
            assert got.makespan_s <= was.makespan_s * (1 + 1e-9)


def test_layered_finalists_polish_keeps_the_fastest(monkeypatch):
    """``dcp.planner.layered._polish_layered`` (invariant): the placement kept simulates (layers-weighted,
    every kind) no slower than the choice polished and than each of the next ``LAYERED_POLISH_FINALISTS``
    simulated finalists within ``LAYERED_POLISH_WITHIN`` of it, polished."""
    from dcp.cost import CostModel
    from dcp.planner import layered
    from dcp.planner.budget import _simulated_step_s, candidate_programs

    seen = {}
    orig = layered._polish_layered

    def spy(chosen, finalists, scored, specs, spec, cluster, cfg, budget):
        out = orig(chosen, finalists, scored, specs, spec, cluster, cfg, budget)
        seen.update(args=(chosen, finalists, scored, specs, spec, cluster, cfg, budget), out=out)
        return out

    monkeypatch.setattr(layered, "_polish_layered", spy)
    spec = layered_spec(layers={"full": 1, "sliding": 12}, dtype="bfloat16", lens=(6000, 1000, 600, 400))
    cfg = dcp.PlannerConfig(block_size=256, cost_model=CostModel.named("h100"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = dcp.plan(spec, dcp.Cluster(2, 2), cfg, progress=False)
    chosen, finalists, scored, specs, spec_, cluster, cfg_, budget = seen["args"]
    out = seen["out"]
    assert plan.meta["layered_chosen"] == out.per_kind[0].label

    def polished(s):
        return [layered.polish(c, [o.per_kind[i] for o in scored], specs[k], cluster, cfg_.cost_model, budget)
                for i, (k, c) in enumerate(zip(spec_.kinds, s.per_kind))]

    def step(per_kind):
        return sum(n * _simulated_step_s(candidate_programs(c, specs[k], cluster), c, cfg_.cost_model,
                                         cfg_.search.token_time_s)
                   for k, n, c in zip(spec_.kinds, spec_.layers, per_kind))

    mine = step(out.per_kind)
    first = step(polished(chosen))
    assert mine <= first * (1 + 1e-9)
    for sim, s in finalists[:layered.LAYERED_POLISH_FINALISTS]:
        if sim <= first * (1 + layered.LAYERED_POLISH_WITHIN):
            assert mine <= step(polished(s)) * (1 + 1e-9)


def test_serialization_round_trips(plan):
    data = plan.to_bytes()
    back = LayeredPlan.from_bytes(data)
    assert back.spec == plan.spec and back.to_bytes() == data
    for a, b in zip(plan.plans, back.plans):
        assert a.to_bytes() == b.to_bytes()
    for bad in (b"nope", data[:20], data[:-5], data[:8] + b"\x00" * 8):
        with pytest.raises(dcp.SerializationError):
            LayeredPlan.from_bytes(bad)


def test_every_kind_is_exact_against_dense_attention(plan):
    for p in plan.plans:
        assert_matches_dense(p, seed=3)


def test_plans_that_disagree_are_refused(plan):
    spec = plan.spec
    other = ZigzagPlanner().plan(spec.for_kind("sliding"), dcp.Cluster(1, 4))  # every sequence cut over all ranks
    assert not np.array_equal(other.local_token_index(0), plan.local_token_index(0))
    with pytest.raises(InvalidPlanError, match="homes differ|other masks"):
        LayeredPlan(spec, (plan.kind("full"), other))
    with pytest.raises(InvalidPlanError, match="one Plan per layer kind"):
        LayeredPlan(spec, (plan.kind("full"),))
    with pytest.raises(InvalidPlanError, match="other masks"):
        LayeredPlan(spec, (plan.kind("sliding"), plan.kind("full")))
    with pytest.raises(InvalidPlanError, match="layered BatchSpec"):
        LayeredPlan(spec.for_kind("full"), (plan.kind("full"),))


def test_static_planners_build_a_layered_plan_kind_by_kind_and_refuse_a_layered_batch():
    spec = layered_spec()
    cluster = dcp.Cluster(1, 4)
    with pytest.raises(InvalidBatchError, match="one layer kind at a time"):
        ZigzagPlanner().plan(spec, cluster)
    plans = tuple(ZigzagPlanner().plan(spec.for_kind(k), cluster) for k in spec.kinds)
    assert LayeredPlan(spec, plans).kind("sliding") is plans[1]


def test_select_kind(plan):
    assert select_kind(plan, "sliding") is plan.kind("sliding")
    with pytest.raises(InvalidPlanError, match="say which one"):
        select_kind(plan, None)
    with pytest.raises(InvalidPlanError, match="no layer kind 'x'"):
        select_kind(plan, "x")
    full = plan.kind("full")
    assert select_kind(full, None) is full
    with pytest.raises(InvalidPlanError, match="one layer kind"):
        select_kind(full, "full")


def test_validate_takes_a_layered_plan_and_names_the_kind_at_fault(plan):
    import dataclasses

    dcp.validate(plan)
    broken = dataclasses.replace(plan.kind("sliding"), tile_device=np.roll(plan.kind("sliding").tile_device, 1))
    bad = LayeredPlan.__new__(LayeredPlan)  # bypass the constructor's check: a plan corrupted after it was built
    object.__setattr__(bad, "spec", plan.spec)
    object.__setattr__(bad, "plans", (plan.kind("full"), broken))
    with pytest.raises(dcp.PlanValidationError, match="layer kind 'sliding'"):
        dcp.validate(bad)


def test_a_windowed_kind_moves_only_the_keys_its_neighbours_need():
    """Pinned: one 3,000-token sequence in two blocks on two devices; the windowed kind cuts the first
    block's last 127 keys off (window 128 reaches 127 keys back) and moves only them."""
    from dcp.layout.blocks import make_layout
    from dcp.planner.layered import kind_layout

    spec = dcp.BatchSpec([3000, 500], {"full": "causal", "sliding": SlidingWindowMask(128)}, 2)
    lead = make_layout(spec.for_kind("full"), [np.array([0, 2000, 3000]), np.array([0, 500])], None)
    layout, home = kind_layout(spec.for_kind("sliding"), lead, np.array([0, 1, 1]))
    assert layout.tb_len.tolist() == [1873, 127, 1000, 500] and home.tolist() == [0, 0, 1, 1]
    # every token keeps its home
    assert np.array_equal(np.repeat(home, layout.tb_len), np.repeat([0, 1, 1], lead.tb_len))
    # a causal kind on the same placement needs the whole block: nothing is cut
    same, _ = kind_layout(spec.for_kind("full"), lead, np.array([0, 1, 1]))
    assert same.tb_len.tolist() == lead.tb_len.tolist()
    # blocks on one device are never cut
    one, _ = kind_layout(spec.for_kind("sliding"), lead, np.array([0, 0, 1]))
    assert one.tb_len.tolist() == lead.tb_len.tolist()


def test_windowed_layers_move_a_fraction_of_the_full_layers_bytes(plan):
    full, sliding = plan.kind("full"), plan.kind("sliding")
    assert np.array_equal(full.token_device(), sliding.token_device())
    # the sliding kind's blocks subdivide the full kind's
    assert set(np.cumsum(full.layout.tb_len).tolist()) <= set(np.cumsum(sliding.layout.tb_len).tolist())
    st = plan.stats()
    assert 0 < st["sliding"].comm_bytes_total <= st["full"].comm_bytes_total / 4


def test_cli_plans_a_model_with_window_layers(tmp_path, capsys):
    from dcp.cli import main

    out = tmp_path / "plan.bin"
    assert main(["plan", "--lengths", "3000,800,200", "--sliding-window", "64", "--layer-counts", "3,9", "--nodes",
                 "1", "--gpus-per-node", "4", "--block-size", "256", "--planner", "all", "--json", "--output",
                 str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    dcp_rows = {r["layer_kind"]: r for r in rows if r["planner"].startswith("dcp[")}
    assert set(dcp_rows) == {"full", "sliding"} and dcp_rows["sliding"]["layers"] == 9
    assert all("speedup_vs_best_baseline" in r for r in dcp_rows.values())
    assert {r["planner"] for r in rows} >= {"zigzag[full]", "zigzag[sliding]"}
    back = LayeredPlan.from_bytes(out.read_bytes())
    assert back.spec.layers == (3, 9) and back.kind("sliding").spec.masks[0] == SlidingWindowMask(64)
    assert main(["plan", "--lengths", "3000", "--layer-counts", "3,9"]) != 0
    assert "--layer-counts counts the full and window layers" in capsys.readouterr().err
