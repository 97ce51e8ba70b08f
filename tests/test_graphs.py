"""Captured programs (``dcp.execute.graphs``; ``DCPAttention(cuda_graphs=True)``) on the CPU, through the tape
stand-in of a CUDA graph: the capture makes no host synchronisation on data, and replaying the tape (no
executor Python runs) gives exactly what eager execution gives, for new inputs every time — on plans that cut
sequences over devices and move data, in one process and on 2 gloo ranks. The branch-free masked products
the capture uses agree with the branchy ones on inputs holding NaN and inf."""
from __future__ import annotations

import pytest
import torch
from _spawn import run_ranks

import dcp
from dcp.errors import ExecutionError, InvalidConfigError
from dcp.execute import ReferenceExecutor
from dcp.execute.graphs import CapturedProgram, GraphCache, HostSyncError, NoHostSync, TapeGraph
from dcp.integration import DCPAttention
from dcp.kernels import masked as km
from dcp.masks import CausalMask, SlidingWindowMask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MASKS = {"causal": CausalMask(), "sliding": SlidingWindowMask(16)}
CONFIG = dcp.PlannerConfig(block_size=16, partitioner=dcp.GreedyPartitioner(), time_budget_s=None, epsilon_memory=1.0,
                           search=dcp.SearchConfig(pack_epsilons=(), aligned_groups=False, warm_starts=()))


def _plan(mask: str, n: int, lens=(120, 45, 77)):
    spec = dcp.BatchSpec(list(lens), MASKS[mask], 4, 2, 16, dtype="float32")
    return dcp.plan(spec, dcp.Cluster(1, n), CONFIG)


def _same_as_eager(graphed, eager, plan, q, k, v, do) -> bool:
    """Whether ``graphed`` gives exactly ``eager``'s o, dq, dk and dv (forward and backward through autograd)."""
    res = []
    for mod in (graphed, eager):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = mod(*leaves, plan)
        o.backward(do)
        res.append((o.detach(), *(x.grad for x in leaves)))
    return all(torch.equal(a, b) for a, b in zip(*res))


def _qkv(spec, seed: int, extra: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = spec.total_tokens
    return [torch.randn(t, h, spec.head_dim, generator=g) for h in (4, 2, 2) + (4,) * extra]


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_tape_replay_equals_eager_on_every_device(mask):
    plan = _plan(mask, 4)
    assert plan.stats().split_sequences > 0 and plan.stats().comm_bytes_total > 0  # data moves between devices
    ex = ReferenceExecutor(kernels="reference")
    fwd = CapturedProgram(lambda st: ex.run_forward(plan, *st), _qkv(plan.spec, 0), "tape")
    q, k, v = _qkv(plan.spec, 1)
    o, lse = ex.run_forward(plan, q, k, v)
    bwd = CapturedProgram(lambda st: ex.run_backward(plan, *st), (q, k, v, o, lse, torch.randn_like(q)), "tape")
    assert fwd.graph.n_ops > 100 and bwd.graph.n_ops > 100
    for seed in (2, 3, 4):
        q, k, v, do = _qkv(plan.spec, seed, extra=1)
        want_o, want_lse = ex.run_forward(plan, q, k, v)
        got_o, got_lse = fwd((q, k, v))
        assert torch.equal(got_o, want_o) and torch.equal(got_lse, want_lse)
        want = ex.run_backward(plan, q, k, v, want_o, want_lse, do)
        got = bwd((q, k, v, want_o, want_lse, do))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert fwd.replays == 3 and bwd.replays == 3
    # the outputs are clones: a later replay does not change what an earlier call returned
    first, _ = fwd(_qkv(plan.spec, 5))
    keep = first.clone()
    fwd(_qkv(plan.spec, 6))
    assert torch.equal(first, keep)


def test_replay_refuses_other_shapes():
    plan = _plan("causal", 2)
    ex = ReferenceExecutor(kernels="reference")
    prog = CapturedProgram(lambda st: ex.run_forward(plan, *st), _qkv(plan.spec, 0), "tape")
    q, k, v = _qkv(plan.spec, 1)
    with pytest.raises(ExecutionError, match="capture's shapes"):
        prog((q.double(), k, v))
    with pytest.raises(ExecutionError, match="backend"):
        CapturedProgram(lambda st: st, [q], "xla")


# ------------------------------------------------------------------------------------------ host syncs
@pytest.mark.parametrize("read", ["item", "bool", "tolist", "nonzero", "int", "branch"])
def test_a_host_read_of_data_is_refused_during_capture(read):
    x = torch.randn(8)
    table = torch.arange(4)  # host metadata: reading it is fine

    def program(st):
        y = st[0] * 2 + 1
        assert int(table[2]) == 2 and table.tolist()[3] == 3
        if read == "item":
            y.sum().item()
        elif read == "bool":
            bool((y > 0).all())
        elif read == "tolist":
            y.tolist()
        elif read == "nonzero":
            torch.nonzero(y > 0)
        elif read == "int":
            int(y[0])
        else:
            y = y * 3 if y.sum() > 0 else y  # a data-dependent Python branch
        return (y,)

    with pytest.raises(HostSyncError, match="captured program"):
        CapturedProgram(program, [x], "tape")


def test_data_is_tracked_through_in_place_writes_and_views():
    x = torch.randn(6)
    buf = torch.zeros(12)
    with pytest.raises(HostSyncError):
        with NoHostSync([x]):
            buf[3:9].copy_(x)  # written through a view: the whole storage now holds data
            float(buf[0])
    with NoHostSync([x]):  # a fresh allocation holds no data
        fresh = torch.zeros(3)
        assert float(fresh[0]) == 0.0


def test_tape_replays_transfers_registered_with_call():
    log = []
    tape = TapeGraph()
    x = torch.ones(3)
    with tape.capture():
        y = x + 1
        tape.call(lambda: log.append("posted"))
        z = y * 2
    x.fill_(5.0)
    tape.replay()
    assert log == ["posted"] and torch.equal(z, torch.full((3,), 12.0))
    with pytest.raises(ExecutionError, match="once"):
        with tape.capture():
            pass
    with pytest.raises(ExecutionError, match="before capture"):
        TapeGraph().replay()


# ------------------------------------------------------------------------------------------ branch-free products
@pytest.mark.parametrize("seed", range(6))
def test_branch_free_masked_products_match_the_exact_ones(seed):
    g = torch.Generator().manual_seed(seed)
    hkv, gq, tq, tk, d = 2, 2, 7, 9, 5
    w = torch.randn(hkv, gq, tq, tk, generator=g, dtype=torch.float64)
    w[w.abs() < 0.2] = 0.0
    allowed = torch.rand(tq, tk, generator=g) < 0.6
    xk = torch.randn(tk, hkv, d, generator=g, dtype=torch.float64)
    xq = torch.randn(tq, hkv, gq, d, generator=g, dtype=torch.float64)
    for x in (xk, xq):
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:4]
        flat[idx] = torch.tensor([float("inf"), float("-inf"), float("nan"), float("inf")], dtype=torch.float64)
    for fn, x in ((km.keys_to_rows, xk), (km.rows_to_keys, xq)):
        want = fn(w, allowed, x)
        with km.branch_free():
            got = fn(w, allowed, x)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), fn.__name__
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin & ~torch.isnan(want)],
                                                                     want[~fin & ~torch.isnan(want)])
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ the module
def test_module_options_are_checked():
    with pytest.raises(InvalidConfigError, match="max_graphs"):
        DCPAttention(cuda_graphs=True, max_graphs=0)
    plan = _plan("causal", 3)
    q, k, v = _qkv(plan.spec, 0)
    with pytest.raises(ExecutionError, match="cuda_graphs"):
        DCPAttention(mode="single_process", cuda_graphs=True, kernels="reference")(q, k, v, plan)
    assert "cuda_graphs=True" in repr(DCPAttention(cuda_graphs=True))


