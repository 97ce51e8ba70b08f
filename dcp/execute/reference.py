"""The reference executor: every device's program in one process, transfers through an in-memory mailbox.

Devices run in lockstep by rounds, as grouped point-to-point communication orders them: all devices
post round r, then each device computes and waits for round r (and reduces what arrived). Any
inconsistency of the plan at run time (a message never sent, sizes that differ, a partial never merged or
never sent home, an input used before it arrived) raises ``ExecutionError``; with ``validate=True`` (the
default) the plan is first proven by ``dcp.ir.validate.validate`` (``PlanValidationError``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dcp.errors import ExecutionError
from dcp.execute.buffers import cat_as
from dcp.execute.dispatch import undispatch
from dcp.execute.local import DeviceRunner, _stat_dtype, backward_home, default_scale, own_storages, resolve_kernels
from dcp.execute.tables import ensure_valid, plan_tables
from dcp.ir.plan import Plan


def _scatter(plan: Plan, x: torch.Tensor, dim: int = 0) -> list[torch.Tensor]:
    """``[dispatch(plan, d, x, dim) for d in devices]`` with ONE gather (views of it per device; ``x``'s own
    views when the local layouts are the packed order). The executors never write their inputs."""
    perm, sizes, identity = plan_tables(plan).scatter_index()
    y = x if identity else x.index_select(dim, perm.to(x.device))
    return list(y.split(sizes, dim))


class InMemoryComm:
    """A mailbox shared by the devices of one process; ``endpoint(rank)`` is one device's ``Comm``."""

    def __init__(self):
        self.mail: dict[tuple[int, int, int], torch.Tensor] = {}

    def endpoint(self, rank: int) -> "_Endpoint":
        return _Endpoint(self, rank)

    def check_drained(self) -> None:
        if self.mail:
            (rnd, src, dst) = next(iter(self.mail))
            raise ExecutionError(f"round {rnd}: device {src} sent a message to device {dst} that was never "
                                 f"received ({len(self.mail)} such messages)")


class _Endpoint:
    def __init__(self, box: InMemoryComm, rank: int):
        self.box, self.rank = box, rank

    def launch(self, round, sends, recvs):
        for peer, t in sends:
            key = (round, self.rank, peer)
            if key in self.box.mail:
                raise ExecutionError(f"round {round}: device {self.rank} sends to device {peer} twice")
            # a copy, as a transport makes one: the sender may reuse its buffer once its own wait returns
            self.box.mail[key] = t.clone()
        return round, list(recvs)

    def wait(self, handle):
        rnd, recvs = handle
        out = []
        for peer, buf in recvs:
            t = self.box.mail.pop((rnd, peer, self.rank), None)
            if t is None:
                raise ExecutionError(f"round {rnd}: device {self.rank} waits for a message from device {peer} "
                                     f"that was never sent")
            if tuple(t.shape) != tuple(buf.shape) or t.dtype != buf.dtype:
                raise ExecutionError(f"round {rnd}: device {self.rank} expects {tuple(buf.shape)} {buf.dtype} from "
                                     f"device {peer}, got {tuple(t.shape)} {t.dtype}")
            buf.copy_(t)
            out.append(buf)
        return out


def run_lockstep(runners: Sequence[DeviceRunner], comm: InMemoryComm) -> None:
    """Run the devices' programs round by round: all launches of round r, then each device's rest."""
    rounds = {r.n_rounds for r in runners}
    if len(rounds) != 1:
        raise ExecutionError(f"devices run different numbers of rounds: {[r.n_rounds for r in runners]}")
    n_rounds = rounds.pop()
    try:
        for r in range(n_rounds + 1):
            if r:
                for run in runners:
                    run.run_segment(r, "launch")
            for run in runners:
                run.run_segment(r, "rest" if r else "all")
        comm.check_drained()
    except BaseException:
        for run in runners:
            run.release()
        raise


