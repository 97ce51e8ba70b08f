"""PyTorch context parallelism (``TorchCPPlanner``: head-tail and PTRR balancers, KV all-gathered) and
DeepSpeed-Ulysses (``UlyssesPlanner``: all-to-all over heads): valid plans for many masks and clusters,
each algorithm's placement and routes (with hand-computed cases), exact attention forward and backward
through the reference executor, one run on 2 gloo ranks, and the knob errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dcp
from _dense import assert_matches_dense, dense_case
from _spawn import run_ranks
from dcp.baselines.common import near_equal_chunks
from dcp.baselines.torch_cp import TorchCPPlanner, ptrr_ranks
from dcp.baselines.ulysses import UlyssesPlanner
from dcp.errors import InvalidConfigError
from dcp.ir.validate import validate
from dcp.layout.units import Kind, bytes_per_token
from dcp.masks import CausalMask, FullMask, LambdaMask, SharedQuestionMask

MASKS = [CausalMask(), FullMask(), LambdaMask(sink=2, window=5), SharedQuestionMask(0.3, 2)]
CLUSTERS = [(1, 1), (1, 2), (1, 3), (2, 2), (2, 4), (4, 8)]
LENS = [37, 5, 21, 2]
TORCH_CP = [TorchCPPlanner(), TorchCPPlanner("ptrr", 4), TorchCPPlanner("ptrr", 8)]
# (query heads, KV heads) per device count for Ulysses: H % P == 0; P = 4, 8, 32 replicate KV heads
ULYSSES_HEADS = {1: (4, 2), 2: (4, 2), 3: (6, 3), 4: (4, 2), 8: (8, 2), 32: (32, 8)}
ids = lambda c: f"{c[0]}x{c[1]}"  # noqa: E731


def _spec(mask, lens=LENS, heads=4, kv_heads=2, dtype="float64"):
    return dcp.BatchSpec(list(lens), mask, heads, kv_heads, 8, dtype=dtype)


def _seq_tokens(plan, seq):
    lay = plan.layout
    lo, hi = lay.seq_tb_ptr[seq], lay.seq_tb_ptr[seq + 1]
    return np.bincount(plan.home[lo:hi], weights=lay.tb_len[lo:hi], minlength=plan.n_devices).astype(np.int64)


# ----------------------------------------------------------------------------- (1) valid plans
@pytest.mark.parametrize("cluster", CLUSTERS, ids=ids)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.name)
def test_plans_validate(mask, cluster):
    cl = dcp.Cluster(*cluster)
    spec = _spec(mask, dtype="bfloat16")
    for planner in TORCH_CP:
        plan = planner.plan(spec, cl)
        validate(plan)
        assert plan.meta["valid"] and plan.planner == "torch_cp"
        assert plan.meta["balancer"] == planner.balancer and plan.meta["block_size"] == planner.block_size
        if mask.name == "causal":  # the estimate bounds causal masks (Planner.estimated_tiles)
            assert planner.estimated_tiles(spec, cl) >= plan.tiles.n_tiles
        assert (plan.stats().comm_bytes_total > 0) == (cl.n_devices > 1)
    heads, kv = ULYSSES_HEADS[cl.n_devices]
    uspec = _spec(mask, heads=heads, kv_heads=kv, dtype="bfloat16")
    plan = UlyssesPlanner().plan(uspec, cl)
    validate(plan)
    assert plan.meta["heads_per_rank"] == heads // cl.n_devices
    if mask.name == "causal":
        assert UlyssesPlanner().estimated_tiles(uspec, cl) >= plan.tiles.n_tiles
    assert (plan.stats().comm_bytes_total > 0) == (cl.n_devices > 1)


# ------------------------------------------------------------------------ (2) placement and routes
def _check_all_gather(planner, spec, cl):
    """torch_cp: tiles on the q block's home; every KV unit reaches every other device once; inside a node
    straight from home in round 1, into a remote node once (round 1, to the GPU with the home's local
    index) and relayed there in round 2; tiles run in the round their KV arrives (local: stage 0); only
    dKV partials travel, home (through the remote node's entry GPU) after the last tile."""
    parts = planner.static_parts(spec, cl)
    home, tiles, routes, p, g = parts.home, parts.tiles, parts.routes, cl.n_devices, cl.gpus_per_node
    assert (parts.tile_device == home[tiles.q_tb]).all()
    ins, outs = routes.inputs, routes.outputs
    assert (ins[:, 0] == 1).all() and set(np.unique(ins[:, 5]).tolist()) <= {1, 2}
    n_units = parts.layout.n_token_blocks * parts.layout.n_head_blocks
    assert ins.shape[0] == n_units * (p - 1)  # every unit to every device but its home, once
    assert np.unique(ins[:, [1, 2, 4]], axis=0).shape[0] == ins.shape[0]
    src_home = home[ins[:, 1]]
    direct = ins[:, 3] == src_home
    assert (ins[direct & (ins[:, 3] // g != ins[:, 4] // g)][:, 4] % g == src_home[direct & (ins[:, 3] // g != ins[:, 4] // g)] % g).all()
    assert (ins[~direct][:, 3] // g == ins[~direct][:, 4] // g).all()  # relays stay inside a node
    assert (ins[direct][:, 5] == 1).all() and (ins[~direct][:, 5] == 2).all()
    arrival = {(int(tb), int(hb), int(d)): int(r) for tb, hb, d, r in ins[:, [1, 2, 4, 5]]}
    want = [0 if home[kv] == d else arrival[(int(kv), int(h), int(d))]
            for kv, h, d in zip(tiles.kv_tb, tiles.hb, parts.tile_device)]
    assert (parts.tile_stage == np.array(want)).all()
    assert (outs[:, 0] == 1).all()
    final = outs[outs[:, 4] == home[outs[:, 1]]]
    assert final.shape[0] >= np.unique(outs[:, [1, 2]], axis=0).shape[0]
    if cl.nodes == 1:
        assert (outs[:, 4] == home[outs[:, 1]]).all() and (outs[:, 5] == 3).all()
    return parts


@pytest.mark.parametrize("cluster", [(1, 2), (1, 3), (2, 4)], ids=ids)
def test_torch_cp_head_tail_placement(cluster):
    cl = dcp.Cluster(*cluster)
    p = cl.n_devices
    spec = _spec(CausalMask(), lens=[40, 13, 3])
    parts = _check_all_gather(TorchCPPlanner(), spec, cl)
    plan = TorchCPPlanner().plan(spec, cl)
    for s, n in enumerate(spec.seqlens):
        starts, chunk = near_equal_chunks(n, 2 * p)
        lo, hi = plan.layout.seq_tb_ptr[s], plan.layout.seq_tb_ptr[s + 1]
        assert (plan.layout.tb_start[lo:hi] - spec.cu_seqlens[s] == starts).all()
        assert (parts.home[lo:hi] == np.where(chunk < p, chunk, 2 * p - 1 - chunk)).all()
        sizes = np.diff(np.append(starts, n))
        want = np.zeros(p, dtype=np.int64)
        np.add.at(want, np.where(chunk < p, chunk, 2 * p - 1 - chunk), sizes)
        assert (_seq_tokens(plan, s) == want).all()  # rank i: chunks i and 2P-1-i


def test_torch_cp_head_tail_pinned():
    # [8, 3] on 2 ranks: 4 chunks each; 8 -> 2,2,2,2 on ranks 0,1,1,0; 3 -> chunks 1,2,3 of one token
    spec = _spec(CausalMask(), lens=[8, 3])
    plan = TorchCPPlanner().plan(spec, dcp.Cluster(1, 2))
    assert plan.layout.tb_start.tolist() == [0, 2, 4, 6, 8, 9, 10]
    assert plan.home.tolist() == [0, 1, 1, 0, 1, 1, 0]


def test_ptrr_deal_matches_published_examples():
    # PyTorch's ptrr_scheduling docstring: 16 tasks on 4 groups
    work = np.array([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    rank = ptrr_ranks(work, 4)
    groups = [sorted(np.flatnonzero(rank == g).tolist()) for g in range(4)]
    assert groups == [[3, 12, 13, 14], [2, 4, 7, 9], [1, 8, 11, 15], [0, 5, 6, 10]]
    # its document-causal example: documents of 4, 8 and 4 blocks on 2 ranks
    spec = _spec(CausalMask(), lens=[8, 16, 8])
    plan = TorchCPPlanner("ptrr", 2).plan(spec, dcp.Cluster(1, 2))
    assert plan.layout.n_token_blocks == 16
    assert np.flatnonzero(plan.home == 0).tolist() == [2, 3, 5, 6, 8, 11, 12, 13]


def test_ptrr_cuts_packed_blocks_at_sequences():
    # [3, 5] with 4-token blocks: packed blocks [0,4) [4,8); the first straddles both sequences and its
    # two pieces share its rank. Work (non-empty KV blocks per row): block 0 -> 1, block 1 -> 2; block 1
    # is dealt first (rank 0), block 0 second (rank 1)
    spec = _spec(CausalMask(), lens=[3, 5])
    cl = dcp.Cluster(1, 2)
    plan = TorchCPPlanner("ptrr", 4).plan(spec, cl)
    assert plan.layout.tb_start.tolist() == [0, 3, 4] and plan.layout.tb_len.tolist() == [3, 1, 4]
    assert plan.home.tolist() == [1, 1, 0]
    _check_all_gather(TorchCPPlanner("ptrr", 4), spec, cl)
    spec = _spec(LambdaMask(sink=2, window=5), lens=[37, 5, 21, 2])
    _check_all_gather(TorchCPPlanner("ptrr", 4), spec, dcp.Cluster(2, 2))
    # every rank gets one packed block of every round of the deal: block counts differ by at most one
    parts = TorchCPPlanner("ptrr", 4).static_parts(spec, dcp.Cluster(1, 3))
    packed, first = np.unique(parts.layout.tb_start // 4, return_index=True)
    assert packed.tolist() == list(range(-(-spec.total_tokens // 4)))
    counts = np.bincount(parts.home[first], minlength=3)
    assert counts.max() - counts.min() <= 1
    # the pieces of one packed block share its rank
    assert (parts.home == parts.home[first][np.searchsorted(packed, parts.layout.tb_start // 4)]).all()


def _check_ulysses(spec, cl):
    """Ulysses: shard i of the packed stream homed on rank i; head block h on rank h in stage 1; every
    (tb, h) unit of both sides not homed on h to h in round 1; partials of both sides home in round 3."""
    parts = UlyssesPlanner().static_parts(spec, cl)
    p, lay, home = cl.n_devices, parts.layout, parts.home
    token_home = np.repeat(home, lay.tb_len)
    start, shard = near_equal_chunks(spec.total_tokens, p)
    want = np.repeat(shard, np.diff(np.append(start, spec.total_tokens)))
    assert (token_home == want).all()
    assert (parts.tile_device == parts.tiles.hb).all() and lay.n_head_blocks == p
    assert (parts.tile_stage == (1 if p > 1 else 0)).all()
    ins, outs = parts.routes.inputs, parts.routes.outputs
    units = np.array([(s, tb, h) for s in (0, 1) for tb in range(lay.n_token_blocks) for h in range(p)
                      if home[tb] != h]).reshape(-1, 3)
    got = ins[np.lexsort((ins[:, 2], ins[:, 1], ins[:, 0]))]
    assert (got[:, :3] == units).all() and (got[:, 4] == got[:, 2]).all() and (got[:, 5] == 1).all()
    assert (got[:, 3] == home[got[:, 1]]).all()
    assert (outs[:, 3] == outs[:, 2]).all() and (outs[:, 4] == home[outs[:, 1]]).all() and (outs[:, 5] == 3).all()
    return parts


@pytest.mark.parametrize("cluster", [(1, 2), (2, 2), (2, 4)], ids=ids)
def test_ulysses_placement(cluster):
    cl = dcp.Cluster(*cluster)
    _check_ulysses(_spec(SharedQuestionMask(0.3, 2), heads=8, kv_heads=2), cl)


def test_ulysses_pinned():
    # [5, 3] on 2 ranks: shards [0,4) [4,8) -> blocks seq0 [0,4) on 0, seq0 [4,5) on 1, seq1 [0,3) on 1
    spec = _spec(CausalMask(), lens=[5, 3])
    parts = _check_ulysses(spec, dcp.Cluster(1, 2))
    assert parts.layout.tb_start.tolist() == [0, 4, 5] and parts.home.tolist() == [0, 1, 1]
    ins = parts.routes.inputs
    assert sorted(map(tuple, ins.tolist())) == [(0, 0, 1, 0, 1, 1), (0, 1, 0, 1, 0, 1), (0, 2, 0, 1, 0, 1),
                                                (1, 0, 1, 0, 1, 1), (1, 1, 0, 1, 0, 1), (1, 2, 0, 1, 0, 1)]


def test_ulysses_moves_what_deepspeed_moves():
    """8 query / 2 KV heads on 8 ranks: one query head per rank and a replica of its KV head. Per rank,
    every token not in its shard arrives as q (1 head) and KV (1 head) and leaves as o + lse; the
    bytes equal DeepSpeed's all-to-alls after KV-head replication: (P-1)·T tokens each way."""
    spec = _spec(CausalMask(), lens=[37, 5, 21, 2], heads=8, kv_heads=2, dtype="bfloat16")
    plan = UlyssesPlanner().plan(spec, dcp.Cluster(2, 4))
    assert plan.layout.kv_heads_per_block == 1 and plan.meta["kv_replication"] == 4
    bpt = bytes_per_token(spec, plan.layout)
    t, p, d = spec.total_tokens, 8, spec.head_dim
    assert bpt[Kind.KV] == 2 * d * 2  # k and v of one KV head in bf16
    st = plan.stats()
    assert st.comm_bytes_forward == (p - 1) * t * (bpt[Kind.Q] + bpt[Kind.KV] + bpt[Kind.O])
    assert st.comm_bytes_backward == (p - 1) * t * (bpt[Kind.QG] + bpt[Kind.KV] + bpt[Kind.DQ] + bpt[Kind.DKV])


# -------------------------------------------------------------------------------- (3) exactness


def _exact(plan):
    assert_matches_dense(plan, seed=11)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.name)
@pytest.mark.parametrize("planner", ["head_tail", "ptrr", "ulysses"])
def test_exact_attention(planner, mask):
    torch.set_num_threads(1)
    if planner == "ulysses":
        for cluster in ((1, 2), (2, 2)):  # 2x2: one query head per rank, KV heads replicated
            _exact(UlyssesPlanner().plan(_spec(mask), dcp.Cluster(*cluster)))
        return
    pl = TorchCPPlanner() if planner == "head_tail" else TorchCPPlanner("ptrr", 4)
    for cluster in ((1, 3), (2, 2)):
        _exact(pl.plan(_spec(mask), dcp.Cluster(*cluster)))


# ----------------------------------------------------------------------- (4) two gloo processes
DIST_LENS = (17, 23, 6, 1)  # the shard boundary (token 23) cuts the second sequence


def _dist_plans():
    spec = dcp.BatchSpec(list(DIST_LENS), [LambdaMask(sink=2, window=5), FullMask(), SharedQuestionMask(0.3, 2),
                                           CausalMask()], 4, 2, 8, dtype="float64")
    cl = dcp.Cluster(1, 2)
    return {"head_tail": TorchCPPlanner().plan(spec, cl), "ptrr": TorchCPPlanner("ptrr", 4).plan(spec, cl),
            "ulysses": UlyssesPlanner().plan(spec, cl)}


def _scenario_distributed(rank, world):
    out = {}
    for name, plan in _dist_plans().items():
        spec = plan.spec
        q, k, v, do, o_ref, g_ref = dense_case(spec, seed=5)
        sl = lambda x: dcp.dispatch(plan, rank, x)  # noqa: E731
        ql, kl, vl = (sl(x).requires_grad_() for x in (q, k, v))
        o = dcp.attention(ql, kl, vl, plan, timeout=20)
        o.backward(sl(do))
        err = lambda a, b: float((a - b).abs().max()) if a.numel() else 0.0  # noqa: E731
        out[name] = {"o": err(o.detach(), sl(o_ref.detach())), "dq": err(ql.grad, sl(g_ref[0])),
                     "dk": err(kl.grad, sl(g_ref[1])), "dv": err(vl.grad, sl(g_ref[2])), "n": int(ql.shape[0])}
    return out


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_two_gloo_ranks_match_dense(tmp_path):
    for plan in _dist_plans().values():  # the plans provably move data between the two ranks
        assert plan.stats().comm_bytes_total > 0
        assert any((_seq_tokens(plan, s) > 0).all() for s in range(plan.spec.num_seqs))
    results = run_ranks(_scenario_distributed, 2, tmp_path, deadline_s=120.0)
    for name in ("head_tail", "ptrr", "ulysses"):
        assert sum(r[name]["n"] for r in results) == sum(DIST_LENS)
        for rank, r in enumerate(results):
            errs = {k: r[name][k] for k in ("o", "dq", "dk", "dv")}
            assert max(errs.values()) < 1e-10, (name, rank, errs)


# ------------------------------------------------------------------------------- (5) bad knobs
@pytest.mark.parametrize("kwargs", [dict(balancer="ring"), dict(balancer=None), dict(block_size=0),
                                    dict(block_size=-128), dict(block_size=True), dict(block_size=1.5),
                                    dict(block_size="128")])
def test_torch_cp_bad_knobs(kwargs):
    with pytest.raises(InvalidConfigError, match="torch_cp"):
        TorchCPPlanner(**kwargs)


def test_ulysses_refuses_heads_it_cannot_split():
    with pytest.raises(InvalidConfigError, match="num_heads=4 is not divisible by the 3 devices"):
        UlyssesPlanner().plan(_spec(CausalMask()), dcp.Cluster(1, 3))
    # 12 query heads in groups of 4 over 2 ranks: 6 heads per rank split a group
    with pytest.raises(InvalidConfigError, match="GQA"):
        UlyssesPlanner().plan(_spec(CausalMask(), heads=12, kv_heads=3), dcp.Cluster(1, 2))


def test_tuning_grids():
    spec, cl = _spec(CausalMask()), dcp.Cluster(1, 2)
    assert TorchCPPlanner("ptrr", 64).tuning_grid(spec, cl) == (
        TorchCPPlanner("head_tail"), TorchCPPlanner("ptrr", 128), TorchCPPlanner("ptrr", 256))
    assert UlyssesPlanner().tuning_grid(spec, cl) == (UlyssesPlanner(),)
    assert TorchCPPlanner().knobs() == {"balancer": "head_tail", "block_size": 128}
