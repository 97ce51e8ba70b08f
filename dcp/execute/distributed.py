"""The distributed executor: one process per device, transfers over ``torch.distributed``.

Per round, a device posts all its sends and receives as ONE ``dist.batch_isend_irecv`` group (at most
one packed message per peer and direction; nothing is posted when the device has no transfer in that
round — the plan's matching guarantees the peers agree), computes the overlapped stage, then waits. On
CUDA the group is posted from a side stream, so the packing of the next messages and the stage's kernels
on the compute stream are not serialized behind it.

A peer that dies or stops responding makes ``wait`` fail: with ``timeout`` (seconds) every work handle is
waited with that limit, otherwise the process group's own timeout applies (set it with
``dist.init_process_group(..., timeout=datetime.timedelta(seconds=...))``). Either way the executor
raises ``ExecutionError`` naming the round and the peers of that round instead of hanging.

Inputs are validated before any transfer: local shapes ``[n_local, Hq, D]`` / ``[n_local, Hkv, D]``, one
floating dtype, one device, the plan's world size equal to the group's, every rank holding the same plan
(a digest all-gather once per new plan: ``dcp.execute.agreement``, ``PlanMismatchError`` naming the ranks
that differ), and (by default, once per plan) ``dcp.ir.validate.validate(plan)``.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcp.errors import ExecutionError
from dcp.execute.agreement import agree_on_plan
from dcp.execute.graphs import backend_for, capturing_tape
from dcp.execute.local import DeviceRunner, backward_home, default_scale, resolve_kernels
from dcp.execute.tables import ensure_valid, plan_tables
from dcp.ir.plan import Plan

_NCCL_READY: set = set()
_STREAMS: dict = {}  # one transfer stream per CUDA device


@dataclass
class _Handle:
    round: int
    works: list = field(default_factory=list)
    bufs: list = field(default_factory=list)
    peers: tuple = ()
    keep: list = field(default_factory=list)  # send buffers stay alive until the round is waited


class DistComm:
    """``Comm`` over a ``torch.distributed`` process group (group rank = plan device)."""

    def __init__(self, group, rank: int, device: torch.device, timeout: float | None = None):
        self.group, self.rank, self.device = group, rank, device
        self.timeout = None if timeout is None else datetime.timedelta(seconds=float(timeout))
        self.stream = None
        if device.type == "cuda" and torch.cuda.is_available():
            self.stream = _STREAMS.get(device)
            if self.stream is None:
                self.stream = _STREAMS[device] = torch.cuda.Stream(device=device)

    def warm_up(self) -> None:
        """NCCL: the first collective of a group must involve every rank, but a device may have nothing
        to transfer in round 1; one tiny all-reduce per group makes every later grouped p2p call safe."""
        key = id(self.group) if self.group is not None else None
        if key in _NCCL_READY or self.device.type != "cuda" or dist.get_backend(self.group) != "nccl":
            return
        try:
            flag = torch.ones(1, device=self.device)
            dist.all_reduce(flag, group=self.group)
        except Exception as err:  # noqa: BLE001
            raise ExecutionError(f"device {self.rank}: the NCCL process group is not usable: {err}") from err
        _NCCL_READY.add(key)

    def _op(self, fn, tensor, peer):
        return dist.P2POp(fn, tensor, group=self.group, group_peer=peer)

    def launch(self, round, sends, recvs):
        bufs = [b for _, b in recvs]  # views of the runner's message arena
        peers = tuple(sorted({p for p, _ in sends} | {p for p, _ in recvs}))
        h = _Handle(round, [], bufs, peers, [t for _, t in sends])
        ops = [self._op(dist.isend, t, p) for p, t in sends] + [self._op(dist.irecv, b, p) for p, b in recvs]
        if not ops:
            return h
        tape = capturing_tape()
        if tape is not None:  # replays re-post the same transfers over the same (recorded) buffers
            tape.call(lambda: setattr(h, "works", dist.batch_isend_irecv(ops)))
        try:
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    h.works = dist.batch_isend_irecv(ops)
                for t in h.keep + bufs:
                    t.record_stream(self.stream)
            else:
                h.works = dist.batch_isend_irecv(ops)
        except Exception as err:  # noqa: BLE001
            raise ExecutionError(f"device {self.rank}, round {round}: posting transfers with devices "
                                 f"{list(peers)} failed: {err}") from err
        return h

    def wait(self, h: _Handle):
        tape = capturing_tape()
        if tape is not None and h.works:  # (the launch's replay holds the send buffers, in its ops)
            tape.call(lambda: self._wait_works(h))
        self._wait_works(h)
        h.keep.clear()
        return h.bufs

    def _wait_works(self, h: _Handle) -> None:
        for w in h.works:
            try:
                ok = w.wait(self.timeout) if self.timeout is not None else w.wait()
            except Exception as err:  # noqa: BLE001 - gloo/NCCL report a dead peer or a timeout as errors
                raise ExecutionError(
                    f"device {self.rank}, round {h.round}: transfers with devices {list(h.peers)} failed or timed "
                    f"out{f' after {self.timeout.total_seconds():g}s' if self.timeout else ''} (did a peer "
                    f"fail?): {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
            if ok is False:
                raise ExecutionError(f"device {self.rank}, round {h.round}: transfers with devices "
                                     f"{list(h.peers)} did not complete")


class DistributedExecutor:
    """Run ``plan``'s programs for this process's device (its rank in ``group``).

    Args:
        plan: the plan (identical on every rank).
        group: process group (None: the default group). Without an initialized process group a
            one-device plan runs locally.
        kernels: ``dcp.kernels`` backend name or kernels object (None: "auto").
        validate: prove the plan with ``dcp.ir.validate.validate`` once per plan object.
        timeout: seconds to wait for one round's transfers before raising ``ExecutionError`` (None: the
            process group's timeout).
        scale: softmax scale (None: 1/sqrt(head_dim)).
        partial_dtype: dtype of partial outputs on the wire (None: the element dtype).
        graphs: a ``dcp.execute.graphs.GraphCache``: run each direction as a program captured on its first
            call with these inputs' geometry and replayed by later ones (a CUDA graph on CUDA tensors, the
            tape stand-in on the CPU, which needs dispatcher kernels such as "reference"); None: eager.
    """

    def __init__(self, plan: Plan, group=None, kernels=None, validate: bool = True, timeout: float | None = None,
                 scale: float | None = None, partial_dtype: torch.dtype | None = None, graphs=None):
        if not isinstance(plan, Plan):
            raise ExecutionError(f"expected a dcp.Plan, got {type(plan).__name__}")
        self.plan, self.group = plan, group
        self.kernels = resolve_kernels(kernels)
        self.validate, self.timeout = validate, timeout
        self.scale = default_scale(plan, scale)
        self.partial_dtype = partial_dtype
        self.graphs = graphs
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            self.local = False
        elif group is None:
            self.rank, self.world, self.local = 0, 1, True
        else:
            raise ExecutionError("a process group was given but torch.distributed is not initialized")
        if self.world != plan.n_devices:
            raise ExecutionError(f"the plan is for {plan.n_devices} devices but the process group has "
                                 f"{self.world} ranks" + (" (torch.distributed is not initialized)"
                                                          if self.local else ""))
        if self.rank < 0:
            raise ExecutionError("this process is not a member of the given process group")

    # ------------------------------------------------------------------------------------ checks
    def check_inputs(self, q, k, v, **more) -> None:
        """Raise ``ExecutionError`` unless q/k/v (and ``more``) fit this rank's slice of the plan."""
        spec = self.plan.spec
        n = int(plan_tables(self.plan).n_local[self.rank])
        want = {"q": (n, spec.num_heads, spec.head_dim), "k": (n, spec.num_kv_heads, spec.head_dim),
                "v": (n, spec.num_kv_heads, spec.head_dim)}
        tensors = {"q": q, "k": k, "v": v, **more}
        want.update({"o": want["q"], "do": want["q"], "lse": (spec.num_heads, n)})
        for name, x in tensors.items():
            if not isinstance(x, torch.Tensor):
                raise ExecutionError(f"rank {self.rank}: {name} must be a torch.Tensor, got {type(x).__name__}")
            if tuple(x.shape) != want[name]:
                raise ExecutionError(f"rank {self.rank}: {name} has shape {list(x.shape)}, this rank's slice of "
                                     f"the plan needs {list(want[name])} ({n} local tokens, "
                                     f"plan.local_token_index({self.rank}))")
            if x.device != q.device:
                raise ExecutionError(f"rank {self.rank}: {name} is on {x.device}, q is on {q.device}")
            if name != "lse" and x.dtype != q.dtype:
                raise ExecutionError(f"rank {self.rank}: {name} has dtype {x.dtype}, q has {q.dtype}; q, k, v "
                                     f"must share one dtype")
        if not q.is_floating_point() or q.dtype not in (torch.float64, torch.float32, torch.bfloat16,
                                                        torch.float16):
            raise ExecutionError(f"rank {self.rank}: unsupported dtype {q.dtype}")
        if not self.local:
            backend = dist.get_backend(self.group)
            if backend == "nccl" and q.device.type != "cuda":
                raise ExecutionError(f"rank {self.rank}: the NCCL backend needs CUDA tensors, got {q.device}")
            if backend == "gloo" and q.device.type != "cpu":
                raise ExecutionError(f"rank {self.rank}: the gloo backend needs CPU tensors, got {q.device}")
            agree_on_plan(self.plan, self.group, self.rank, self.world, q.device, self.timeout)
        ensure_valid(self.plan, full=self.validate)

    # ------------------------------------------------------------------------------------ running
    def _comm(self, device):
        if self.local:
            from dcp.execute.reference import InMemoryComm

            return InMemoryComm().endpoint(0)
        comm = DistComm(self.group, self.rank, device, self.timeout)
        comm.warm_up()
        return comm

    def _program(self, direction: str, inputs) -> tuple:
        """Run this rank's ``direction`` program on detached ``inputs``: forward ``(q, k, v)``, backward
        ``(q, k, v, o, lse, do)`` (its home gets delta, ``backward_home``)."""
        home = tuple(inputs) if direction == "forward" else backward_home(*inputs)
        run = DeviceRunner(self.plan, self.rank, direction, home, self._comm(inputs[0].device), self.kernels,
                           self.scale, self.partial_dtype)
        run.run()
        return run.finish_forward() if direction == "forward" else run.finish_backward()

    def _run(self, direction: str, inputs: tuple) -> tuple:
        """``_program`` eagerly, or captured and replayed through ``self.graphs``."""
        inputs = [t.detach() for t in inputs]
        if self.graphs is None:
            return self._program(direction, inputs)
        x = inputs[0]
        kern = self.kernels.for_input(x.dtype, x.device, int(x.shape[-1]))
        if (self.graphs.backend or backend_for(x.device)) == "tape" and getattr(kern, "name", "") == "native":
            raise ExecutionError("the CPU stand-in of CUDA graphs (a tape of PyTorch operators) cannot record the "
                                 "native kernels, which run outside the dispatcher: use kernels='reference'")
        key = (self.plan, self.rank, direction, id(self.kernels), self.scale, self.partial_dtype,
               tuple((tuple(t.shape), t.dtype, t.device) for t in inputs))
        return self.graphs.run(key, lambda st: self._program(direction, st), inputs)

    def forward(self, q, k, v):
        """``(o_local [n_local, Hq, D], lse_local [Hq, n_local])`` of this rank."""
        self.check_inputs(q, k, v)
        return self._run("forward", (q, k, v))

    def backward(self, q, k, v, o, lse, do):
        """``(dq, dk, dv)`` local to this rank, from the forward's ``o``/``lse`` and the gradient ``do``."""
        self.check_inputs(q, k, v, o=o, lse=lse, do=do)
        return self._run("backward", (q, k, v, o, lse, do))


__all__ = ["DistributedExecutor", "DistComm"]
