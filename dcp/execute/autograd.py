"""``attention``: differentiable distributed attention (forward program forward, backward program backward).

Attention sinks (gpt-oss style): ``sinks [Hq]`` are learned per-head logits of a virtual key with zero
value that joins every query row's softmax. They are applied at the home merge, as a post-process of the
executor's final ``(o, lse)`` (``apply_sinks``), so no executor or kernel knows about them:

    lse_f[h, i] = logaddexp(lse[h, i], sinks[h]),   o_f[i, h] = o[i, h] * exp(lse[h, i] - lse_f[h, i]).

The backward runs the executor's backward on ``(o_f, lse_f)``: it recomputes ``P = exp(S - lse_f)`` and
``D = rowsum(dO * o_f)`` from its arguments, which are then exactly the sinked softmax's (the sink's value is
zero, so its ``dP`` is 0 and it adds nothing to D); the sinks' own gradient is ``sink_gradients``.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from dcp.errors import ExecutionError
from dcp.execute.distributed import DistributedExecutor
from dcp.ir.layered import select_kind


# ------------------------------------------------------------------------------------------ sinks
def check_sinks(sinks, num_heads: int, device: torch.device | None) -> None:
    """``ExecutionError`` unless ``sinks`` is a floating 1-D tensor ``[num_heads]`` on ``device`` (None: any
    device; ``sinks=None`` passes)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise ExecutionError(f"sinks must be a torch.Tensor [Hq={num_heads}], got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ExecutionError(f"sinks must have shape [Hq] = [{num_heads}] (one logit per query head), got "
                             f"{list(sinks.shape)}")
    if not sinks.is_floating_point():
        raise ExecutionError(f"sinks must be a floating tensor, got {sinks.dtype}")
    if device is not None and sinks.device != device:
        raise ExecutionError(f"sinks are on {sinks.device}, q is on {device}")


def _stat(lse_ht: torch.Tensor) -> torch.dtype:
    """Row statistics in fp32 at least (fp64 for fp64 runs, as the executors' lse)."""
    return torch.promote_types(lse_ht.dtype, torch.float32)


def apply_sinks(o_thd: torch.Tensor, lse_ht: torch.Tensor, sinks_h: torch.Tensor):
    """``(o_f [T, Hq, D], lse_f [Hq, T])``: the final output and log-sum-exp with the sink logits ``sinks_h [Hq]``
    joined to every row's softmax. A row without keys (``lse = -inf``) gets ``o_f = 0`` (factor 0, not NaN);
    ``sinks_h[h] = -inf`` leaves head h exactly unchanged; NaN propagates."""
    stat = _stat(lse_ht)
    lse = lse_ht.to(stat)
    lse_f = torch.logaddexp(lse, sinks_h.detach().to(stat)[:, None])                  # [Hq, T]
    factor_ht = torch.where(lse == float("-inf"), torch.zeros((), dtype=stat, device=lse.device),
                            torch.exp(lse - lse_f))
    o_f = o_thd * factor_ht.t().to(o_thd.dtype)[:, :, None]
    return o_f, lse_f


def sink_gradients(o_f_thd: torch.Tensor, lse_f_ht: torch.Tensor, do_thd: torch.Tensor,
                   sinks_h: torch.Tensor) -> torch.Tensor:
    """``dsinks [Hq]`` (sinks' dtype) of the rows given: ``-sum_i exp(sinks[h] - lse_f[h, i]) * D[i, h]`` with
    ``D[i, h] = sum_d do[i, h, d] * o_f[i, h, d]``. Rows of one rank only: a replicated sink parameter gets the
    batch's gradient from the sum over ranks (``dcp.integration.sum_gradients``)."""
    stat = _stat(lse_f_ht)
    lse_f = lse_f_ht.to(stat)
    s = sinks_h.detach().to(stat)[:, None]
    # a -inf sink has probability 0 even in a row without keys (where lse_f is -inf too)
    p_sink_ht = torch.where(s == float("-inf"), torch.zeros((), dtype=stat, device=lse_f.device),
                            torch.exp(s - lse_f))
    delta_th = (do_thd.to(stat) * o_f_thd.to(stat)).sum(-1)
    return -(p_sink_ht * delta_th.t()).sum(-1).to(sinks_h.dtype)


