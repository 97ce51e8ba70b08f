"""Grouped layouts (``dcp.layout.pieces``): exact grouped tiles, grouped static baselines that validate, serialize,
simulate like their per-sequence plans and expand (``dcp.ir.expand``) into valid plans over their pieces."""
import dataclasses

import numpy as np
import pytest

import dcp
from dcp.baselines import BASELINES, RingPlanner, ZigzagPlanner, common
from dcp.cost import CostModel
from dcp.errors import InvalidConfigError, PlanValidationError, SerializationError
from dcp.ir.expand import expand_pieces
from dcp.ir.validate import validate
from dcp.ir.validate_reference import validate_reference
from dcp.layout.blocks import make_layout
from dcp.layout.pieces import group_layout, grouped_pair_counts, grouped_pair_counts_reference
from dcp.layout.tiles import enumerate_tiles
from dcp.masks import CausalMask, FullMask, LambdaMask, SharedQuestionMask
from dcp.sim import simulate

GROUPED = ("ring", "zigzag", "te_a2a_p2p", "loongtrain")


def _random_pieces(spec, rng, n_blocks):
    """Random contiguous pieces of every sequence, each in a random block (every block used)."""
    bounds = []
    for n in spec.seqlens:
        k = int(rng.integers(1, min(n, 6) + 1))
        cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False)) if k > 1 else np.zeros(0, int)
        bounds.append(np.r_[0, cuts, n])
    pieces = make_layout(spec, bounds, None)
    pb = rng.integers(0, n_blocks, size=pieces.n_token_blocks)
    pb[rng.permutation(pieces.n_token_blocks)[:n_blocks]] = np.arange(n_blocks)
    return pieces, pb


def _brute_force(spec, pieces, pb):
    """Per (q block, kv block): attended pairs, area, sequences, and the pair moments, from dense masks."""
    out = {}
    for s in range(spec.num_seqs):
        n = spec.seqlens[s]
        ranges = spec.kv_ranges(s)
        dense = np.zeros((n, n), dtype=bool)
        for t in range(n):
            for a, e in ranges[t]:
                dense[t, a:e] = True
        lo, hi = pieces.seq_tb_ptr[s], pieces.seq_tb_ptr[s + 1]
        block_of_token = np.repeat(pb[lo:hi], pieces.tb_len[lo:hi])
        for qb in np.unique(block_of_token):
            for kb in np.unique(block_of_token):
                rows, cols = block_of_token == qb, block_of_token == kb
                p = int(dense[np.ix_(rows, cols)].sum())
                if p:
                    tq, tk = int(rows.sum()), int(cols.sum())
                    acc = out.setdefault((int(qb), int(kb)), np.zeros(6))
                    acc += [p, tq * tk, 1, p / tq, p / tk, p / (tq * tk)]
    return out


MASKS = [CausalMask(), FullMask(), LambdaMask(sink=2, window=5), SharedQuestionMask(0.3, 2)]


@pytest.mark.parametrize("seed", range(4))
def test_grouped_counts_match_dense_masks(seed):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, 30, size=int(rng.integers(1, 5)))]
    masks = [MASKS[int(i)] for i in rng.integers(0, len(MASKS), size=len(lens))]
    spec = dcp.BatchSpec(lens, masks, 4, 2, 8)
    pieces, pb = _random_pieces(spec, rng, int(rng.integers(1, 4)))
    want = _brute_force(spec, pieces, pb)
    for fn in (grouped_pair_counts_reference, grouped_pair_counts):
        c = fn(spec, pieces, pb)
        keys = list(zip(c.q_block.tolist(), c.kv_block.tolist()))
        assert keys == sorted(want)
        got = np.stack([c.unmasked, c.area, c.sub_n, c.sub_wq, c.sub_wk, c.sub_wqk], 1)
        np.testing.assert_allclose(got, np.array([want[k] for k in keys]), rtol=1e-12)


def test_group_layout_refuses_bad_groupings():
    spec = dcp.BatchSpec([10, 6], CausalMask(), 4, 2, 8)
    pieces = make_layout(spec, [np.array([0, 5, 10]), np.array([0, 6])], None)
    with pytest.raises(InvalidConfigError, match="each holding at least one piece"):
        group_layout(pieces, np.array([0, 2, 2]))
    with pytest.raises(InvalidConfigError, match="one int per piece"):
        group_layout(pieces, np.array([0, 1]))
    lay = group_layout(pieces, np.array([1, 0, 0]))
    assert lay.grouped and lay.tb_len.tolist() == [11, 5]
    with pytest.raises(InvalidConfigError, match="ordinary"):
        group_layout(lay, np.array([0, 0]))


