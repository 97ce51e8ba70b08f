"""The reference executor against dense attention: outputs and gradients, every mask family, many plans.

fp64 runs must match dense fp64 attention (``reference_attention`` + autograd) to ~1e-10; bf16 runs must
be at most 2x as far from the fp64 truth as dense bf16 attention is (plus a small absolute slack).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _breakers import compute_before_data, drop_input, drop_merge, drop_partial
from _budget import n_examples
from dcp.cluster import Cluster
from dcp.config import PlannerConfig, SearchConfig
from dcp.errors import ExecutionError, PlanValidationError
from dcp.execute import ReferenceExecutor, dispatch, reference_attention, undispatch
from dcp.execute.tables import plan_tables
from dcp.masks import (CausalBlockwiseMask, CausalMask, DocumentMask, FullMask, LambdaMask, ModalityMask,
                       PrefixLMMask, RangesMask, SharedQuestionMask, SlidingWindowMask)
from dcp.partition import GreedyPartitioner
from dcp.planner import plan as make_plan
from dcp.spec import BatchSpec

FAMILIES = ("causal", "full", "sliding_window", "lambda", "shared_question", "causal_blockwise", "modality",
            "prefix_lm", "document")
CLUSTERS = [(1, 1), (1, 2), (2, 1), (1, 3), (1, 4), (2, 2), (1, 8), (2, 4)]
FP64_TOL = 1e-10

EXECUTOR = ReferenceExecutor(kernels="auto")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def mask_for(family: str, seqlen: int, rng: np.random.Generator):
    """A mask of ``family`` with random small parameters (DocumentMask needs the sequence length)."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    if family == "causal":
        return CausalMask()
    if family == "full":
        return FullMask()
    if family == "sliding_window":
        return SlidingWindowMask(window=r(1, 8))
    if family == "lambda":
        return LambdaMask(sink=r(0, 4), window=r(1, 8))
    if family == "shared_question":
        return SharedQuestionMask(question_frac=float(rng.uniform(0.1, 0.6)), num_answers=r(1, 4))
    if family == "causal_blockwise":
        return CausalBlockwiseMask(block=r(1, 6), num_prev=r(0, 2))
    if family == "modality":
        return ModalityMask(text_len=r(1, 6), image_len=r(1, 6))
    if family == "prefix_lm":
        return PrefixLMMask(prefix_frac=float(rng.uniform(0.0, 1.0)))
    if family == "document":
        cuts = np.sort(rng.choice(np.arange(1, seqlen), size=min(seqlen - 1, r(0, 3)), replace=False)) \
            if seqlen > 1 else np.zeros(0, dtype=int)
        docs = np.diff(np.r_[0, cuts, seqlen]).tolist()
        inner = [CausalMask(), FullMask(), SlidingWindowMask(window=3)][r(0, 2)]
        return DocumentMask(doc_lengths=tuple(int(x) for x in docs), inner=inner)
    if family == "ranges_with_empty_rows":  # some queries attend to nothing
        allowed = rng.random((seqlen, seqlen)) < 0.4
        allowed[rng.random(seqlen) < 0.3] = False
        allowed[seqlen - 1, 0] = True  # at least one tile (the planner refuses a batch without any)
        from dcp.masks import dense_to_ranges

        return RangesMask(dense_to_ranges(allowed))
    raise ValueError(family)


def head_block_choices(hq: int, g: int) -> list:
    return [None] + [d for d in range(1, hq + 1) if hq % d == 0 and (d % g == 0 or g % d == 0)]


def build(seqlens, masks, hq, hkv, d, cluster, block_size, hbs, dtype="float64", search=None):
    spec = BatchSpec(seqlens, masks, hq, hkv, d, dtype=dtype)
    cfg = PlannerConfig(block_size=block_size, head_block_size=hbs, partitioner=GreedyPartitioner(),
                        time_budget_s=None, **({} if search is None else {"search": search}))
    return make_plan(spec, Cluster(*cluster), cfg)


def truth(plan, seed: int):
    """fp64 inputs, dO, and the dense fp64 output and gradients."""
    spec = plan.spec
    g = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = spec.total_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = reference_attention(*leaves, spec, return_lse=True)
    grads = torch.autograd.grad(o, leaves, do)
    return (q, k, v, do), o.detach(), lse.detach(), grads


def run_executor(plan, inputs, dtype, executor=EXECUTOR):
    q, k, v, do = (x.to(dtype) for x in inputs)
    o, lse = executor.run_forward(plan, q, k, v)
    dq, dk, dv = executor.run_backward(plan, q, k, v, o, lse, do)
    return o, lse, (dq, dk, dv)