def test_one_device_plan_graphed_in_one_process():
    plan = _plan("sliding", 1)
    attn, eager = DCPAttention(cuda_graphs=True, kernels="reference"), DCPAttention(kernels="reference")
    for seed in range(3):
        assert _same_as_eager(attn, eager, plan, *_qkv(plan.spec, seed, extra=1))
    assert attn._graphs.captures == 2 and sum(p.replays for p in attn._graphs.programs.values()) == 4


def test_graph_cache_keeps_the_most_recent_programs():
    cache = GraphCache(max_programs=1, backend="tape")
    x = torch.ones(2)
    cache.run("a", lambda st: (st[0] + 1,), [x])
    cache.run("b", lambda st: (st[0] + 2,), [x])
    assert list(cache.programs) == ["b"] and cache.captures == 2
    (y,) = cache.run("b", lambda st: (st[0] + 2,), [x * 3])
    assert torch.equal(y, torch.full((2,), 5.0)) and cache.captures == 2


@pytest.mark.skipif(not dcp.kernels.native.is_available(), reason="native kernels not built")
def test_the_tape_refuses_kernels_outside_the_dispatcher():
    plan = _plan("causal", 1)
    q, k, v = _qkv(plan.spec, 0)
    with pytest.raises(ExecutionError, match="native kernels"):
        DCPAttention(cuda_graphs=True, kernels="native")(q, k, v, plan)


# ------------------------------------------------------------------------------------------ gloo ranks
def _ranks(rank: int, world: int) -> dict:
    out = {}
    for mask in sorted(MASKS):
        plan = _plan(mask, world, (220, 36, 20))  # the long sequence must be cut to balance the ranks
        idx = torch.from_numpy(plan.local_token_index(rank))
        graphed, eager = DCPAttention(cuda_graphs=True, kernels="reference", timeout=20), \
            DCPAttention(kernels="reference", timeout=20)
        same = True
        for layer in range(3):  # three layers with their own data run one captured program per direction
            layer_data = (x.index_select(0, idx) for x in _qkv(plan.spec, 10 + layer, extra=1))
            same = _same_as_eager(graphed, eager, plan, *layer_data) and same
        out[mask] = dict(same=same, captures=graphed._graphs.captures,
                         replays=sum(p.replays for p in graphed._graphs.programs.values()),
                         crossing=(plan.stats().split_sequences, plan.stats().comm_bytes_total))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_replay_equals_eager(world, tmp_path):
    outs = run_ranks(_ranks, world, tmp_path, deadline_s=120.0)
    for mask in MASKS:
        assert min(outs[0][mask]["crossing"]) > 0, outs[0][mask]  # a sequence cut over ranks, data moved
        for rank, out in enumerate(outs):
            assert out[mask]["same"], (mask, rank)
            assert out[mask]["captures"] == 2 and out[mask]["replays"] == 4, (mask, rank, out[mask])
