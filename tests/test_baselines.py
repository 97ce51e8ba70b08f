"""Tests of dcp.baselines: every static baseline emits valid plans in dcp's IR for many masks, clusters
and lengths, follows its algorithm's placement, and matches hand-computed tiny cases."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.baselines import (BASELINES, LoongTrainPlanner, MegatronCPPlanner, MegatronDynCPPlanner, RingPlanner,
                           TEA2AP2PPlanner, ZigzagPlanner)
from dcp.baselines.common import near_equal_chunks
from dcp.baselines.megatron_cp import token_groups
from dcp.baselines.megatron_dyncp import cp_size
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.instructions import CommLaunch
from dcp.ir.program import KIND, ROUND
from dcp.ir.stats import transfer_table
from dcp.ir.validate import validate
from dcp.layout.units import Kind, bytes_per_token
from dcp.masks import CausalMask, FullMask, LambdaMask, SharedQuestionMask
from dcp.schedule.assemble import Planner
from dcp.spec import BatchSpec

PLANNERS = [RingPlanner(), ZigzagPlanner(), TEA2AP2PPlanner(), MegatronCPPlanner(), MegatronDynCPPlanner(),
            LoongTrainPlanner()]
MASKS = [CausalMask(), FullMask(), LambdaMask(sink=2, window=5), SharedQuestionMask(question_frac=0.3, num_answers=2)]
CLUSTERS = [Cluster(1, 1), Cluster(1, 2), Cluster(1, 3), Cluster(2, 2), Cluster(2, 4), Cluster(4, 8)]
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _spec(lens, mask, heads=8, kv_heads=2):
    return BatchSpec(lens, mask, num_heads=heads, num_kv_heads=kv_heads, head_dim=16)


def _seq_tokens_per_device(plan, seq):
    lay = plan.layout
    lo, hi = lay.seq_tb_ptr[seq], lay.seq_tb_ptr[seq + 1]
    return np.bincount(plan.home[lo:hi], weights=lay.tb_len[lo:hi], minlength=plan.n_devices).astype(np.int64)


def check_plan(planner, plan, spec, cluster):
    """Validator, stats and each algorithm's placement rules."""
    validate(plan)
    assert plan.meta.get("valid") and plan.planner == planner.name
    s = plan.stats()
    assert s.valid and s.n_tiles == plan.tiles.n_tiles and s.n_devices == cluster.n_devices
    assert s.comm_bytes_total == s.comm_bytes_forward + s.comm_bytes_backward >= 0
    assert 0 <= s.comm_bytes_inter_node <= s.comm_bytes_total
    assert s.compute_imbalance >= 1 - 1e-9 and s.memory_imbalance >= 1 - 1e-9 and s.planning_time_s > 0
    if cluster.n_devices == 1:
        assert s.comm_bytes_total == 0
    if cluster.nodes == 1:
        assert s.comm_bytes_inter_node == 0
    p = cluster.n_devices
    if isinstance(planner, (RingPlanner, ZigzagPlanner, MegatronCPPlanner, MegatronDynCPPlanner)):
        assert (plan.tile_device == plan.home[plan.tiles.q_tb]).all()  # tiles run on their q block's home
        # no q-side traffic: Q/QG never move and O/dQ never leave home
        for direction in ("forward", "backward"):
            for dp in plan.program(direction):
                for ins in dp.instructions:
                    if isinstance(ins, CommLaunch):
                        assert all(u.kind in (Kind.KV, Kind.DKV) for u, _ in ins.sends)
    if isinstance(planner, (RingPlanner, ZigzagPlanner)):
        # KV relays and dKV chains move one hop along the ring; only a chain's last hop jumps home
        for direction in ("forward", "backward"):
            for dp in plan.program(direction):
                for ins in dp.instructions:
                    if isinstance(ins, CommLaunch):
                        for u, peer in ins.sends:
                            assert peer == (dp.device + 1) % p or (u.kind == Kind.DKV and peer == plan.home[u.tb])
    if isinstance(planner, RingPlanner):
        stage = (plan.tile_device - plan.home[plan.tiles.kv_tb]) % p
        assert (plan.tile_stage == stage).all()  # tile (q on d, kv from d-r) in stage r
        for seq, n in enumerate(spec.seqlens):
            want = np.diff((np.arange(p + 1) * n) // p)
            assert (_seq_tokens_per_device(plan, seq) == want).all()
    if isinstance(planner, ZigzagPlanner):
        assert (plan.tile_stage == (plan.tile_device - plan.home[plan.tiles.kv_tb]) % p).all()
        for seq, n in enumerate(spec.seqlens):
            chunk = np.diff((np.arange(2 * p + 1) * n) // (2 * p))
            want = chunk[:p] + chunk[p:][::-1]  # device d: chunks d and 2P-1-d
            assert (_seq_tokens_per_device(plan, seq) == want).all()
    if isinstance(planner, MegatronCPPlanner):
        c = plan.meta["cp_size"]
        group = token_groups(spec.seqlens, p // c)
        for seq, n in enumerate(spec.seqlens):  # zigzag inside the sequence's group, nothing elsewhere
            chunk = np.diff((np.arange(2 * c + 1) * n) // (2 * c))
            want = np.zeros(p, dtype=np.int64)
            want[group[seq] * c:(group[seq] + 1) * c] = chunk[:c] + chunk[c:][::-1]
            assert (_seq_tokens_per_device(plan, seq) == want).all()
    if isinstance(planner, MegatronDynCPPlanner):
        for seq, (base, cp) in enumerate(zip(plan.meta["cp_base"], plan.meta["cp_size"])):
            assert cp & (cp - 1) == 0 and base % cp == 0 and base + cp <= p
            tok = _seq_tokens_per_device(plan, seq)
            assert tok[:base].sum() == 0 and tok[base + cp:].sum() == 0
    if isinstance(planner, TEA2AP2PPlanner) and not plan.notes:
        g = plan.meta.get("head_parallel", cluster.gpus_per_node)  # the all-to-all group size
        want = plan.home[plan.tiles.q_tb] // g * g + plan.tiles.hb % g
        assert (plan.tile_device == want).all()
    return s


@pytest.mark.parametrize("cluster", CLUSTERS, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.name)
@pytest.mark.parametrize("planner", PLANNERS, ids=lambda p: p.name)
def test_fixed_batches_all_masks_and_clusters(planner, mask, cluster):
    spec = _spec([1, 2, 5, 13, 37], mask)
    check_plan(planner, planner.plan(spec, cluster), spec, cluster)


@pytest.mark.parametrize("cluster", CLUSTERS[1:], ids=str)
@pytest.mark.parametrize("planner", PLANNERS, ids=lambda p: p.name)
@SETTINGS
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=4), mask=st.sampled_from(MASKS),
       heads=st.sampled_from([(8, 2), (6, 3), (4, 4)]))
def test_random_lengths(planner, cluster, lens, mask, heads):
    if cluster.n_devices > 8:
        lens = [min(n, 48) for n in lens[:3]]  # keep the 32-device cases fast
    spec = _spec(lens, mask, *heads)
    check_plan(planner, planner.plan(spec, cluster), spec, cluster)


def test_registry():
    assert set(BASELINES) == {"ring", "zigzag", "te_a2a_p2p", "megatron_cp", "megatron_dyncp", "loongtrain", "torch_cp",
                              "ulysses", "magi", "magi_dynamic"}
    for name, cls in BASELINES.items():
        planner = cls()
        assert isinstance(planner, Planner) and planner.name == name


def test_near_equal_chunks():
    starts, idx = near_equal_chunks(10, 4)
    assert starts.tolist() == [0, 2, 5, 7] and idx.tolist() == [0, 1, 2, 3]
    starts, idx = near_equal_chunks(3, 4)  # fewer tokens than chunks: empty chunks are dropped
    assert starts.tolist() == [0, 1, 2] and idx.tolist() == [1, 2, 3]


def test_ring_tiny_pinned():
    """One causal sequence of 6 tokens on 1 node x 3 GPUs, worked out by hand."""
    spec = BatchSpec([6], CausalMask(), num_heads=4, num_kv_heads=2, head_dim=8)
    plan = RingPlanner().plan(spec, Cluster(1, 3))
    assert plan.home.tolist() == [0, 1, 2] and plan.layout.tb_len.tolist() == [2, 2, 2]
    tiles = {(int(q), int(k)): (int(d), int(s)) for q, k, d, s in
             zip(plan.tiles.q_tb, plan.tiles.kv_tb, plan.tile_device, plan.tile_stage)}
    assert tiles == {(0, 0): (0, 0), (1, 1): (1, 0), (2, 2): (2, 0), (1, 0): (1, 1), (2, 1): (2, 1), (2, 0): (2, 2)}
    # forward: KV0 0->1 (r1), 1->2 (r2, relay); KV1 1->2 (r1)
    fwd = sorted(map(tuple, transfer_table(plan, "forward")[:, :3].tolist()))
    assert fwd == [(0, 1, 1), (1, 2, 1), (1, 2, 2)]
    # backward: same inputs; dKV0 accumulates 1->2 (r3) then 2->0 (r4); dKV1 2->1 (r3)
    bwd = transfer_table(plan, "backward")
    assert sorted(map(tuple, bwd[:, :3].tolist())) == [(0, 1, 1), (1, 2, 1), (1, 2, 2), (1, 2, 3), (2, 0, 4), (2, 1, 3)]
    unit = 2 * bytes_per_token(spec, plan.layout)[Kind.KV]  # 2 tokens x (k + v) x 2 KV heads x 8 x bf16
    assert unit == 2 * 2 * 2 * 8 * 2
    s = plan.stats()
    assert s.comm_bytes_forward == 3 * unit and s.comm_bytes_backward == 6 * unit
    assert s.comm_bytes_total == 9 * unit and s.comm_bytes_inter_node == 0 and s.rounds_forward == 2


def test_ring_relays_only_as_far_as_needed():
    spec = _spec([40], CausalMask())
    plan = RingPlanner().plan(spec, Cluster(1, 4))
    # causal: chunk j is needed by devices j+1..3 only, so it makes 3-j hops (6 in all), never wrapping
    rows = transfer_table(plan, "forward")
    assert rows.shape[0] == 6 and (rows[:, 1] > rows[:, 0]).all()
    full = RingPlanner().plan(_spec([40], FullMask()), Cluster(1, 4))
    assert transfer_table(full, "forward").shape[0] == 4 * 3  # every chunk visits every other device


def test_ring_short_sequence_skips_devices_but_relays_hop_by_hop():
    spec = _spec([3], FullMask())
    plan = RingPlanner().plan(spec, Cluster(1, 5))
    assert plan.home.tolist() == [1, 3, 4]  # chunks of devices 0 and 2 are empty
    rows = transfer_table(plan, "forward")
    assert ((rows[:, 1] - rows[:, 0]) % 5 == 1).all()  # every hop goes to the next device


def test_zigzag_homes_16_tokens_4_devices():
    spec = _spec([16], CausalMask())
    plan = ZigzagPlanner().plan(spec, Cluster(1, 4))
    assert plan.layout.seq_bounds(0).tolist() == list(range(0, 17, 2))
    assert plan.home.tolist() == [0, 1, 2, 3, 3, 2, 1, 0]
    flops = np.bincount(plan.tile_device, weights=plan.tiles.fwd_flops, minlength=4)
    assert flops.max() / flops.min() < 1.2  # zigzag balances causal work


def test_megatron_cp_sizes():
    assert cp_size(5, 300, 8) == 1 and cp_size(300, 300, 8) == 1 and cp_size(301, 300, 8) == 2
    assert cp_size(1000, 300, 8) == 4 and cp_size(1000, 100, 8) == 8 and cp_size(1000, 100, 6) == 4
    with pytest.raises(InvalidConfigError):
        MegatronDynCPPlanner(max_seqlen_per_rank=0)


def test_megatron_short_sequences_need_no_communication():
    spec = _spec([10, 20, 7], CausalMask())
    plan = MegatronDynCPPlanner(max_seqlen_per_rank=64, version="2026.01").plan(spec, Cluster(1, 4))
    assert plan.meta["cp_size"] == [1, 1, 1] and plan.stats().comm_bytes_total == 0
    assert sorted(plan.meta["cp_base"]) == [0, 1, 2]  # spread over the least loaded devices


def test_megatron_dev_widens_a_group_when_it_lowers_the_maximum_load():
    # 1000² / 4 per device at the minimum group (4) is far above the balanced load: the dev scheduler
    # spreads the sequence over all 8 devices; the January release keeps 4 and leaves 2 devices idle
    spec = _spec([1000, 50, 40], CausalMask())
    old = MegatronDynCPPlanner(max_seqlen_per_rank=300, version="2026.01").plan(spec, Cluster(2, 4))
    new = MegatronDynCPPlanner(max_seqlen_per_rank=300).plan(spec, Cluster(2, 4))
    check_plan(MegatronDynCPPlanner(), new, spec, Cluster(2, 4))
    assert new.meta["cp_size"][0] == 8 and new.meta["version"] == "dev"
    load = lambda plan: max(n * n / cp for n, cp in zip(spec.seqlens, plan.meta["cp_size"]))  # noqa: E731
    assert load(new) < load(old)


def test_megatron_dev_fills_empty_devices():
    # three one-device sequences on 4 devices leave device 3 idle; fill_empty_gpus doubles the heaviest
    # sequence whose buddy group is empty (the one on device 2: device 3 is its buddy)
    from dcp.baselines.megatron_dyncp import _fill_empty

    lens = np.array([64, 60, 56])
    base, cps = np.array([0, 1, 2]), np.array([1, 1, 1])
    load, tokens = np.array([64.0**2, 60.0**2, 56.0**2, 0]), np.array([64.0, 60, 56, 0])
    _fill_empty(lens, base, cps, load, tokens, cap=4)
    assert cps.tolist() == [1, 1, 2] and base.tolist() == [0, 1, 2] and (tokens > 0).all()
    assert tokens.tolist() == [64, 60, 28, 28]
    # and in a plan: the dev scheduler leaves no device idle where the January release does
    spec = _spec([64, 60, 56], CausalMask())
    old = MegatronDynCPPlanner(max_seqlen_per_rank=64, version="2026.01").plan(spec, Cluster(1, 4))
    new = MegatronDynCPPlanner(max_seqlen_per_rank=64).plan(spec, Cluster(1, 4))
    held = lambda plan: np.bincount(plan.home, weights=plan.layout.tb_len, minlength=4)  # noqa: E731
    assert (held(old) == 0).sum() == 1 and (held(new) > 0).all()


def test_megatron_tuning_grid():
    spec = _spec([3000, 1000, 500], CausalMask())
    grid = MegatronDynCPPlanner().tuning_grid(spec, Cluster(1, 4))
    assert {p.version for p in grid} == {"dev", "2026.01"}
    assert {p.max_seqlen_per_rank for p in grid} == {512, 768, 1024, 1536, 2048, 3072, 4096, None}
    with pytest.raises(InvalidConfigError, match="version"):
        MegatronDynCPPlanner(version="2025")


def test_megatron_long_sequence_gets_power_of_two_group():
    spec = _spec([1000, 50, 40], CausalMask())
    cluster = Cluster(2, 4)
    plan = MegatronDynCPPlanner(max_seqlen_per_rank=300, version="2026.01").plan(spec, cluster)
    check_plan(MegatronDynCPPlanner(), plan, spec, cluster)
    assert plan.meta["cp_size"] == [4, 1, 1]
    base = plan.meta["cp_base"][0]
    assert base in (0, 4)
    tok = _seq_tokens_per_device(plan, 0)
    assert (tok[base:base + 4] == 250).all()  # zigzag: 2 chunks of 125 per device
    # the short sequences avoid the long one's group
    assert all(not base <= b < base + 4 for b in plan.meta["cp_base"][1:])
    assert plan.stats().comm_bytes_total > 0


def test_te_single_node_is_pure_ulysses():
    spec = _spec([37, 5], CausalMask())
    plan = TEA2AP2PPlanner().plan(spec, Cluster(1, 4))
    assert plan.layout.n_head_blocks == 4 and not plan.notes
    rows = transfer_table(plan, "forward")
    inputs = [(ins.round, u.kind) for dp in plan.program("forward") for ins in dp.instructions
              if isinstance(ins, CommLaunch) for u, _ in ins.sends]
    assert {r for r, k in inputs if k in (Kind.Q, Kind.KV)} == {1}  # the all-to-all, no ring
    tr = plan.forward.transfers  # the same in the columnar tables
    assert set(tr[np.isin(tr[:, KIND], [Kind.Q, Kind.KV]), ROUND].tolist()) == {1}
    assert rows.shape[0] > 0


def test_te_inter_node_ring_and_fallback():
    spec = _spec([64, 9], CausalMask())
    plan = TEA2AP2PPlanner().plan(spec, Cluster(2, 4))
    fwd = transfer_table(plan, "forward")
    cross = fwd[fwd[:, 0] // 4 != fwd[:, 1] // 4]
    assert (cross[:, 0] % 4 == cross[:, 1] % 4).all()  # the ring joins GPUs of the same local rank
    assert (fwd[fwd[:, 2] == 1][:, 0] // 4 == fwd[fwd[:, 2] == 1][:, 1] // 4).all()  # round 1: a2a in-node
    odd = _spec([64, 9], CausalMask(), heads=6, kv_heads=3)
    plan = TEA2AP2PPlanner().plan(odd, Cluster(2, 4))
    assert plan.notes and "fell back" in plan.notes[0] and plan.layout.n_head_blocks == 1


def test_te_warm_points_add_every_smaller_all_to_all_down_to_two_gpus():
    spec = _spec([64, 9], CausalMask())  # 8 query / 2 KV heads unless given
    te = TEA2AP2PPlanner(shards=False)
    assert te.warm_points(spec, Cluster(4, 8), 1e9) == (te, TEA2AP2PPlanner(False, 4), TEA2AP2PPlanner(False, 2))
    assert te.warm_points(spec, Cluster(2, 4), 1e9) == (te, TEA2AP2PPlanner(False, 2))
    assert te.warm_points(spec, Cluster(2, 2), 1e9) == (te,)  # half a node would be one GPU: a plain ring
    set_hp = TEA2AP2PPlanner(False, 2)
    assert set_hp.warm_points(spec, Cluster(4, 8), 1e9) == (set_hp,)
    odd = _spec([64, 9], CausalMask(), heads=6, kv_heads=3)  # no all-to-all over 4 (it falls back to a ring)
    assert te.warm_points(odd, Cluster(2, 4), 1e9) == (te,)
    six = _spec([64, 9], CausalMask(), heads=6, kv_heads=6)  # 6 GPUs a node: half is 3, a quarter no divisor
    assert te.warm_points(six, Cluster(2, 6), 1e9) == (te, TEA2AP2PPlanner(False, 3))
    for point in te.warm_points(spec, Cluster(2, 8), 1e9):
        validate(point.plan(spec, Cluster(2, 8)))


def test_loongtrain_degrees_and_double_ring():
    spec = _spec([64, 30], CausalMask())
    planner = LoongTrainPlanner()
    assert planner.degrees(spec, Cluster(2, 4)) == (2, 2)
    assert planner.degrees(spec, Cluster(4, 8)) == (4, 2)
    assert LoongTrainPlanner(head_parallel=1).degrees(spec, Cluster(2, 4)) == (1, 4)
    with pytest.raises(InvalidConfigError):
        LoongTrainPlanner(head_parallel=3).degrees(spec, Cluster(2, 4))
    with pytest.raises(InvalidConfigError):
        LoongTrainPlanner(head_parallel=1, inner_ring=3).degrees(spec, Cluster(2, 4))
    # double ring (inner rings inside nodes) crosses the network less than one flat ring
    cluster = Cluster(2, 4)
    double = LoongTrainPlanner(head_parallel=1).plan(spec, cluster).stats()
    flat = LoongTrainPlanner(head_parallel=1, inner_ring=1).plan(spec, cluster).stats()
    zig = ZigzagPlanner().plan(spec, cluster).stats()
    assert double.comm_bytes_inter_node < flat.comm_bytes_inter_node
    assert flat.comm_bytes_total == zig.comm_bytes_total  # one flat ring over all devices is zigzag


@pytest.mark.parametrize("cluster", [Cluster(1, 4), Cluster(2, 4), Cluster(4, 8), Cluster(3, 2)], ids=str)
@pytest.mark.parametrize("planner", PLANNERS, ids=lambda p: p.name)
def test_dkv_trees_match_their_reference(planner, cluster, monkeypatch):
    """The array dKV accumulation gives the programs the per-unit Python walk gives (random batches)."""
    from dcp.baselines import common

    rng = np.random.default_rng(cluster.n_devices)
    for trial in range(3):
        lens = rng.integers(1, 400, rng.integers(1, 6)).tolist()
        spec = _spec(lens, MASKS[trial % len(MASKS)])
        fast = planner.plan(spec, cluster)
        with monkeypatch.context() as m:
            m.setattr(common, "_dkv_trees", common._dkv_trees_reference)
            ref = planner.plan(spec, cluster)
        for direction in ("forward", "backward"):
            a, b = fast.columns(direction), ref.columns(direction)
            np.testing.assert_array_equal(a.tile_stage, b.tile_stage)
            np.testing.assert_array_equal(a.transfers, b.transfers)
            np.testing.assert_array_equal(a.merges, b.merges)


@pytest.mark.parametrize("planner", [TEA2AP2PPlanner(), LoongTrainPlanner(), MegatronDynCPPlanner()], ids=lambda p: p.name)
def test_every_tuning_grid_point_plans_validly(planner):
    spec = _spec([300, 120, 57, 9], CausalMask())
    cluster = Cluster(2, 4)
    grid = planner.tuning_grid(spec, cluster)
    assert len(grid) >= 2 and len({repr(p) for p in grid}) == len(grid)
    for p in grid:
        plan = p.plan(spec, cluster)
        check_plan(p, plan, spec, cluster)
        for key, value in p.knobs().items():
            if key in plan.meta and value is not None:
                assert plan.meta[key] == value


def test_te_head_parallel_knob():
    spec = _spec([64, 40], CausalMask())
    plan = TEA2AP2PPlanner(head_parallel=2).plan(spec, Cluster(2, 4))
    assert plan.meta["head_parallel"] == 2
    assert (plan.tile_device % 2 == plan.tiles.hb % 2).all()  # head block h runs on GPU h mod 2 of its group
    with pytest.raises(InvalidConfigError, match="head_parallel=3"):
        TEA2AP2PPlanner(head_parallel=3).plan(spec, Cluster(2, 4))
    with pytest.raises(InvalidConfigError):
        TEA2AP2PPlanner(head_parallel=0)


def test_stats_count_sequences_split_over_devices():
    from dcp.baselines import ZigzagPlanner

    spec = BatchSpec([64, 40, 3], CausalMask(), 4, 2, 8)
    cluster = Cluster(1, 4)
    # zigzag cuts every sequence into 2P chunks: the two long ones live on every device; the 3-token one on 3
    for planner in (ZigzagPlanner(shards=False), ZigzagPlanner(shards=True)):
        assert planner.plan(spec, cluster).stats().split_sequences == 3
    assert RingPlanner(shards=False).plan(spec, Cluster(1, 1)).stats().split_sequences == 0