def dense_low_precision(plan, inputs, dtype):
    q, k, v, do = (x.to(dtype) for x in inputs)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = reference_attention(*leaves, plan.spec)
    return o.detach(), torch.autograd.grad(o, leaves, do)


def max_err(a, b) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return math.inf
    return float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0


def check_fp64(plan, seed=0, executor=EXECUTOR):
    inputs, o_ref, lse_ref, g_ref = truth(plan, seed)
    o, lse, grads = run_executor(plan, inputs, torch.float64, executor)
    assert o.dtype == torch.float64 and lse.shape == lse_ref.shape
    errs = {"o": max_err(o, o_ref), "lse": max_err(lse, lse_ref)}
    errs.update({n: max_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, g_ref)})
    assert max(errs.values()) < FP64_TOL, (plan, errs)


def check_low_precision(plan, dtype, seed=0, slack=2e-3):
    inputs, o_ref, _, g_ref = truth(plan, seed)
    o, _, grads = run_executor(plan, inputs, dtype)
    o_dense, g_dense = dense_low_precision(plan, inputs, dtype)
    assert o.dtype == dtype and all(x.dtype == dtype for x in grads)
    for name, ours, dense, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_dense, *g_dense), (o_ref, *g_ref)):
        e_ours, e_dense = max_err(ours, ref), max_err(dense, ref)
        # partials cross the wire in the element dtype and are rounded once more than the dense result,
        # so the floor is one ulp of the output at the reference's magnitude (wrong code errs by O(1))
        ulp = torch.finfo(dtype).eps * float(ref.abs().max())
        assert e_ours <= 2 * e_dense + max(slack, ulp), (plan, name, e_ours, e_dense, ulp)


