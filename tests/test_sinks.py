"""Attention sinks (gpt-oss style): learned per-head logits ``sinks [Hq]`` of a virtual zero-value key.

Every path of ``dcp.attention`` / ``DCPAttention`` against a dense fp64 oracle that concatenates the sink
column to the scores (``_dense.dense_attention_with_sinks``): o, lse, dq, dk, dv and dsinks, under a causal
and a sliding-window mask with GQA (Hq=4, Hkv=2). Paths: the one-device direct run, a multi-device plan in
one process (reference executor), and 2 and 4 gloo ranks (plans that cut a sequence over ranks and move
data; each rank's dsinks covers its rows, ``sum_gradients`` completes it). Also: a -inf sink is exactly no
sink, a large sink shrinks the output, bad sinks raise ``ExecutionError``, NaN lands where the oracle's does.
"""
from __future__ import annotations

import pytest
import torch
from _dense import TOL, dense_attention_with_sinks
from _spawn import run_ranks

import dcp
from dcp.integration import DCPAttention, sum_gradients
from dcp.masks import CausalMask, SlidingWindowMask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SEQLENS = (37, 12, 23)
MASKS = {"causal": CausalMask(), "sliding": SlidingWindowMask(8)}
# the hypergraph candidate alone: on this small batch it cuts a sequence over devices and moves data
CONFIG = dcp.PlannerConfig(block_size=4, head_block_size=2, partitioner=dcp.GreedyPartitioner(), time_budget_s=None,
                           epsilon_memory=1.0,
                           search=dcp.SearchConfig(pack_epsilons=(), aligned_groups=False, warm_starts=()))
SPAWN_DEADLINE_S = 90.0


def _plan(mask: str, n_devices: int, seqlens=SEQLENS):
    spec = dcp.BatchSpec(list(seqlens), MASKS[mask], num_heads=4, num_kv_heads=2, head_dim=8, dtype="float64")
    return dcp.plan(spec, dcp.Cluster(1, n_devices), CONFIG)


def _case(spec, seed: int = 0, sinks=None):
    """fp64 ``(q, k, v, do, sinks)`` and the oracle's ``(o, lse, dq, dk, dv, dsinks)``."""
    g = torch.Generator().manual_seed(seed)
    t, d = spec.total_tokens, spec.head_dim
    q, k, v, do = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    if sinks is None:  # logits around the rows' lse, so the sink takes a real share of every softmax
        sinks = torch.randn(4, generator=g, dtype=torch.float64) + 2.0
    return (q, k, v, do, sinks), _oracle(spec, q, k, v, do, sinks)


def _oracle(spec, q, k, v, do, sinks):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    o, lse = dense_attention_with_sinks(*leaves[:3], spec, leaves[3])
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do))


def _leaves(*xs):
    return [x.clone().requires_grad_() for x in xs]


def _errors(got, want) -> dict:
    names = ("o", "lse", "dq", "dk", "dv", "dsinks")
    return {n: float((g.double() - w).abs().max()) for n, g, w in zip(names, got, want) if g is not None}


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_single_process_matches_dense_with_sinks(mask):
    """A 3-device plan in one process (whole batch) and a 1-device plan: o, lse, grads, dsinks."""
    plan3, plan1 = _plan(mask, 3), _plan(mask, 1)
    assert plan3.stats().split_sequences > 0  # the merge at home combines partials from other devices
    (q, k, v, do, sinks), want = _case(plan3.spec)
    attn = DCPAttention(mode="single_process")
    for plan in (plan3, plan1):
        ql, kl, vl, sl = _leaves(q, k, v, sinks)
        o = attn(ql, kl, vl, plan, sinks=sl)
        o.backward(do)
        got = (o.detach(), None, ql.grad, kl.grad, vl.grad, sl.grad)
        errs = _errors(got, want)
        assert max(errs.values()) < TOL, (plan.n_devices, errs)
    # dcp.attention on the one-device plan also returns the sinked lse
    ql, kl, vl, sl = _leaves(q, k, v, sinks)
    o, lse = dcp.attention(ql, kl, vl, plan1, sinks=sl, return_lse=True)
    o.backward(do)
    errs = _errors((o.detach(), lse, ql.grad, kl.grad, vl.grad, sl.grad), want)
    assert max(errs.values()) < TOL, errs


