"""Planner invariants on random batches, pinned tiny plans, named errors, fallbacks, serialization."""
import dataclasses
import time
import warnings

import numpy as np
import pytest
from _breakers import BREAKERS
from _budget import n_examples
from hypothesis import given, settings
from hypothesis import strategies as st

import dcp
from dcp import masks as M
from dcp.ir.validate_reference import validate_reference
from dcp.layout.blocks import pair_counts, uniform_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.partition import GreedyPartitioner, KaHyParPartitioner, MtKaHyParPartitioner, Partitioner

HYPERGRAPH_ONLY = dcp.SearchConfig(pack_epsilons=(), aligned_groups=False, warm_starts=())
GREEDY = dict(partitioner=GreedyPartitioner(), time_budget_s=None, search=HYPERGRAPH_ONLY)


def mask_strategy():
    return st.one_of(
        st.just(M.CausalMask()), st.just(M.FullMask()),
        st.builds(M.SlidingWindowMask, st.integers(1, 40)),
        st.builds(M.LambdaMask, st.integers(0, 8), st.integers(1, 40)),
        st.builds(M.SharedQuestionMask, st.floats(0.05, 0.9), st.integers(1, 5)),
        st.builds(M.CausalBlockwiseMask, st.integers(1, 16), st.integers(0, 3)),
        st.builds(M.ModalityMask, st.integers(1, 20), st.integers(1, 20)),
        st.builds(M.PrefixLMMask, st.floats(0.0, 1.0)),
    )


@st.composite
def batches(draw):
    n_seq = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(1, 300), min_size=n_seq, max_size=n_seq))
    kv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    heads = kv * group
    per_seq = draw(st.booleans())
    masks = draw(st.lists(mask_strategy(), min_size=n_seq, max_size=n_seq)) if per_seq else draw(mask_strategy())
    spec = dcp.BatchSpec(lens, masks, heads, kv, 16)
    divisors = [h for h in range(1, heads + 1) if heads % h == 0 and (h % group == 0 or group % h == 0)]
    hbs = draw(st.sampled_from(divisors))
    nodes = draw(st.integers(1, 4))
    gpn = draw(st.integers(1, 16))
    block = draw(st.sampled_from([3, 7, 16, 32, 64, 128]))
    return spec, dcp.Cluster(nodes, gpn), block, hbs


def dense_area(spec, seq):
    return int(M.ranges_to_dense(spec.kv_ranges(seq), spec.seqlens[seq]).sum())


@settings(max_examples=n_examples(40, 600))
@given(batches(), st.booleans())
def test_random_batches_give_valid_balanced_plans(case, two_phase):
    spec, cluster, block, hbs = case
    cfg = dcp.PlannerConfig(block_size=block, head_block_size=hbs, two_phase=two_phase, **GREEDY)
    plan = dcp.plan(spec, cluster, cfg)
    dcp.validate(plan)  # coverage, matching transfers, merges, deadlock freedom
    # tiles cover exactly the mask's non-empty area, sequence by sequence
    seq_of_tile = plan.layout.tb_seq[plan.tiles.q_tb]
    for s in range(spec.num_seqs):
        got = plan.tiles.unmasked[seq_of_tile == s].sum()
        assert got == dense_area(spec, s) * plan.layout.n_head_blocks
    assert (plan.tiles.unmasked > 0).all()
    # every tile's q and kv blocks belong to one sequence
    assert (plan.layout.tb_seq[plan.tiles.q_tb] == plan.layout.tb_seq[plan.tiles.kv_tb]).all()
    # balance: FLOPs per device within the two levels' caps, unless one tile alone exceeds it
    t = plan.tiles
    w = t.fwd_flops + t.bwd_flops
    load = np.bincount(plan.tile_device, weights=w, minlength=cluster.n_devices)
    bound = (1 + cfg.epsilon_inter) * (1 + cfg.epsilon_intra) * load.mean() + 2 * w.max() + 1e-12
    assert load.max() <= bound
    stats = plan.stats()
    assert stats.valid and stats.n_tiles == t.n_tiles
    assert stats.idle_devices >= 0 and stats.comm_bytes_total >= stats.comm_bytes_inter_node >= 0


