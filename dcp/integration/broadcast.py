"""Every rank runs the identical plan: the planning rank broadcasts it, the others check it by hash.

Protocol of one step (``share_plan``, every rank of the group calls it in the same order):

1. the source (group rank 0) broadcasts a header, int64 ``[HEADER_LEN]``:
   ``[status, n_bytes, waited_ns, planning_ns, batch digest (4 x int64), plan digest (4 x int64)]``
   where the batch digest is sha256 of the batch description (``cache.batch_digest``) and the plan
   digest sha256 of ``plan.to_bytes()``; status ``ERROR`` is followed by the error message (uint8) and
   every rank raises ``PlanningError`` -- a planner failure never leaves the other ranks waiting;
2. every rank reports, in one MAX all-reduce of int64 ``[2]``: whether it lacks a cached plan with that
   digest, and whether its own batch digest differs (its data stream diverged: ``PlanMismatchError`` on
   every rank);
3. only if some rank lacks the plan, the source broadcasts the bytes (uint8 ``[n_bytes]``); receivers
   check sha256 of what arrived against the header, and one more MAX all-reduce makes a corrupted
   transfer an error on every rank.

So a cache hit on every rank costs one 96-byte broadcast and one 16-byte all-reduce. With NCCL the small
tensors live on the current CUDA device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dcp.errors import PlanMismatchError
from dcp.integration.cache import CachedPlan, digest_bytes
from dcp.integration.worker import PlanningError
from dcp.ir.layered import LayeredPlan
from dcp.ir.plan import Plan

OK, ERROR = 0, 1
HEADER_LEN = 4 + 4 + 4
_BATCH, _PLAN = slice(4, 8), slice(8, 12)


@dataclass(frozen=True, eq=False)
class SharedPlan:
    """What ``share_plan`` returns on every rank: the plan, the source's planner wait and planning time
    (plan bytes do not carry it), whether bytes moved."""

    entry: CachedPlan
    waited_s: float
    planning_s: float
    transferred: bool


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _src_global(group, src: int) -> int:
    return src if group is None else dist.get_global_rank(group, src)


def _digest_to_i64(d: bytes) -> list[int]:
    return np.frombuffer(d, dtype=np.int64).tolist()


def _i64_to_digest(x: torch.Tensor) -> bytes:
    return x.cpu().numpy().astype(np.int64).tobytes()


def _bcast_bytes(data: bytes | None, n: int, src_global: int, group, device) -> bytes:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data is not None else \
        torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src_global, group=group)
    return buf.cpu().numpy().tobytes()


def share_plan(entry: CachedPlan | None, error: BaseException | None, waited_s: float, *, batch_digest: bytes,
               local: CachedPlan | None = None, group=None, src: int = 0, planning_s: float = 0.0) -> SharedPlan:
    """Give every rank of ``group`` the source's plan for this step (see module docstring).

    Args:
        entry: on the source, the plan (None when ``error``); ignored elsewhere.
        error: on the source, the planner's exception to spread to every rank (re-raised on the source).
        waited_s: on the source, how long it waited for the planner this step.
        planning_s: on the source, how long planning this plan took (0 for a cache hit).
        batch_digest: this rank's digest of the batch it formed (32 bytes).
        local: this rank's cached plan for the batch, if any (spares the transfer when its digest matches).
        group: process group (None: the default group); src: the source's rank in the group.
    Returns ``SharedPlan``; raises ``PlanningError`` (source failed) or ``PlanMismatchError``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return SharedPlan(entry, waited_s, planning_s, False)
    rank = dist.get_rank(group)
    src_global = _src_global(group, src)
    device = _device(group)
    is_src = rank == src
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if is_src:
        if error is not None:
            msg = f"{type(error).__name__}: {error}".encode()
            header[:2] = torch.tensor([ERROR, len(msg)])
        else:
            header[:4] = torch.tensor([OK, len(entry.data), int(waited_s * 1e9),
                                       int(planning_s * 1e9)])
            header[_PLAN] = torch.tensor(_digest_to_i64(entry.digest))
        header[_BATCH] = torch.tensor(_digest_to_i64(batch_digest))
    header = header.to(device)
    dist.broadcast(header, src=src_global, group=group)
    status, n_bytes, waited_ns, planning_ns = (int(x) for x in header[:4].tolist())
    if status == ERROR:
        text = _bcast_bytes(msg if is_src else None, n_bytes, src_global, group, device).decode(errors="replace")
        if is_src:
            raise error
        raise PlanningError(f"rank {src} (the planning rank) failed to plan this batch: {text}")
    src_batch, plan_digest = _i64_to_digest(header[_BATCH]), _i64_to_digest(header[_PLAN])
    mismatch = batch_digest != src_batch
    have = is_src or (local is not None and local.digest == plan_digest)
    flags = torch.tensor([0 if have else 1, 1 if mismatch else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    need, any_mismatch = (int(x) for x in flags.tolist())
    if any_mismatch:
        who = f"rank {rank}'s batch differs from rank {src}'s" if mismatch else "another rank's batch differs"
        raise PlanMismatchError(f"the ranks formed different batches ({who}): every rank must iterate the same "
                                f"samples in the same order (and with the same token budget)")
    result = entry if is_src else (local if have else None)
    if need:
        data = _bcast_bytes(entry.data if is_src else None, n_bytes, src_global, group, device)
        bad = 0
        if not is_src and not have:
            bad = int(digest_bytes(data) != plan_digest)
            if not bad:
                result = CachedPlan.from_bytes(data, plan_digest)
        verdict = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
        if int(verdict.item()):
            raise PlanMismatchError(f"plan bytes from rank {src} arrived corrupted on "
                                    f"{'this rank' if bad else 'another rank'} (sha256 mismatch)")
    return SharedPlan(result, waited_ns / 1e9, planning_ns / 1e9, bool(need))


def broadcast_plan(plan: Plan | None, src: int = 0, group=None) -> Plan:
    """Plan on one rank, run the same plan everywhere: every rank of ``group`` calls this; ``src`` (a
    group rank) passes its plan, the others pass anything (None). Returns the source's plan on every rank,
    its bytes checked by sha256 on arrival.

    A ``dcp.LayeredPlan`` (a model with layer kinds) is shared the same way.

    Raises ``PlanningError`` on every rank when the source passes no ``dcp.Plan``, and
    ``PlanMismatchError`` when the bytes arrive corrupted. Without an initialized process group (or with
    one rank) the plan is returned as it is. Receivers' plans carry the source's ``planning_time_s``.
    """
    is_src = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == src
    entry = error = None
    if is_src:
        if isinstance(plan, (Plan, LayeredPlan)):
            data = plan.to_bytes()
            entry = CachedPlan(data, digest_bytes(data), plan)
        else:
            error = PlanningError(f"broadcast_plan: the source rank {src} passed {type(plan).__name__}, not a "
                                  f"dcp.Plan or dcp.LayeredPlan")
    # no batch to compare: every rank passes the same null batch digest
    shared = share_plan(entry, error, 0.0, batch_digest=bytes(32), group=group, src=src,
                        planning_s=plan.planning_time_s if entry is not None else 0.0)
    if is_src:
        return shared.entry.plan
    return dataclasses.replace(shared.entry.plan, planning_time_s=shared.planning_s)  # the bytes do not carry it


__all__ = ["share_plan", "broadcast_plan", "SharedPlan", "PlanMismatchError", "HEADER_LEN"]
