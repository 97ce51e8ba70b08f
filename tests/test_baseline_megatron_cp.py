"""Megatron's static CP (dcp.baselines.megatron_cp): fixed-size groups balanced by tokens, zigzag inside each,
its tuning grid and warm points, exact execution, and dcp's search containing it."""
import json

import numpy as np
import pytest

import dcp
from dcp.baselines import MegatronCPPlanner, ZigzagPlanner
from dcp.baselines.megatron_cp import token_groups
from dcp.errors import InvalidConfigError
from dcp.execute import ReferenceExecutor
from dcp.masks import CausalMask, LambdaMask

LENS = [900, 700, 420, 300, 260, 130, 64, 33]


def spec(lens=LENS, mask=None):
    return dcp.BatchSpec(lens, mask or CausalMask(), 4, 2, 16)


def test_token_groups_longest_first_onto_the_fewest_tokens():
    # 9 (seq 1) -> g0; 9 (seq 3) -> g1; 5 -> g0 (tie 9/9: the lowest); 4 -> g1; 1 -> g1 (13 tokens vs 14)
    assert token_groups([5, 9, 4, 9, 1], 2).tolist() == [0, 0, 1, 1, 1]
    assert token_groups([3, 3, 3], 3).tolist() == [0, 1, 2]
    lens = np.random.default_rng(0).integers(1, 1000, 50)
    g = token_groups(lens, 4)
    load = np.bincount(g, weights=lens, minlength=4)
    assert load.max() - load.min() <= lens.max()  # greedy LPT: within one sequence of each other


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_sizes_keep_each_sequence_inside_its_group(c):
    cluster = dcp.Cluster(2, 4)
    plan = MegatronCPPlanner(c).plan(spec(), cluster)
    assert plan.meta["valid"] and plan.meta["cp_size"] == c
    group = token_groups(LENS, 8 // c)
    lay = plan.layout
    for seq in range(len(LENS)):
        devs = set(plan.home[lay.seq_tb_ptr[seq]:lay.seq_tb_ptr[seq + 1]].tolist())
        assert devs <= set(range(group[seq] * c, (group[seq] + 1) * c))
    s = plan.stats()
    assert (s.comm_bytes_total == 0) == (c == 1)  # whole sequences per device move nothing


def test_all_devices_is_zigzag():
    cluster = dcp.Cluster(1, 4)
    a, b = MegatronCPPlanner().plan(spec(), cluster), ZigzagPlanner(shards=False).plan(spec(), cluster)
    assert (a.home == b.home).all() and (a.tile_device == b.tile_device).all()
    assert a.stats().comm_bytes_total == b.stats().comm_bytes_total


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(InvalidConfigError, match="cp_size must be a positive int"):
        MegatronCPPlanner(0)
    with pytest.raises(InvalidConfigError, match="cp_size must be a positive int"):
        MegatronCPPlanner(True)
    with pytest.raises(InvalidConfigError, match="cp_size 3 does not divide the 8 devices"):
        MegatronCPPlanner(3).plan(spec(), dcp.Cluster(2, 4))


def test_tuning_grid_and_warm_points():
    cluster = dcp.Cluster(2, 4)
    assert [p.cp_size for p in MegatronCPPlanner().tuning_grid(spec(), cluster)] == [1, 2, 4, 8]
    assert [p.cp_size for p in MegatronCPPlanner().tuning_grid(spec(), dcp.Cluster(3, 2))] == [1, 2, 6]
    total = sum(LENS)
    # sizes below 8 whose groups hold at most the budget per device; 8 (zigzag) is a warm start of its own
    fits = [c for c in (1, 2, 4) if np.bincount(token_groups(LENS, 8 // c), weights=LENS).max() / c <= total / 8 * 1.3]
    got = [p.cp_size for p in MegatronCPPlanner().warm_points(spec(), cluster, total / 8 * 1.3)]
    assert got == fits and 4 in got and 1 not in got  # a 900-token sequence on one device is over the budget
    assert MegatronCPPlanner(2).warm_points(spec(), cluster, 1.0) == (MegatronCPPlanner(2),)
    assert MegatronCPPlanner().warm_points(spec(), cluster, 1.0) == ()


def test_a_start_with_no_setting_in_budget_is_named_as_skipped():
    from dcp.planner.warm import warm_candidates

    cands, _, skipped, _ = warm_candidates(spec(), dcp.Cluster(2, 4), (MegatronCPPlanner(),), None, True, 10**6, 100.0)
    assert cands == [] and skipped == ["megatron_cp (no setting within the memory budget of 100 tokens)"]


@pytest.mark.parametrize("c", [2, 4])
def test_execution_is_exact_and_moves_data(c):
    """Forward and backward through the reference executor equal dense fp64 attention (groups smaller
    than the cluster; the all-device default runs in test_execute_baselines)."""
    torch = pytest.importorskip("torch")
    from dcp.execute import reference_attention

    sp = dcp.BatchSpec([300, 170, 90, 40], LambdaMask(sink=4, window=64), 4, 2, 8, dtype="float64")
    plan = MegatronCPPlanner(c).plan(sp, dcp.Cluster(2, 2))
    assert plan.stats().comm_bytes_total > 0
    g = torch.Generator().manual_seed(c)
    T = sp.total_tokens
    q, do = (torch.randn(T, 4, 8, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(T, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = reference_attention(*leaves, sp)
    grads_ref = torch.autograd.grad(o_ref, leaves, do)
    ex = ReferenceExecutor(kernels="auto")
    o, lse = ex.run_forward(plan, q, k, v)
    assert float((o - o_ref.detach()).abs().max()) < 1e-10
    for got, want in zip(ex.run_backward(plan, q, k, v, o, lse, do), grads_ref):
        assert float((got - want).abs().max()) < 1e-10


def test_dcp_search_starts_from_static_cp_and_is_never_slower():
    """With the non-attention work charged per token, dcp's estimate is at most the best static CP size's."""
    from dcp.cost import CostModel

    cost = CostModel.named("a100")
    cfg = dcp.PlannerConfig(block_size=128, cost_model=cost,
                            search=dcp.SearchConfig(token_time_s=2e-7, warm_starts=(MegatronCPPlanner(),)))
    plan = dcp.DCPPlanner(cfg).plan(spec(), dcp.Cluster(2, 4))
    assert plan.meta["valid"] and plan.meta["search_warm_starts"] == "megatron_cp(cp_size=4)"  # 1, 2: over budget
    cands = json.loads(plan.meta["search_candidates"])
    step = {k: c["forward_ms"] + c["backward_ms"] + 2e-4 * c["max_tokens"] for k, c in cands.items()}
    warm = [k for k in step if k.startswith("warm(megatron_cp(cp_size=4))")]
    assert warm and step[plan.meta["search_chosen"]] <= min(step[k] for k in warm) + 1e-3
