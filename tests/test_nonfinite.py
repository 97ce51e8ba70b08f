"""NaN and inf propagate as attention defines them, in every kernel, merge and executor path.

Row i's output depends on q_i and on the keys and values row i attends, nothing else. So a NaN in q_i
poisons row i; one in an attended k_j or v_j the rows that attend j; never a row that does not attend it,
nor another sequence; gradients likewise. The dense oracle (``reference_attention``, fp64, autograd)
defines the expected non-finite positions; every kernel backend runs the plan on two devices (so partial
outputs are merged) and must put NaN / inf exactly there: in o, lse, dq, dk and dv.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import dcp
from dcp.execute import ReferenceExecutor, reference_attention
from dcp.kernels import native
from dcp.masks import CausalMask, LambdaMask, SharedQuestionMask, ranges_to_dense

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SEQLENS = (13, 9, 6)
POISONED = 5  # token 5 of sequence 0: attended by some rows (causal: rows >= 5), not by others


@pytest.fixture(scope="module")
def plan():
    spec = dcp.BatchSpec(list(SEQLENS), [CausalMask(), LambdaMask(sink=1, window=3), SharedQuestionMask(0.3, 2)],
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32")
    config = dcp.PlannerConfig(block_size=4, head_block_size=2, partitioner=dcp.GreedyPartitioner(), time_budget_s=None)
    return dcp.plan(spec, dcp.Cluster(1, 2), config)


def _inputs(spec, where: str, value: float):
    g = torch.Generator().manual_seed(1)
    t = spec.total_tokens
    q, k, v, do = (torch.randn(t, h, spec.head_dim, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    target = {"q": q, "k": k, "v": v}[where]
    target[POISONED, 0, 3] = value  # one element: query head 0 / kv head 0 (query heads 0, 1)
    return q, k, v, do


def _oracle(spec, q, k, v, do):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = reference_attention(*leaves, spec, return_lse=True)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do))


CASES = [("q", float("nan")), ("k", float("nan")), ("v", float("nan")), ("v", float("inf")), ("k", float("-inf"))]


@pytest.mark.parametrize("where,value", CASES)
def test_oracle_poisons_exactly_the_rows_that_attend_the_value(plan, where, value):
    spec = plan.spec
    q, k, v, do = _inputs(spec, where, value)
    o, lse, dq, dk, dv = _oracle(spec, q, k, v, do)
    bad = ~torch.isfinite(o).all(-1)                                                           # [T, Hq]
    want = torch.zeros_like(bad)
    if where == "q":
        want[POISONED, 0] = True
    else:  # the rows of sequence 0 that attend the key, in query heads 0 and 1 (they read kv head 0)
        attends = torch.from_numpy(ranges_to_dense(spec.kv_ranges(0), SEQLENS[0]))[:, POISONED]
        want[:SEQLENS[0], :2] = attends[:, None]
    if value != float("-inf"):  # a -inf key element gives +inf or -inf scores by the sign of q: either way
        assert torch.equal(bad, want)
    else:
        assert not (bad & ~want).any()
    for x in (o, dq, dk, dv):  # never another sequence, in any output or gradient
        assert torch.isfinite(x[SEQLENS[0]:]).all()
    assert torch.isfinite(lse[:, SEQLENS[0]:]).all()
    if where == "v":
        assert torch.isfinite(lse).all()  # values do not enter the softmax


def _backends():
    out = [("reference", torch.float32), ("reference", torch.bfloat16), ("varlen", torch.float32),
           ("fallback", torch.float64), ("auto", torch.float64)]
    if native.is_available():
        out += [("native", torch.float32), ("native", torch.bfloat16)]
        if "avx2" in native.available_cpu_isas():  # the other ISA build of the same kernels
            out.append(("native-generic", torch.float32))
    return out


@pytest.mark.parametrize("kernels,dtype", _backends(), ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("where,value", CASES)
def test_every_backend_puts_non_finite_values_where_the_oracle_does(plan, kernels, dtype, where, value):
    spec = plan.spec
    q, k, v, do = _inputs(spec, where, value)
    want = _oracle(spec, q, k, v, do)
    isa = contextlib.nullcontext()
    if kernels == "native-generic":
        kernels, isa = "native", native.use_cpu_isa("generic")
    ex = ReferenceExecutor(kernels=kernels)
    qc, kc, vc, doc = (x.to(dtype) for x in (q, k, v, do))
    with isa:
        o, lse = ex.run_forward(plan, qc, kc, vc)
        got = (o, lse, *ex.run_backward(plan, qc, kc, vc, o, lse, doc))
    for name, g_, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(torch.isfinite(g_), torch.isfinite(w)), \
            f"{name}: non-finite at {torch.nonzero(~torch.isfinite(g_)).tolist()[:6]}, oracle at " \
            f"{torch.nonzero(~torch.isfinite(w)).tolist()[:6]}"
        if value != value:  # NaN in, NaN out (never an inf instead)
            assert torch.equal(torch.isnan(g_), torch.isnan(w)), name
        fin = torch.isfinite(w)
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(g_.double()[fin], w[fin], rtol=tol, atol=tol, msg=name)


def test_a_poisoned_row_makes_the_loss_nan_not_just_the_gradients(plan):
    q, k, v, _ = _inputs(plan.spec, "q", float("nan"))
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    o, _ = ReferenceExecutor().run_forward(plan, *leaves)
    assert torch.isnan(o.sum())


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_merges_propagate_nan_and_skip_only_empty_partials(backend):
    from dcp.kernels import get_kernels

    if backend == "native" and not native.is_available():
        pytest.skip("native kernels not built")
    k = get_kernels(backend)
    o1 = torch.ones(3, 1, 2)
    o2 = torch.full((3, 1, 2), 2.0)
    lse1 = torch.tensor([[0.0, float("nan"), float("-inf")]])
    lse2 = torch.tensor([[0.0, 0.0, 0.0]])
    o, lse = k.merge_partials([o1, o2], [lse1, lse2])
    assert torch.allclose(o[0], torch.full((1, 2), 1.5)) and abs(float(lse[0, 0]) - np.log(2)) < 1e-6
    assert torch.isnan(o[1]).all() and torch.isnan(lse[0, 1])           # a NaN partial poisons the row
    assert torch.equal(o[2], o2[2]) and float(lse[0, 2]) == 0.0          # an empty partial adds nothing
    o_nan = o1.clone()
    o_nan[0, 0, 0] = float("nan")
    o, lse = k.merge_partials([o_nan, o2], [lse2.clone(), lse2.clone()])
    assert torch.isnan(o[0, 0, 0]) and torch.isfinite(o[0, 0, 1]) and torch.isfinite(lse).all()
