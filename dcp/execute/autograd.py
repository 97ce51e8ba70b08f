"""``attention``: differentiable distributed attention (forward program forward, backward program backward)."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from dcp.execute.distributed import DistributedExecutor
from dcp.ir.plan import Plan


class DCPAttentionFunction(torch.autograd.Function):
    """``o_local, lse_local = DCPAttentionFunction.apply(q, k, v, executor)``; differentiable in q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, executor: DistributedExecutor):
        o, lse = executor.forward(q, k, v)
        ctx.executor = executor
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.executor.backward(q, k, v, o, lse, do.contiguous())
        return dq, dk, dv, None


def attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, plan: Plan, group=None, *,
              kernels=None, validate: bool = True, timeout: float | None = None, scale: float | None = None,
              partial_dtype: torch.dtype | None = None, return_lse: bool = False):
    """Attention of this rank's slice of a packed batch, run as ``plan`` over ``group``.

    ``q_local [n_local, Hq, D]``, ``k_local``/``v_local`` ``[n_local, Hkv, D]``: rows
    ``plan.local_token_index(rank)`` of the packed batch (``dcp.dispatch``). Returns ``o_local`` (and
    ``lse_local [Hq, n_local]``, not differentiable, with ``return_lse``); differentiable w.r.t. q, k, v.
    Every rank of ``group`` must call it with the same plan: the ranks check that they do before the plan's
    first transfer (``PlanMismatchError`` naming the ranks that differ; share one rank's plan with
    ``dcp.broadcast_plan``). Bad inputs raise ``ExecutionError`` before any transfer; a failed peer raises
    ``ExecutionError`` after ``timeout`` seconds (see ``dcp.execute.distributed``). ``kernels``,
    ``validate``, ``scale``, ``partial_dtype``: see ``DistributedExecutor``.
    """
    executor = DistributedExecutor(plan, group, kernels=kernels, validate=validate, timeout=timeout, scale=scale,
                                   partial_dtype=partial_dtype)
    o, lse = DCPAttentionFunction.apply(q_local, k_local, v_local, executor)
    return (o, lse) if return_lse else o


__all__ = ["attention", "DCPAttentionFunction"]
