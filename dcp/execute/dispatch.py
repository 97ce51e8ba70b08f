"""Scatter a packed global tensor to the devices' local layouts and gather it back.

Device ``d`` holds the rows ``plan.local_token_index(d)`` of the packed batch (its home token blocks,
stacked in block-id order).
"""
from __future__ import annotations

from typing import Sequence

import torch

from dcp.errors import ExecutionError
from dcp.ir.plan import Plan


def _index(plan: Plan, rank: int, device) -> torch.Tensor:
    from dcp.execute.tables import plan_tables

    if not 0 <= int(rank) < plan.n_devices:
        raise ExecutionError(f"rank {rank} is not a device of this plan ({plan.n_devices} devices)")
    return plan_tables(plan).local_index(int(rank)).to(device)


def dispatch(plan: Plan, rank: int, x_global: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Rows (along ``dim``) of the packed batch that device ``rank`` holds, in its local order."""
    if x_global.shape[dim] != plan.spec.total_tokens:
        raise ExecutionError(f"dispatch: dimension {dim} of the input has {x_global.shape[dim]} rows, the "
                             f"plan's batch has {plan.spec.total_tokens} tokens")
    return x_global.index_select(dim, _index(plan, rank, x_global.device))


def undispatch(plan: Plan, xs_local: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Inverse of ``dispatch``: the packed global tensor from every device's local tensor."""
    if len(xs_local) != plan.n_devices:
        raise ExecutionError(f"undispatch: got {len(xs_local)} local tensors for {plan.n_devices} devices")
    ref = xs_local[0]
    shape = list(ref.shape)
    shape[dim] = plan.spec.total_tokens
    out = ref.new_empty(shape)
    for d, x in enumerate(xs_local):
        idx = _index(plan, d, x.device)
        if x.shape[dim] != idx.numel():
            raise ExecutionError(f"undispatch: device {d} gave {x.shape[dim]} rows, it holds {idx.numel()}")
        out.index_copy_(dim, idx, x.to(ref.dtype))
    return out