def _batch(mask=CausalMask(), lens=(100, 37, 64, 9, 3)):
    return dcp.BatchSpec(list(lens), mask, 4, 2, 16)


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_baseline_is_valid_and_expands_to_its_per_sequence_tiles(name):
    spec, cluster = _batch(), dcp.Cluster(2, 2)
    grouped = BASELINES[name](shards=True).plan(spec, cluster)
    fine = BASELINES[name](shards=False).plan(spec, cluster)
    assert grouped.layout.grouped and not fine.layout.grouped
    assert grouped.layout.n_token_blocks <= cluster.n_devices < fine.layout.n_token_blocks
    assert any("one token block" in n for n in grouped.notes)
    validate(grouped)
    validate_reference(grouped)  # the instruction-level validator agrees
    exp = expand_pieces(grouped)
    validate(exp)
    # the same pieces, homes and tiles as the per-sequence plan; only the schedule may differ
    np.testing.assert_array_equal(exp.layout.tb_len, fine.layout.tb_len)
    np.testing.assert_array_equal(exp.home, fine.home)
    np.testing.assert_array_equal(exp.tiles.unmasked, fine.tiles.unmasked)
    np.testing.assert_array_equal(exp.tile_device, fine.tile_device)
    assert grouped.tiles.unmasked.sum() == fine.tiles.unmasked.sum()
    for d in range(cluster.n_devices):
        np.testing.assert_array_equal(grouped.local_token_index(d), fine.local_token_index(d))
    np.testing.assert_array_equal(grouped.token_device(), fine.token_device())


def test_ring_forward_costs_the_same_grouped_or_per_sequence():
    """Ring's forward runs one tile per sequence per (device, stage) either way; the grouped moments charge
    each at its own extents, so the simulated forward is the per-sequence one."""
    spec, cluster = _batch(lens=(700, 300, 129, 64)), dcp.Cluster(2, 4)
    for profile in ("a100", "h100"):
        cost = CostModel.named(profile)
        got = simulate(RingPlanner(shards=True).plan(spec, cluster), cost, "forward").makespan_s
        want = simulate(RingPlanner(shards=False).plan(spec, cluster), cost, "forward").makespan_s
        assert got == pytest.approx(want, rel=1e-9)


def test_grouped_plan_round_trips_and_tampering_is_caught():
    plan = ZigzagPlanner(shards=True).plan(_batch(LambdaMask(sink=2, window=9)), dcp.Cluster(1, 4))
    blob = plan.to_bytes()
    back = dcp.Plan.from_bytes(blob)
    assert back.to_bytes() == blob and back.layout.grouped
    validate(back)
    with pytest.raises(SerializationError):
        dcp.Plan.from_bytes(blob[:-9])
    tiles = plan.tiles
    bad = dataclasses.replace(plan, tiles=dataclasses.replace(tiles, sub_wq=tiles.sub_wq * 1.01))
    with pytest.raises(PlanValidationError, match="sub_wq"):
        validate(bad)
    lay = plan.layout
    swapped = lay.piece_block.copy()
    i = int(np.flatnonzero(swapped != swapped[0])[0])
    swapped[[0, i]] = swapped[[i, 0]]
    bad = dataclasses.replace(plan, layout=dataclasses.replace(lay, piece_block=swapped))
    with pytest.raises(PlanValidationError):
        validate(bad)
    plain = dataclasses.replace(plan, tiles=dataclasses.replace(tiles, sub_n=None, sub_wq=None, sub_wk=None,
                                                                 sub_wqk=None))
    with pytest.raises(PlanValidationError, match="sub_n"):
        validate(plain)


def test_shards_auto_groups_only_large_plans(monkeypatch):
    spec, cluster = _batch(), dcp.Cluster(2, 2)
    assert not RingPlanner().plan(spec, cluster).layout.grouped
    monkeypatch.setattr(common, "SHARD_TILES", 10)
    assert RingPlanner().plan(spec, cluster).layout.grouped
    assert not RingPlanner(shards=False).plan(spec, cluster).layout.grouped
    with pytest.raises(InvalidConfigError, match="shards"):
        RingPlanner(shards="yes")


def test_expand_refuses_an_ordinary_plan():
    plan = RingPlanner().plan(_batch(), dcp.Cluster(1, 2))
    with pytest.raises(InvalidConfigError, match="grouped"):
        expand_pieces(plan)


def test_grouped_tiles_enumerate_in_tile_order():
    spec = _batch(SharedQuestionMask(0.3, 2))
    plan = RingPlanner(shards=True).plan(spec, dcp.Cluster(1, 3))
    t = enumerate_tiles(spec, plan.layout)
    key = (t.q_tb.astype(np.int64) * 4 + t.hb) * 1000 + t.kv_tb
    assert (np.diff(key) > 0).all()


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_plans_are_deterministic(name):
    spec, cluster = _batch(SharedQuestionMask(0.3, 2)), dcp.Cluster(2, 2)
    a, b = (BASELINES[name](shards=True).plan(spec, cluster) for _ in range(2))
    assert a.to_bytes() == b.to_bytes() and a.to_bytes(compress=True) == b.to_bytes(compress=True)
