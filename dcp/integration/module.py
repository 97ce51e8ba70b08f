"""``DCPAttention``: a drop-in attention layer that runs a dcp plan.

Every other layer of the model runs unchanged on each rank's home tokens (rows
``plan.local_token_index(rank)`` of the packed batch); only attention needs the plan:

    attn = DCPAttention(group)                    # one per model (it holds no parameters)
    o = attn(q, k, v, batch.plan)                 # q [n_local, Hq, D], k/v [n_local, Hkv, D] -> [n_local, Hq, D]
    ...; loss.backward(); sum_gradients(model)    # replicated parameters: sum the ranks' gradients

Modes:
- "distributed": ``dcp.execute.attention`` over the process group (one rank per plan device);
- "single_process": one process runs the plan without ``torch.distributed``. A one-device plan runs
  directly (the local rows are the whole batch); a plan for n > 1 devices runs all devices in this
  process through the reference executor, with q/k/v of the WHOLE packed batch ``[T, H, D]`` (for
  debugging a multi-device plan on one machine);
- "auto" (default): "distributed" when torch.distributed is initialized with more than one rank in the
  group, else "single_process".
GQA: ``Hq`` must be a multiple of ``Hkv``; the plan's ``spec.num_heads``/``num_kv_heads``/``head_dim``
must match the tensors.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dcp.errors import ExecutionError, InvalidConfigError
from dcp.ir.plan import Plan

MODES = ("auto", "distributed", "single_process")


class _ReferenceAttention(torch.autograd.Function):
    """All devices of a plan in this process: ``o [T, Hq, D]`` from the packed ``q``, ``k``, ``v``."""

    @staticmethod
    def forward(ctx, q, k, v, plan, executor):
        o, lse = executor.run_forward(plan, q.detach(), k.detach(), v.detach())
        ctx.plan, ctx.executor = plan, executor
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.executor.run_backward(ctx.plan, q.detach(), k.detach(), v.detach(), o, lse,
                                               do.contiguous())
        return dq, dk, dv, None, None


class DCPAttention(nn.Module):
    """Attention of a packed variable-length batch, run as a dcp plan.

    Args:
        group: process group (None: the default group).
        mode: "auto", "distributed" or "single_process" (see module docstring).
        kernels: ``dcp.kernels`` backend ("auto", "native", "reference") or None.
        timeout: seconds to wait for one round of transfers before ``ExecutionError`` (None: the group's).
        scale: softmax scale (None: 1/sqrt(D)).
        validate: prove each new plan with ``dcp.validate`` before its first run (the planner already
            validated it; plans are checked by sha256 on arrival, so False is safe and saves time).
    """

    def __init__(self, group=None, *, mode: str = "auto", kernels=None, timeout: float | None = None,
                 scale: float | None = None, validate: bool = True):
        super().__init__()
        if mode not in MODES:
            raise InvalidConfigError(f"DCPAttention mode must be one of {MODES}, got {mode!r}")
        self.group, self.mode, self.kernels = group, mode, kernels
        self.timeout, self.scale, self.validate = timeout, scale, validate
        self._reference = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            return "distributed"
        return "single_process"

    def _check(self, q, k, v, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise ExecutionError(f"DCPAttention needs a dcp.Plan, got {type(plan).__name__}")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ExecutionError(f"DCPAttention: q, k, v must be [tokens, heads, head_dim], got {list(q.shape)}, "
                                 f"{list(k.shape)}, {list(v.shape)}")
        spec = plan.spec
        if (q.shape[1], k.shape[1], q.shape[2]) != (spec.num_heads, spec.num_kv_heads, spec.head_dim):
            raise ExecutionError(f"DCPAttention: tensors have {q.shape[1]}/{k.shape[1]} heads of size {q.shape[2]}, "
                                 f"the plan's batch {spec.num_heads}/{spec.num_kv_heads} of size {spec.head_dim}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> torch.Tensor:
        """``o [n, Hq, D]`` from ``q [n, Hq, D]``, ``k``/``v`` ``[n, Hkv, D]`` (n: this rank's home tokens)."""
        self._check(q, k, v, plan)
        mode = self.resolved_mode()
        if mode == "single_process" and plan.n_devices > 1:
            if self._reference is None or self._reference.scale != self.scale:
                from dcp.execute import ReferenceExecutor

                self._reference = ReferenceExecutor(kernels=self.kernels, validate=self.validate, scale=self.scale)
            return _ReferenceAttention.apply(q, k, v, plan, self._reference)
        from dcp.execute import attention

        group = self.group if mode == "distributed" else None
        if mode == "single_process" and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size(group) > 1:
            raise ExecutionError("DCPAttention(mode='single_process') with a one-device plan inside a process "
                                 "group of several ranks: use mode='distributed' and a plan for every rank")
        return attention(q, k, v, plan, group, kernels=self.kernels, validate=self.validate, timeout=self.timeout,
                         scale=self.scale)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


def sum_gradients(model: nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the ranks of ``group`` (one flat all-reduce; no-op on one rank).

    Each rank's loss is its summed token loss over the GLOBAL label count, so the sum is the gradient of
    the batch mean. A sum, not an average: not ``DistributedDataParallel``, which divides by the world
    size and would also interleave its collectives with dcp's transfers during the backward.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for p, summed in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        p.grad = summed


__all__ = ["DCPAttention", "sum_gradients"]
