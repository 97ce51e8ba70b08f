"""Dense fp64 attention as the oracle of a plan: random inputs, reference outputs and gradients, and the
check that a plan run by the reference executor reproduces them (shared by the baselines' tests)."""
from __future__ import annotations

import torch

from dcp.execute import ReferenceExecutor, reference_attention

TOL = 1e-10  # fp64 plans against fp64 dense attention: only summation order differs


def dense_case(spec, seed: int):
    """(q, k, v, do, o_ref, (dq, dk, dv)_ref): fp64 ``[tokens, heads, head_dim]`` inputs drawn from ``seed``
    and dense attention's output and gradients under ``spec``'s masks."""
    g = torch.Generator().manual_seed(seed)
    t, d = spec.total_tokens, spec.head_dim
    q, k, v, do = (torch.randn(t, h, d, generator=g, dtype=torch.float64)
                   for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = reference_attention(*leaves, spec)
    grads_ref = torch.autograd.grad(o_ref, leaves, do)
    return q, k, v, do, o_ref.detach(), grads_ref


def assert_matches_dense(plan, seed: int = 7, tol: float = TOL) -> None:
    """The plan's forward output and backward gradients (reference executor) equal dense attention's."""
    q, k, v, do, o_ref, grads_ref = dense_case(plan.spec, seed)
    ex = ReferenceExecutor()
    o, lse = ex.run_forward(plan, q, k, v)
    grads = ex.run_backward(plan, q, k, v, o, lse, do)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        err = float((got - want).abs().max())
        assert err < tol, f"{plan.planner}: {name} differs from dense attention by {err:.3g}"