# ------------------------------------------------------------------------------------------ autograd
class DCPAttentionFunction(torch.autograd.Function):
    """``o_local, lse_local = DCPAttentionFunction.apply(q, k, v, executor[, sinks])``; differentiable in q, k, v
    (and ``sinks [Hq]``: this rank's part of their gradient). ``lse_local`` is the final, sinked one."""

    @staticmethod
    def forward(ctx, q, k, v, executor: DistributedExecutor, sinks=None):
        o, lse = executor.forward(q, k, v)
        if sinks is not None:
            o, lse = apply_sinks(o, lse, sinks)
        ctx.executor = executor
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, o, lse, *(() if sinks is None else (sinks,)))
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *rest = ctx.saved_tensors
        do = do.contiguous()
        # (o, lse) are the sinked ones: the flash-style backward is then exact for q, k, v
        dq, dk, dv = ctx.executor.backward(q, k, v, o, lse, do)
        dsinks = sink_gradients(o, lse, do, rest[0]) if ctx.has_sinks and ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, dsinks


def attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, plan, group=None, *,
              kind: str | None = None, sinks: torch.Tensor | None = None, kernels=None, validate: bool = True,
              timeout: float | None = None, scale: float | None = None, partial_dtype: torch.dtype | None = None,
              return_lse: bool = False, graphs=None):
    """Attention of this rank's slice of a packed batch, run as ``plan`` over ``group``.

    ``q_local [n_local, Hq, D]``, ``k_local``/``v_local`` ``[n_local, Hkv, D]``: rows
    ``plan.local_token_index(rank)`` of the packed batch (``dcp.dispatch``). Returns ``o_local`` (and
    ``lse_local [Hq, n_local]``, not differentiable, with ``return_lse``); differentiable w.r.t. q, k, v.
    ``plan``: a ``Plan``, or a ``LayeredPlan`` with ``kind`` the layer's kind (``dcp.ir.layered.select_kind``:
    ``InvalidPlanError`` for a missing or unknown kind, or a kind given with a one-kind ``Plan``).
    ``sinks [Hq]``: attention-sink logits (see the module docstring), differentiable; the returned lse then
    includes them, and their gradient on each rank covers only its own rows (sum it over the ranks, as for
    every replicated parameter: ``dcp.integration.sum_gradients``).
    Every rank of ``group`` must call it with the same plan: the ranks check that they do before the plan's
    first transfer (``PlanMismatchError`` naming the ranks that differ; share one rank's plan with
    ``dcp.broadcast_plan``). Bad inputs raise ``ExecutionError`` before any transfer; a failed peer raises
    ``ExecutionError`` after ``timeout`` seconds (see ``dcp.execute.distributed``). ``kernels``,
    ``validate``, ``scale``, ``partial_dtype``, ``graphs`` (a ``dcp.execute.graphs.GraphCache``: captured
    programs replayed by every call with the same plan): see ``DistributedExecutor``.
    """
    plan = select_kind(plan, kind)
    executor = DistributedExecutor(plan, group, kernels=kernels, validate=validate, timeout=timeout, scale=scale,
                                   partial_dtype=partial_dtype, graphs=graphs)
    if sinks is None:
        o, lse = DCPAttentionFunction.apply(q_local, k_local, v_local, executor)
    else:
        check_sinks(sinks, plan.spec.num_heads, q_local.device if isinstance(q_local, torch.Tensor) else None)
        o, lse = DCPAttentionFunction.apply(q_local, k_local, v_local, executor, sinks)
    return (o, lse) if return_lse else o


__all__ = ["attention", "DCPAttentionFunction", "apply_sinks", "sink_gradients", "check_sinks"]
