"""``DCPAttention``: a drop-in attention layer that runs a dcp plan.

Every other layer of the model runs unchanged on each rank's home tokens (rows
``plan.local_token_index(rank)`` of the packed batch); only attention needs the plan:

    attn = DCPAttention(group)                    # one per model (it holds no parameters)
    o = attn(q, k, v, batch.plan)                 # q [n_local, Hq, D], k/v [n_local, Hkv, D] -> [n_local, Hq, D]
    ...; loss.backward(); sum_gradients(model)    # replicated parameters: sum the ranks' gradients

Layer kinds: with a ``LayeredPlan`` (a batch whose layers differ, e.g. full and sliding-window attention),
each layer says which kind it is, ``attn(q, k, v, plan, kind="sliding")`` (``dcp.ir.layered.select_kind``:
``InvalidPlanError`` for a missing or unknown kind, or a kind given with a one-kind ``Plan``).

Attention sinks (gpt-oss style): ``attn(q, k, v, plan, sinks=sinks)`` with learned per-head logits
``sinks [Hq]`` (a virtual key of zero value in every row's softmax; ``dcp.execute.autograd``). Its gradient
on each rank covers that rank's rows: ``sum_gradients`` (or any all-reduce sum) completes it.

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
from dcp.execute.autograd import apply_sinks, check_sinks, sink_gradients
from dcp.ir.layered import LayeredPlan, select_kind
from dcp.ir.plan import Plan

MODES = ("auto", "distributed", "single_process")


class _ReferenceAttention(torch.autograd.Function):
    """All devices of a plan in this process: ``o [T, Hq, D]`` from the packed ``q``, ``k``, ``v`` (and the
    optional ``sinks [Hq]``, applied to the final ``(o, lse)`` as ``dcp.execute.attention`` does)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, executor, sinks=None):
        o, lse = executor.run_forward(plan, q.detach(), k.detach(), v.detach())
        if sinks is not None:
            o, lse = apply_sinks(o, lse, sinks)
        ctx.plan, ctx.executor, ctx.has_sinks = plan, executor, sinks is not None
        ctx.save_for_backward(q, k, v, o, lse, *(() if sinks is None else (sinks,)))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *rest = ctx.saved_tensors
        do = do.contiguous()
        # the sinked (o, lse): the executor's backward is then exact for q, k, v
        dq, dk, dv = ctx.executor.run_backward(ctx.plan, q.detach(), k.detach(), v.detach(), o, lse, do)
        dsinks = sink_gradients(o, lse, do, rest[0]) if ctx.has_sinks and ctx.needs_input_grad[5] else None
        return dq, dk, dv, None, None, dsinks


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
        cuda_graphs: run each direction of a plan as a program captured on the first layer that runs it and
            replayed by every later layer (``dcp.execute.graphs``): a CUDA graph on CUDA tensors; on the CPU
            the tape stand-in (same discipline, for testing; needs ``kernels="reference"``). Each layer's
            inputs are copied into the capture's buffers and its outputs cloned out. Distributed mode or a
            one-device plan.
        max_graphs: captured programs kept (least recently used out first).
    """

    def __init__(self, group=None, *, mode: str = "auto", kernels=None, timeout: float | None = None,
                 scale: float | None = None, validate: bool = True, cuda_graphs: bool = False, max_graphs: int = 8):
        super().__init__()
        if mode not in MODES:
            raise InvalidConfigError(f"DCPAttention mode must be one of {MODES}, got {mode!r}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise InvalidConfigError(f"DCPAttention max_graphs must be an int >= 1, got {max_graphs!r}")
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs = None
        if self.cuda_graphs:
            from dcp.execute.graphs import GraphCache

            self._graphs = GraphCache(max_graphs)
        self.group, self.mode, self.kernels = group, mode, kernels
        self.timeout, self.scale, self.validate = timeout, scale, validate
        self._reference = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            return "distributed"
        return "single_process"

    def _check(self, q, k, v, plan: Plan | LayeredPlan, sinks=None) -> None:
        if not isinstance(plan, (Plan, LayeredPlan)):
            raise ExecutionError(f"DCPAttention needs a dcp.Plan or dcp.LayeredPlan, got {type(plan).__name__}")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ExecutionError(f"DCPAttention: q, k, v must be [tokens, heads, head_dim], got {list(q.shape)}, "
                                 f"{list(k.shape)}, {list(v.shape)}")
        spec = plan.spec
        if (q.shape[1], k.shape[1], q.shape[2]) != (spec.num_heads, spec.num_kv_heads, spec.head_dim):
            raise ExecutionError(f"DCPAttention: tensors have {q.shape[1]}/{k.shape[1]} heads of size {q.shape[2]}, "
                                 f"the plan's batch {spec.num_heads}/{spec.num_kv_heads} of size {spec.head_dim}")
        check_sinks(sinks, spec.num_heads, q.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan | LayeredPlan, *,
                kind: str | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``o [n, Hq, D]`` from ``q [n, Hq, D]``, ``k``/``v`` ``[n, Hkv, D]`` (n: this rank's home tokens).

        ``plan``: a ``Plan``, or a ``LayeredPlan`` and the layer's ``kind``; ``sinks [Hq]``: attention-sink
        logits (differentiable; each rank's gradient covers its rows, see the module docstring)."""
        self._check(q, k, v, plan, sinks)
        plan = select_kind(plan, kind)
        mode = self.resolved_mode()
        if mode == "single_process" and plan.n_devices > 1:
            if self.cuda_graphs:
                raise ExecutionError("DCPAttention(cuda_graphs=True) captures one rank's program: run the plan's "
                                     f"{plan.n_devices} devices as ranks (mode='distributed'), not in one process")
            if self._reference is None or self._reference.scale != self.scale:
                from dcp.execute import ReferenceExecutor

                self._reference = ReferenceExecutor(kernels=self.kernels, validate=self.validate, scale=self.scale)
            if sinks is None:
                return _ReferenceAttention.apply(q, k, v, plan, self._reference)
            return _ReferenceAttention.apply(q, k, v, plan, self._reference, sinks)
        from dcp.execute import attention

        group = self.group if mode == "distributed" else None
        if mode == "single_process" and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size(group) > 1:
            raise ExecutionError("DCPAttention(mode='single_process') with a one-device plan inside a process "
                                 "group of several ranks: use mode='distributed' and a plan for every rank")
        return attention(q, k, v, plan, group, sinks=sinks, kernels=self.kernels, validate=self.validate,
                         timeout=self.timeout, scale=self.scale, graphs=self._graphs)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}" + (", cuda_graphs=True" if self.cuda_graphs else "")


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