def test_sinks_of_another_dtype_get_their_gradient_in_that_dtype():
    plan = _plan("causal", 3)
    (q, k, v, do, sinks), want = _case(plan.spec)
    s32 = sinks.float().requires_grad_()
    ql = q.clone().requires_grad_()
    DCPAttention(mode="single_process")(ql, k, v, plan, sinks=s32).backward(do)
    assert s32.grad.dtype == torch.float32
    torch.testing.assert_close(s32.grad.double(), want[5], rtol=1e-5, atol=1e-5)


def test_minus_inf_sinks_are_exactly_no_sinks():
    plan3, plan1 = _plan("sliding", 3), _plan("sliding", 1)
    (q, k, v, do, _), _ = _case(plan3.spec)
    none = torch.full((4,), float("-inf"), dtype=torch.float64)
    for plan in (plan3, plan1):
        runs = []
        for sinks in (None, none):
            ql, kl, vl = _leaves(q, k, v)
            sl = None if sinks is None else sinks.clone().requires_grad_()
            if plan.n_devices == 1:
                o, lse = dcp.attention(ql, kl, vl, plan, sinks=sl, return_lse=True)
            else:
                o, lse = DCPAttention(mode="single_process")(ql, kl, vl, plan, sinks=sl), None
            o.backward(do)
            runs.append((o.detach(), lse, ql.grad, kl.grad, vl.grad, None if sl is None else sl.grad))
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), runs[0], runs[1]):
            assert (a is None and b is None) or torch.equal(a, b), (plan.n_devices, name)
        assert torch.equal(runs[1][5], torch.zeros(4, dtype=torch.float64))


def test_a_large_sink_shrinks_every_row():
    plan = _plan("causal", 1)
    (q, k, v, _, _), _ = _case(plan.spec)
    o, lse = dcp.attention(q, k, v, plan, return_lse=True)
    for logit in (0.0, 40.0):
        sinks = torch.full((4,), logit, dtype=torch.float64)
        o_s, lse_s = dcp.attention(q, k, v, plan, sinks=sinks, return_lse=True)
        assert (lse_s > lse).all() and (lse_s >= logit).all()
        assert (o_s.abs() < o.abs()).all()  # every row's keys share the softmax with the sink
        if logit == 40.0:  # the sink takes nearly all of it
            assert float(o_s.abs().max()) < 1e-8 * float(o.abs().max())


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(5, dtype=torch.float64), r"shape \[Hq\] = \[4\]"),
    (torch.zeros(1, 4, dtype=torch.float64), r"shape \[Hq\] = \[4\]"),
    (torch.zeros(4, dtype=torch.int64), "floating"),
    ([0.0, 0.0, 0.0, 0.0], "torch.Tensor"),
    (torch.zeros(4, device="meta"), "sinks are on meta"),
])
def test_bad_sinks_raise_execution_error(bad, match):
    plan1, plan3 = _plan("causal", 1), _plan("causal", 3)
    (q, k, v, _, _), _ = _case(plan1.spec)
    with pytest.raises(dcp.ExecutionError, match=match):
        dcp.attention(q, k, v, plan1, sinks=bad)
    for plan in (plan1, plan3):
        with pytest.raises(dcp.ExecutionError, match=match):
            DCPAttention(mode="single_process")(q, k, v, plan, sinks=bad)


@pytest.mark.parametrize("where,value", [("q", float("nan")), ("k", float("nan")), ("v", float("nan")),
                                         ("v", float("inf")), ("sinks", float("nan"))])
