"""Plan agreement: before a plan's first transfer, the ranks of a process group prove they hold one plan.

Ranks that run different plans post messages of different sizes to each other, and the backend aborts
(gloo: "Received data size doesn't match expected size", SIGABRT) or hangs. So the executor all-gathers
a 32-byte digest of the plan (``dcp.ir.serialize.execution_digest``: batch, cluster, layout, tiles,
placement, both programs; not the planner's name or timing) once per (process group, plan digest) and
raises ``PlanMismatchError`` on every rank, naming the ranks that differ, when they disagree.

Caveat: the check runs once per *new* digest. Every rank must switch to a new plan at the same call
(as they do when they plan or receive each batch's plan in step); a rank that keeps running a plan the
group already agreed on while another switches to a new one is not detected by this check.
"""
from __future__ import annotations

import datetime
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist

from dcp.errors import ExecutionError, PlanMismatchError
from dcp.ir.plan import Plan

_AGREED: "OrderedDict[tuple, None]" = OrderedDict()  # (group key, digest) proven on that group
_AGREED_MAX = 4096
_FAILED = b"\xff" * 32  # stands for "this rank could not digest its plan" in the gather


def plan_digest(plan: Plan) -> bytes:
    """``execution_digest(plan)``, computed once per plan object."""
    from dcp.execute.tables import plan_tables
    from dcp.ir.serialize import execution_digest

    tab = plan_tables(plan)
    if tab.digest is None:
        tab.digest = execution_digest(plan)
    return tab.digest


def _group_key(group) -> int:
    return id(group if group is not None else dist.group.WORLD)


def _describe(digests: list[bytes]) -> str:
    """'ranks [0, 2] hold plan 1a2b3c4d, ranks [1] hold 5e6f...' (rank 0's plan first)."""
    holders: dict[bytes, list[int]] = {}
    for r, d in enumerate(digests):
        holders.setdefault(d, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {rs} hold{'' if len(rs) > 1 else 's'} "
             f"{'no readable plan' if d == _FAILED else 'plan ' + d.hex()[:8]}" for d, rs in holders.items()]
    return "; ".join(parts)


def agree_on_plan(plan: Plan, group, rank: int, world: int, device: torch.device, timeout: float | None) -> None:
    """Raise ``PlanMismatchError`` on every rank of ``group`` unless all hold the same plan (a collective:
    every rank calls it with its plan, before any transfer of that plan). ``ExecutionError`` when a peer
    does not take part within ``timeout`` seconds (None: the process group's timeout)."""
    if world == 1:
        return
    failure = None
    try:
        digest = plan_digest(plan)
    except Exception as err:  # noqa: BLE001 - take part in the gather anyway, so that no peer hangs
        digest, failure = _FAILED, err
    key = (_group_key(group), digest)
    if failure is None and key in _AGREED:
        _AGREED.move_to_end(key)
        return
    mine = torch.from_numpy(np.frombuffer(digest, dtype=np.int64).copy()).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    try:
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        ok = work.wait(datetime.timedelta(seconds=float(timeout))) if timeout is not None else work.wait()
    except Exception as err:  # noqa: BLE001 - a dead or silent peer
        raise ExecutionError(f"device {rank}: agreeing on the plan with the other {world - 1} devices failed"
                             f"{f' or timed out after {timeout:g}s' if timeout is not None else ''} (did a peer "
                             f"fail?): {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    if ok is False:
        raise ExecutionError(f"device {rank}: agreeing on the plan with the other devices did not complete")
    digests = [g.cpu().numpy().astype(np.int64).tobytes() for g in gathered]
    if failure is not None:
        raise failure
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanMismatchError(
            f"the ranks hold different plans (ranks {differ} differ from rank 0: {_describe(digests)}); every rank "
            f"must run the same plan: plan on one rank and share it with dcp.broadcast_plan(plan_or_none, src=0), "
            f"or plan deterministically on every rank (MtKaHyParPartitioner(preset='deterministic') or "
            f"GreedyPartitioner(), the same seed and config)")
    _AGREED[key] = None
    while len(_AGREED) > _AGREED_MAX:
        _AGREED.popitem(last=False)


__all__ = ["agree_on_plan", "plan_digest"]