@settings(max_examples=n_examples(40, 400))
@given(st.lists(st.integers(1, 200), min_size=1, max_size=3), mask_strategy(),
       st.lists(st.integers(1, 64), min_size=0, max_size=5))
def test_pair_counts_match_dense_mask(lens, mask, cuts):
    spec = dcp.BatchSpec(lens, mask, 2, 1, 8)
    for s, n in enumerate(lens):
        bounds = np.unique(np.clip(np.r_[0, np.cumsum(cuts, dtype=np.int64), n], 0, n)).astype(np.int64)
        counts = pair_counts(spec.kv_ranges(s), bounds)
        dense = M.ranges_to_dense(spec.kv_ranges(s), n)
        for i in range(bounds.size - 1):
            for j in range(bounds.size - 1):
                want = dense[bounds[i]:bounds[i + 1], bounds[j]:bounds[j + 1]].sum()
                assert counts[i, j] == want


def test_tiles_full_and_partial_classification():
    spec = dcp.BatchSpec([8], M.CausalMask(), 2, 1, 8)
    tiles = enumerate_tiles(spec, uniform_layout(spec, 4))
    # causal 8 tokens, B=4: (0,0) partial, (1,0) full, (1,1) partial
    assert list(zip(tiles.q_tb, tiles.kv_tb, tiles.full)) == [(0, 0, False), (1, 0, True), (1, 1, False)]
    assert list(tiles.unmasked) == [10, 16, 10]
    assert list(tiles.fwd_flops) == [4.0 * c * 8 * 2 for c in (10, 16, 10)]


def test_pinned_tiny_plan_with_greedy_partitioner():
    spec = dcp.BatchSpec([6, 2, 8], M.CausalMask(), 2, 1, 8, dtype="float32")
    plan = dcp.plan(spec, dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=4, **GREEDY))
    # blocks: seq0 [4, 2], seq1 [2], seq2 [4, 4]
    assert plan.layout.tb_len.tolist() == [4, 2, 2, 4, 4]
    assert plan.home.tolist() == [0, 0, 0, 1, 1]  # sequences stay whole: 8 tokens per device
    # balance is on FLOPs: seq 2 alone holds 36 of the 60 unmasked pairs, so one of its tiles moves
    assert plan.tile_device.tolist() == [0, 0, 1, 0, 0, 1, 1]
    pairs = np.bincount(plan.tile_device, weights=plan.tiles.unmasked, minlength=2)
    assert pairs.tolist() == [31, 29]
    again = dcp.plan(spec, dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=4, **GREEDY))
    assert again.forward == plan.forward and again.backward == plan.backward


@pytest.mark.parametrize("partitioner", [MtKaHyParPartitioner(preset="deterministic"), MtKaHyParPartitioner(),
                                         KaHyParPartitioner()], ids=["mt-deterministic", "mt-default", "kahypar"])
def test_real_partitioners_meet_balance_and_beat_greedy(partitioner):
    rng = np.random.default_rng(0)
    spec = dcp.BatchSpec(rng.integers(200, 3000, 12), M.CausalMask(), 4, 2, 32)
    cluster = dcp.Cluster(2, 4)
    greedy = dcp.plan(spec, cluster, dcp.PlannerConfig(block_size=128, **GREEDY)).stats()
    cfg = dcp.PlannerConfig(block_size=128, partitioner=partitioner, seed=1, search=HYPERGRAPH_ONLY)
    stats = dcp.plan(spec, cluster, cfg).stats()
    assert stats.valid
    assert stats.compute_imbalance <= 1.2
    assert stats.comm_bytes_total <= greedy.comm_bytes_total  # each split keeps the better of the two