class ReferenceExecutor:
    """Run a plan's forward and backward programs for all devices in this process.

    Args:
        kernels: ``dcp.kernels`` backend name ("auto", "reference", "native") or a kernels object.
        validate: prove the plan with ``dcp.ir.validate.validate`` before its first run (cached per plan).
        scale: softmax scale (None: 1/sqrt(head_dim)).
        partial_dtype: dtype of partial outputs on the wire (None: the element dtype, as the cost model).
    """

    def __init__(self, kernels=None, validate: bool = True, scale: float | None = None,
                 partial_dtype: torch.dtype | None = None):
        self.kernels = resolve_kernels(kernels)
        self.validate = validate
        self.scale = scale
        self.partial_dtype = partial_dtype

    def _check(self, plan: Plan, q, k, v, *more):
        if not isinstance(plan, Plan):
            raise ExecutionError(f"expected a dcp.Plan, got {type(plan).__name__}")
        spec = plan.spec
        t = spec.total_tokens
        want_q, want_kv = (t, spec.num_heads, spec.head_dim), (t, spec.num_kv_heads, spec.head_dim)
        for name, x, want in (("q", q, want_q), ("k", k, want_kv), ("v", v, want_kv)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                raise ExecutionError(f"{name} must have shape {list(want)}, got "
                                     f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
            raise ExecutionError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        for name, x in more:
            if x.dtype != q.dtype and name != "lse":
                raise ExecutionError(f"{name} has dtype {x.dtype}, q has {q.dtype}")
        ensure_valid(plan, full=self.validate)

    def forward_local(self, plan: Plan, qs, ks, vs) -> tuple[list, list]:
        """Forward on local tensors (one per device): (o_local per device, lse_local per device)."""
        runners = self._run(plan, "forward", [(qs[d], ks[d], vs[d]) for d in range(plan.n_devices)])
        outs = [r.finish_forward() for r in runners]
        return [o for o, _ in outs], [lse for _, lse in outs]

    def _run(self, plan: Plan, direction: str, homes: list) -> list[DeviceRunner]:
        comm = InMemoryComm()
        scale = default_scale(plan, self.scale)
        runners: list[DeviceRunner] = []
        try:
            for d in range(plan.n_devices):
                runners.append(DeviceRunner(plan, d, direction, homes[d], comm.endpoint(d), self.kernels, scale,
                                            self.partial_dtype))
        except BaseException:
            for run in runners:
                run.release()
            raise
        run_lockstep(runners, comm)
        return runners

    @staticmethod
    def _assemble(plan: Plan, runners: list[DeviceRunner], dims: tuple) -> list[torch.Tensor]:
        """The packed results from every device's per-block result rows: one ``cat`` per tensor in packed
        order (or per device and ``undispatch`` when a runner cannot hand blocks)."""
        finish = [r.finish_forward if r.direction == "forward" else r.finish_backward for r in runners]
        if len(runners) == 1 and plan_tables(plan).scatter_index()[2]:
            return list(finish[0]())
        if not all(r.can_hand_blocks for r in runners):
            locals_ = [f() for f in finish]
            return [undispatch(plan, [x[i] for x in locals_], dim) for i, dim in enumerate(dims)]
        blocks: dict = {}
        for f in finish:
            f(blocks)
        order = np.argsort(plan_tables(plan).plan.layout.tb_start, kind="stable")  # grouped: pieces
        r0 = runners[0]
        out = []
        for i, dim in enumerate(dims):
            parts = [blocks[int(tb)][i] for tb in order]
            dtype = r0.dt.stat if (r0.direction == "forward" and i == 1) else r0.dt.el
            out.append(cat_as(parts, dim, dtype, None))
        return list(own_storages(*out))

    def backward_local(self, plan: Plan, qs, ks, vs, os, lses, dos) -> tuple[list, list, list]:
        runners = self._run(plan, "backward", [backward_home(qs[d], ks[d], vs[d], os[d], lses[d], dos[d])
                                               for d in range(plan.n_devices)])
        outs = [r.finish_backward() for r in runners]
        return [x[0] for x in outs], [x[1] for x in outs], [x[2] for x in outs]

    def run_forward(self, plan: Plan, q_thd: torch.Tensor, k_thd: torch.Tensor, v_thd: torch.Tensor):
        """Forward of the packed batch: ``(o [T, Hq, D], lse [Hq, T])``."""
        self._check(plan, q_thd, k_thd, v_thd)
        runners = self._run(plan, "forward", list(zip(_scatter(plan, q_thd), _scatter(plan, k_thd),
                                                      _scatter(plan, v_thd))))
        o, lse = self._assemble(plan, runners, (0, 1))
        return o, lse

    def run_backward(self, plan: Plan, q, k, v, o, lse, do):
        """Backward of the packed batch given the forward's ``o``, ``lse`` and ``do``: ``(dq, dk, dv)``."""
        self._check(plan, q, k, v, ("o", o), ("do", do), ("lse", lse))
        spec = plan.spec
        if tuple(o.shape) != tuple(q.shape) or tuple(do.shape) != tuple(q.shape) \
                or tuple(lse.shape) != (spec.num_heads, spec.total_tokens):
            raise ExecutionError(f"o and do must have q's shape {list(q.shape)} and lse "
                                 f"[{spec.num_heads}, {spec.total_tokens}]")
        # backward_home's row statistics for the whole batch at once, then every input scattered with one gather
        stat = _stat_dtype(q.dtype)
        delta = (do.to(stat) * o.to(stat)).sum(-1)                                  # [T, Hq]
        lses = _scatter(plan, lse.to(stat), dim=1)
        homes = zip(_scatter(plan, q), _scatter(plan, k), _scatter(plan, v), _scatter(plan, do.contiguous()), lses,
                    (x.t() for x in _scatter(plan, delta)))
        dq, dk, dv = self._assemble(plan, self._run(plan, "backward", list(homes)), (0, 0, 0))
        return dq, dk, dv


__all__ = ["ReferenceExecutor", "InMemoryComm", "run_lockstep"]