def test_non_finite_values_land_where_the_oracle_puts_them(where, value):
    """As ``test_nonfinite``: one poisoned element (token 5, head 0) poisons exactly the rows that attend it,
    in o, lse, dq, dk, dv, and the sink gradient of the heads those rows belong to; a NaN sink its head."""
    plan3, plan1 = _plan("sliding", 3), _plan("sliding", 1)
    (q, k, v, do, sinks), _ = _case(plan3.spec)
    target = {"q": q, "k": k, "v": v}.get(where)
    if target is None:
        sinks[0] = value
    else:
        target[5, 0, 3] = value
    want = _oracle(plan3.spec, q, k, v, do, sinks)
    if where == "sinks":  # every row of head 0, no other head
        assert torch.isnan(want[0][:, 0]).all() and torch.isfinite(want[0][:, 1:]).all()
    else:  # some rows of sequence 0, never another sequence
        assert not torch.isfinite(want[0]).all() and torch.isfinite(want[0][SEQLENS[0]:]).all()
    for plan in (plan3, plan1):
        ql, kl, vl, sl = _leaves(q, k, v, sinks)
        if plan.n_devices == 1:
            o, lse = dcp.attention(ql, kl, vl, plan, sinks=sl, return_lse=True)
        else:
            o, lse = DCPAttention(mode="single_process")(ql, kl, vl, plan, sinks=sl), None
        o.backward(do)
        got = (o.detach(), lse, ql.grad, kl.grad, vl.grad, sl.grad)
        for name, g_, w in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want):
            if g_ is None:
                continue
            assert torch.equal(torch.isfinite(g_), torch.isfinite(w)), \
                f"{plan.n_devices} devices, {name}: non-finite at {torch.nonzero(~torch.isfinite(g_)).tolist()[:6]}" \
                f", oracle at {torch.nonzero(~torch.isfinite(w)).tolist()[:6]}"
            if value != value:
                assert torch.equal(torch.isnan(g_), torch.isnan(w)), (plan.n_devices, name)
            fin = torch.isfinite(w)
            torch.testing.assert_close(g_[fin], w[fin], rtol=1e-9, atol=1e-9, msg=name)


# ------------------------------------------------------------------------------------------ gloo ranks
def _dist_sinks(rank: int, world: int) -> dict:
    out = {}
    for mask in sorted(MASKS):
        plan = _plan(mask, world)
        (q, k, v, do, sinks), want = _case(plan.spec, seed=3)
        idx = torch.from_numpy(plan.local_token_index(rank))
        mine = lambda x, dim=0: x.index_select(dim, idx)  # noqa: E731
        for path in ("attention", "module"):
            ql, kl, vl = (mine(x).clone().requires_grad_() for x in (q, k, v))
            holder = torch.nn.Module()
            holder.sinks = torch.nn.Parameter(sinks.clone())  # replicated: every rank holds the same logits
            if path == "attention":
                o, lse = dcp.attention(ql, kl, vl, plan, sinks=holder.sinks, timeout=20, return_lse=True)
            else:
                o, lse = DCPAttention(timeout=20)(ql, kl, vl, plan, sinks=holder.sinks), None
            o.backward(mine(do))
            part = holder.sinks.grad.clone()
            sum_gradients(holder)
            got = (o.detach(), lse, ql.grad, kl.grad, vl.grad, holder.sinks.grad)
            out[mask, path] = _errors(got, (mine(want[0]), mine(want[1], 1), *(mine(w) for w in want[2:5]),
                                            want[5]))
            out[mask, path]["part_off"] = float((part - want[5]).abs().max())  # one rank's rows: not the total
        out[mask, "crossing"] = (plan.stats().split_sequences, plan.stats().comm_bytes_total)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_match_dense_with_sinks(world, tmp_path):
    outs = run_ranks(_dist_sinks, world, tmp_path, deadline_s=SPAWN_DEADLINE_S)
    for mask in MASKS:
        assert min(outs[0][mask, "crossing"]) > 0, outs[0][mask, "crossing"]  # a sequence cut over ranks, data moved
        for path in ("attention", "module"):
            for rank, out in enumerate(outs):
                errs = {n: e for n, e in out[mask, path].items() if n != "part_off"}
                assert set(errs) >= {"o", "dq", "dk", "dv", "dsinks"} and max(errs.values()) < TOL, \
                    (mask, path, rank, errs)
            # the sink gradient is summed over ranks: no single rank's part is the batch's
            assert all(out[mask, path]["part_off"] > 1e-6 for out in outs), (mask, path)