def test_deterministic_preset_is_reproducible():
    spec = dcp.BatchSpec([900, 1500, 300, 2000], M.LambdaMask(16, 256), 4, 2, 32)
    cfg = dcp.PlannerConfig(block_size=128, partitioner=MtKaHyParPartitioner(preset="deterministic"), seed=3)
    a = dcp.plan(spec, dcp.Cluster(2, 2), cfg)
    b = dcp.plan(spec, dcp.Cluster(2, 2), cfg)
    assert (a.home == b.home).all() and (a.tile_device == b.tile_device).all()


def test_fewer_blocks_than_devices_leaves_idle_devices_or_refuses():
    spec = dcp.BatchSpec([100], M.CausalMask(), 2, 1, 8)
    plan = dcp.plan(spec, dcp.Cluster(2, 4), dcp.PlannerConfig(block_size=64, **GREEDY))
    assert plan.stats().idle_devices >= 8 - (2 + 3)  # 2 token blocks and 3 tiles occupy at most 5 devices
    with pytest.raises(dcp.TooFewBlocksError):
        dcp.plan(spec, dcp.Cluster(2, 4), dcp.PlannerConfig(block_size=64, allow_idle_devices=False, **GREEDY))


@pytest.mark.parametrize("make, error", [
    (lambda: dcp.BatchSpec([10, 0], M.CausalMask(), 2, 1, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([10, -3], M.CausalMask(), 2, 1, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([], M.CausalMask(), 2, 1, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([10.5], M.CausalMask(), 2, 1, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([10], M.CausalMask(), 6, 4, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([10], M.CausalMask(), 0, 1, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([10, 5], [M.CausalMask()], 2, 1, 8), dcp.InvalidBatchError),
    (lambda: dcp.BatchSpec([10], "no-such-mask", 2, 1, 8), (dcp.InvalidBatchError, dcp.InvalidMaskError)),
    (lambda: dcp.BatchSpec([10], M.CausalMask(), 2, 1, 8, dtype="int8"), dcp.InvalidBatchError),
    (lambda: dcp.PlannerConfig(block_size=0), dcp.InvalidConfigError),
    (lambda: dcp.PlannerConfig(block_size=-4), dcp.InvalidConfigError),
    (lambda: dcp.PlannerConfig(epsilon_intra=-0.1), dcp.InvalidConfigError),
    (lambda: dcp.PlannerConfig(partitioner="kahypar"), dcp.InvalidConfigError),
    (lambda: dcp.Cluster(0, 8), dcp.InvalidClusterError),
    (lambda: dcp.Cluster(2, -1), dcp.InvalidClusterError),
])
def test_bad_input_raises_named_error(make, error):
    with pytest.raises(error):
        make()


def test_ranges_outside_the_sequence_are_rejected():
    bad = np.zeros((4, 1, 2), dtype=np.int32)
    bad[:, 0, 1] = [1, 2, 3, 9]  # token 3 attends past the end
    with pytest.raises(dcp.InvalidMaskError):
        spec = dcp.BatchSpec([4], M.RangesMask(bad), 2, 1, 8)
        dcp.plan(spec, dcp.Cluster(1, 1), dcp.PlannerConfig(block_size=2, **GREEDY))


def test_head_block_size_must_divide_heads():
    spec = dcp.BatchSpec([64], M.CausalMask(), 8, 2, 8)
    with pytest.raises(dcp.InvalidConfigError):
        dcp.plan(spec, dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=16, head_block_size=3, **GREEDY))


class _FailingPartitioner(Partitioner):
    name = "failing"

    def partition(self, hg, k, max_block_weight, fixed, seed):
        raise RuntimeError("boom")


class _SlowPartitioner(Partitioner):
    name = "slow"

    def partition(self, hg, k, max_block_weight, fixed, seed):
        import time

        time.sleep(30)


def test_partitioner_timeout_falls_back_with_warning():
    spec = dcp.BatchSpec([500, 700], M.CausalMask(), 2, 1, 8)
    cfg = dcp.PlannerConfig(block_size=64, partitioner=_SlowPartitioner(), time_budget_s=0.5, search=HYPERGRAPH_ONLY)
    with pytest.warns(RuntimeWarning, match="budget"):
        plan = dcp.plan(spec, dcp.Cluster(1, 4), cfg)
    assert plan.stats().valid and any("fell back" in n for n in plan.notes)


def test_timed_out_partitioner_leaves_the_packings():
    """With packings to choose from, a partitioner past its budget only drops the hypergraph candidate."""
    spec = dcp.BatchSpec([500, 700], M.CausalMask(), 2, 1, 8)
    cfg = dcp.PlannerConfig(block_size=64, partitioner=_SlowPartitioner(), time_budget_s=0.5, epsilon_memory=0.5)
    with pytest.warns(RuntimeWarning, match="budget"):
        plan = dcp.plan(spec, dcp.Cluster(1, 4), cfg)
    assert plan.stats().valid and any("dropped" in n for n in plan.notes)
    assert plan.meta["search_chosen"].startswith(("pack", "warm")) and "hypergraph" not in plan.meta["search_candidates"]


def test_partitioner_failure_falls_back_with_warning():
    spec = dcp.BatchSpec([500, 700], M.CausalMask(), 2, 1, 8)
    cfg = dcp.PlannerConfig(block_size=64, partitioner=_FailingPartitioner(), time_budget_s=20, epsilon_memory=0.5)
    with pytest.warns(RuntimeWarning, match="boom"):
        plan = dcp.plan(spec, dcp.Cluster(1, 4), cfg)
    assert plan.stats().valid


def test_plan_bytes_round_trip_and_errors():
    spec = dcp.BatchSpec([300, 129, 40], [M.CausalMask(), M.LambdaMask(4, 32), M.FullMask()], 4, 2, 16)
    plan = dcp.plan(spec, dcp.Cluster(2, 2), dcp.PlannerConfig(block_size=32, **GREEDY))
    blob = plan.to_bytes()
    back = dcp.Plan.from_bytes(blob)
    assert back.forward == plan.forward and back.backward == plan.backward and back.spec == spec
    assert (back.home == plan.home).all() and (back.tile_stage == plan.tile_stage).all()
    dcp.validate(back)
    corrupt = bytearray(blob)
    corrupt[len(blob) // 2] ^= 0xFF
    for bad in (bytes(corrupt), blob[:40], b"not a plan at all, clearly", blob[:-4] + b"\0\0\0\0"):
        with pytest.raises(dcp.SerializationError):
            dcp.Plan.from_bytes(bad)
    future = bytearray(blob[:-4])
    future[8] = 99  # version field
    import struct
    import zlib

    future = bytes(future) + struct.pack("<I", zlib.crc32(bytes(future)))
    with pytest.raises(dcp.SerializationError, match="version"):
        dcp.Plan.from_bytes(future)


def test_mask_mod_masks_serialize_as_ranges():
    mm = M.MaskModMask(lambda q, k: (k <= q) & (q - k < 5))
    spec = dcp.BatchSpec([37], mm, 2, 1, 8)
    plan = dcp.plan(spec, dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=8, **GREEDY))
    back = dcp.Plan.from_bytes(plan.to_bytes())
    assert (back.spec.kv_ranges(0) == spec.kv_ranges(0)).all()


@pytest.fixture(scope="module")
def busy_plan():
    spec = dcp.BatchSpec([300, 200], M.CausalMask(), 2, 1, 8)
    return dcp.plan(spec, dcp.Cluster(2, 2), dcp.PlannerConfig(block_size=32, **GREEDY))


@pytest.mark.parametrize("breaker", BREAKERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_validator_rejects_broken_plans(busy_plan, breaker, direction):
    """Both validators refuse each kind of broken plan, on a dcp plan and a ring plan (relays, chains)."""
    from dcp.baselines import RingPlanner

    ring = RingPlanner().plan(busy_plan.spec, busy_plan.cluster)
    broken = [b for b in (breaker(p, direction) for p in (busy_plan, ring)) if b is not None]
    assert broken, f"nothing to break with {breaker.__name__} in the {direction}"
    for plan in broken:
        with pytest.raises(dcp.PlanValidationError):
            dcp.validate(plan)
        with pytest.raises(dcp.PlanValidationError):
            validate_reference(plan)


def test_validator_rejects_wrong_placement_arrays(busy_plan):
    moved = busy_plan.tile_device.copy()
    moved[0] = (moved[0] + 1) % busy_plan.n_devices
    with pytest.raises(dcp.PlanValidationError):
        dcp.validate(dataclasses.replace(busy_plan, tile_device=moved))


def test_two_phase_reduces_inter_node_bytes():
    rng = np.random.default_rng(5)
    spec = dcp.BatchSpec(rng.integers(500, 4000, 10), M.CausalMask(), 4, 2, 32)
    base = dict(block_size=128, partitioner=MtKaHyParPartitioner(preset="deterministic"), seed=0,
                search=HYPERGRAPH_ONLY)
    one = dcp.plan(spec, dcp.Cluster(2, 4), dcp.PlannerConfig(two_phase=False, **base)).stats()
    two = dcp.plan(spec, dcp.Cluster(2, 4), dcp.PlannerConfig(two_phase=True, **base)).stats()
    assert two.comm_bytes_inter_node <= one.comm_bytes_inter_node


def test_plan_warnings_are_not_emitted_on_the_happy_path():
    spec = dcp.BatchSpec([400, 300], M.CausalMask(), 2, 1, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcp.plan(spec, dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=64))


def test_auto_planner_keeps_the_fastest_simulated_candidate():
    from dcp.baselines import MegatronDynCPPlanner, ZigzagPlanner
    from dcp.planner.search import AutoPlanner

    spec = dcp.BatchSpec([3000, 700, 200, 90], M.CausalMask(), 4, 2, 32)
    auto = AutoPlanner(dcp.PlannerConfig(**GREEDY), block_sizes=(128, 512),
                       baselines=(ZigzagPlanner(), MegatronDynCPPlanner()))
    plan = auto.plan(spec, dcp.Cluster(2, 2))
    dcp.validate(plan)
    cands = plan.meta["candidates"]
    assert set(cands) == {"dcp@B128", "dcp@B512", "zigzag", "megatron_dyncp"}
    total = {k: v["forward_s"] + v["backward_s"] for k, v in cands.items()}
    assert plan.meta["chosen"] == min(total, key=total.get)
    assert plan.planner == f"dcp_auto:{plan.meta['chosen']}"


def test_a_batch_with_nothing_to_attend_is_refused():
    empty = M.RangesMask(np.zeros((3, 1, 2), dtype=np.int32))
    with pytest.raises(dcp.InvalidBatchError, match="no \\(query, key\\) pair"):
        dcp.plan(dcp.BatchSpec([3], empty, 1, 1, 4), dcp.Cluster(1, 2), dcp.PlannerConfig(block_size=2, **GREEDY))


def test_plan_says_it_is_planning_past_a_few_seconds(capsys, monkeypatch):
    import dcp.planner.dcp_planner as dp

    spec = dcp.BatchSpec([300, 120], M.CausalMask(), 4, 2, 8)
    cluster = dcp.Cluster(1, 2)
    cfg = dcp.PlannerConfig(block_size=32, partitioner=dcp.GreedyPartitioner(), time_budget_s=None)
    dcp.plan(spec, cluster, cfg)  # quick: silent
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(dp, "PROGRESS_AFTER_S", 0.0)  # every call is "long" now
    real = dp.DCPPlanner.plan

    def slow(self, s, c):  # the announcement comes from a timer thread: give it time to fire
        time.sleep(0.3)
        return real(self, s, c)

    monkeypatch.setattr(dp.DCPPlanner, "plan", slow)
    dcp.plan(spec, cluster, cfg)
    err = capsys.readouterr().err
    assert "dcp.plan: planning 2 sequences (420 tokens) for 2 devices ..." in err and ": done in" in err
    dcp.plan(spec, cluster, cfg, progress=False)
    assert capsys.readouterr().err == ""