# ------------------------------------------------------------------------------ deterministic matrix
@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_and_cluster_fp64(family, cluster):
    rng = np.random.default_rng(zlib.crc32(f'{family}{cluster}'.encode()))
    n_seqs = int(rng.integers(1, 4))
    seqlens = [int(x) for x in rng.integers(1, 23, size=n_seqs)]
    seqlens[0] = 17  # never a multiple of the block sizes below
    masks = [mask_for(family, n, rng) for n in seqlens]
    hkv, g = [(1, 1), (2, 1), (1, 4), (2, 2), (2, 4)][int(rng.integers(0, 5))]
    hq = hkv * g
    hbs = head_block_choices(hq, g)[int(rng.integers(0, len(head_block_choices(hq, g))))]
    block = int(rng.choice([1, 2, 3, 4, 5, 8]))
    plan = build(seqlens, masks, hq, hkv, 8, cluster, block, hbs)
    check_fp64(plan, seed=int(rng.integers(0, 1 << 30)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hkv,g,hbs", [(2, 2, 2), (1, 4, 2), (2, 1, None)])
def test_every_family_bf16(family, hkv, g, hbs):
    rng = np.random.default_rng(zlib.crc32(f'{family}{hkv}{g}bf16'.encode()))
    seqlens = [23, 9, 30]
    masks = [mask_for(family, n, rng) for n in seqlens]
    plan = build(seqlens, masks, hkv * g, hkv, 16, (2, 2), 4, hbs, dtype="bfloat16")
    check_low_precision(plan, torch.bfloat16, seed=int(rng.integers(0, 1 << 30)))


def test_fp32_and_explicit_backends():
    rng = np.random.default_rng(7)
    seqlens = [19, 6, 11]
    plan = build(seqlens, [mask_for(f, n, rng) for f, n in zip(("causal", "document", "lambda"), seqlens)],
                 4, 2, 8, (1, 3), 4, 2, dtype="float32")
    inputs, o_ref, _, g_ref = truth(plan, 3)
    from dcp.kernels import available_backends

    for backend in ["fallback", *available_backends()]:
        o, _, grads = run_executor(plan, inputs, torch.float32, ReferenceExecutor(kernels=backend))
        assert max_err(o, o_ref) < 1e-5, backend
        for a, b in zip(grads, g_ref):
            assert max_err(a, b) < 1e-4, backend
    # partials may travel in fp32
    o, _, grads = run_executor(plan, inputs, torch.float32, ReferenceExecutor(partial_dtype=torch.float32))
    assert max_err(o, o_ref) < 1e-5


@pytest.mark.parametrize("cluster", [(1, 1), (1, 4)], ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inputs_untouched_outputs_fresh_and_runs_repeat(cluster, dtype):
    """The executor reads its inputs in place (no copies on one device), so it must never write them, hand
    back views of them, or carry buffers from one run into the next."""
    rng = np.random.default_rng(4)
    seqlens = [21, 14, 9]
    masks = [mask_for(f, n, rng) for f, n in zip(("causal", "lambda", "full"), seqlens)]
    for hbs in (None, 2):
        plan = build(seqlens, masks, 4, 2, 8, cluster, 3, hbs, dtype=str(dtype).replace("torch.", ""))
        (q, k, v, do), *_ = truth(plan, 0)
        q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
        before = [x.clone() for x in (q, k, v, do)]
        o, lse = EXECUTOR.run_forward(plan, q, k, v)
        grads = EXECUTOR.run_backward(plan, q, k, v, o, lse, do)
        assert all(torch.equal(a, b) for a, b in zip((q, k, v, do), before))
        ptrs = {x.untyped_storage().data_ptr() for x in (q, k, v, do)}
        assert not ptrs & {x.untyped_storage().data_ptr() for x in (o, lse, *grads)}
        o_saved, lse_saved, g_saved = o.clone(), lse.clone(), [g.clone() for g in grads]
        for x in (o, lse, *grads):
            x.fill_(7.0)  # the caller owns the results: nothing of a later run may alias them
        o2, lse2 = EXECUTOR.run_forward(plan, q, k, v)
        grads2 = EXECUTOR.run_backward(plan, q, k, v, o_saved, lse_saved, do)
        assert torch.equal(o2, o_saved) and torch.equal(lse2, lse_saved)
        assert all(torch.equal(a, b) for a, b in zip(grads2, g_saved))


def test_rows_without_keys():
    """Queries that attend to nothing get o = 0, lse = -inf and zero gradient."""
    rng = np.random.default_rng(11)
    seqlens = [13, 9]
    masks = [mask_for("ranges_with_empty_rows", n, rng) for n in seqlens]
    plan = build(seqlens, masks, 4, 2, 8, (2, 2), 3, 2)
    check_fp64(plan, seed=5)
    inputs, o_ref, lse_ref, _ = truth(plan, 5)
    o, lse, (dq, _, _) = run_executor(plan, inputs, torch.float64)
    dead = torch.isneginf(lse_ref)
    assert dead.any()
    assert torch.isneginf(lse[dead]).all() and (o.transpose(0, 1)[dead] == 0).all()
    assert (dq.transpose(0, 1)[dead] == 0).all()


def test_mixed_masks_in_one_batch_and_repeat_runs_hit_the_cache():
    rng = np.random.default_rng(3)
    seqlens = [17, 4, 25, 1, 12]
    masks = [mask_for(f, n, rng) for f, n in zip(("causal", "full", "document", "prefix_lm", "shared_question"),
                                                   seqlens)]
    plan = build(seqlens, masks, 8, 2, 8, (2, 2), 4, 4)
    check_fp64(plan, seed=1)
    tables = plan_tables(plan)
    stages = dict(tables._stages)
    programs = dict(tables._programs)
    check_fp64(plan, seed=2)
    assert plan_tables(plan) is tables
    assert all(tables._stages[k] is v for k, v in stages.items()) and len(tables._stages) == len(stages)
    assert all(tables._programs[k] is v for k, v in programs.items())


def test_dispatch_roundtrip():
    rng = np.random.default_rng(0)
    seqlens = [10, 7, 3]
    plan = build(seqlens, [mask_for("causal", n, rng) for n in seqlens], 2, 1, 4, (1, 3), 3, None)
    x = torch.randn(plan.spec.total_tokens, 2, 4)
    parts = [dispatch(plan, d, x) for d in range(plan.n_devices)]
    for d, part in enumerate(parts):
        assert torch.equal(part, x[torch.from_numpy(plan.local_token_index(d))])
    assert torch.equal(undispatch(plan, parts), x)
    lse = torch.randn(2, plan.spec.total_tokens)
    assert torch.equal(undispatch(plan, [dispatch(plan, d, lse, dim=1) for d in range(3)], dim=1), lse)
    with pytest.raises(ExecutionError):
        dispatch(plan, 3, x)
    with pytest.raises(ExecutionError):
        dispatch(plan, 0, x[:-1])


def test_bad_inputs_raise():
    rng = np.random.default_rng(0)
    plan = build([9, 5], [mask_for("causal", n, rng) for n in (9, 5)], 4, 2, 8, (1, 2), 4, 2)
    (q, k, v, do), *_ = truth(plan, 0)
    with pytest.raises(ExecutionError, match="shape"):
        EXECUTOR.run_forward(plan, q[:-1], k, v)
    with pytest.raises(ExecutionError, match="shape"):
        EXECUTOR.run_forward(plan, q, q, v)
    with pytest.raises(ExecutionError, match="dtype"):
        EXECUTOR.run_forward(plan, q, k.float(), v)


# ------------------------------------------------------------------------------ broken plans
def _multi_device_plan():
    rng = np.random.default_rng(1)
    seqlens = [21, 14, 9]
    # the hypergraph candidate alone: these sequences fit whole on devices, so a packing moves nothing
    return build(seqlens, [mask_for("causal", n, rng) for n in seqlens], 4, 2, 8, (2, 2), 3, 2,
                 search=SearchConfig(pack_epsilons=(), aligned_groups=False, warm_starts=()))


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("edit", [drop_input, drop_partial, drop_merge, compute_before_data],
                         ids=["drop_input", "drop_partial", "drop_merge", "compute_before_data"])
def test_broken_plan_raises(direction, edit):
    plan = _multi_device_plan()
    bad = edit(plan, direction)
    assert bad is not None
    inputs, *_ = truth(plan, 0)
    with pytest.raises(PlanValidationError):
        run_executor(bad, inputs, torch.float64, ReferenceExecutor(validate=True))


# ------------------------------------------------------------------------------ randomized suite
@st.composite
def cases(draw):
    n_seqs = draw(st.integers(1, 4))
    seqlens = draw(st.lists(st.integers(1, 24), min_size=n_seqs, max_size=n_seqs))
    families = draw(st.lists(st.sampled_from(FAMILIES + ("ranges_with_empty_rows",)), min_size=n_seqs,
                             max_size=n_seqs))
    seed = draw(st.integers(0, 2**31 - 1))
    cluster = draw(st.sampled_from(CLUSTERS))
    block = draw(st.integers(1, 9))
    hkv = draw(st.sampled_from([1, 2, 3]))
    g = draw(st.sampled_from([1, 2, 4]))
    hbs = draw(st.sampled_from(head_block_choices(hkv * g, g)))
    d = draw(st.sampled_from([4, 8]))
    return seqlens, families, seed, cluster, block, hkv, g, hbs, d


@settings(max_examples=n_examples(200, 2000), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_randomized_fp64(case):
    seqlens, families, seed, cluster, block, hkv, g, hbs, d = case
    rng = np.random.default_rng(seed)
    masks = [mask_for(f, n, rng) for f, n in zip(families, seqlens)]
    plan = build(seqlens, masks, hkv * g, hkv, d, cluster, block, hbs)
    check_fp64(plan, seed=seed)


@settings(max_examples=n_examples(20, 200), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_randomized_bf16(case):
    seqlens, families, seed, cluster, block, hkv, g, hbs, d = case
    rng = np.random.default_rng(seed)
    masks = [mask_for(f, n, rng) for f, n in zip(families, seqlens)]
    plan = build(seqlens, masks, hkv * g, hkv, d, cluster, block, hbs, dtype="bfloat16")
    check_low_precision(plan, torch.bfloat16, seed=seed, slack=4e-3)


def test_attention_single_process_autograd():
    """``dcp.attention`` without torch.distributed runs a one-device plan locally and is differentiable."""
    import dcp

    rng = np.random.default_rng(5)
    seqlens = [15, 7]
    plan = build(seqlens, [mask_for(f, n, rng) for f, n in zip(("lambda", "document"), seqlens)], 4, 1, 8, (1, 1),
                 4, 2)
    (q, k, v, do), o_ref, lse_ref, g_ref = truth(plan, 9)
    leaves = [dcp.dispatch(plan, 0, x).requires_grad_() for x in (q, k, v)]
    o, lse = dcp.attention(*leaves, plan, return_lse=True)
    o.backward(dcp.dispatch(plan, 0, do))
    assert max_err(o.detach(), dcp.dispatch(plan, 0, o_ref)) < FP64_TOL
    assert max_err(lse, dcp.dispatch(plan, 0, lse_ref, dim=1)) < FP64_TOL
    for leaf, g in zip(leaves, g_ref):
        assert max_err(leaf.grad, dcp.dispatch(plan, 0, g)) < FP64_TOL
    assert plan_tables(plan).validated  # validated once, cached on the plan
    two = build(seqlens, [CausalMask()] * 2, 4, 1, 8, (1, 2), 4, 2)
    with pytest.raises(ExecutionError, match="2 devices"):
        dcp.attention(*leaves, two)
