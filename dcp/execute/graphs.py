"""Captured programs: one device's forward or backward program recorded once, with fixed buffers, and
replayed by every layer that runs the same plan (``DCPAttention(cuda_graphs=True)``).

The executor's compiled steps (``dcp.execute.compile``) resolve every index, view and copy once per plan and
read no tensor data on the host, so a direction's whole program is a fixed sequence of kernel launches,
copies and transfers over fixed buffers: what a CUDA graph needs. A ``CapturedProgram`` holds static
input tensors; a call copies the layer's inputs into them, replays, and returns clones of the static
outputs (a later replay overwrites them).

Backends:
- ``"cuda"``: ``torch.cuda.CUDAGraph``. One eager warm-up on a side stream (builds the plan's tables,
  workspace and NCCL communicators), then capture; transfers are captured NCCL point-to-point operations.
- ``"tape"`` (CPU): ``TapeGraph``, a stand-in with the same discipline that runs anywhere: the capture
  runs the program once under a ``TorchDispatchMode`` that records every PyTorch operator call (function,
  arguments, outputs); a replay re-issues exactly those calls on the recorded tensors, writing functional
  results into the recorded outputs, and re-posts the transport's transfers (``TapeGraph.call``). No
  executor Python runs on replay, so a hidden dependence of the program on tensor data (a host read, a
  data-dependent branch) makes replay differ from eager execution, which the tests check. Only PyTorch
  operators are recorded: kernels outside the dispatcher (the native CPU extension's functions) would be
  skipped, so the tape needs dispatcher kernels (``kernels="reference"``) and refuses the others.

Both capture under ``NoHostSync``: an operator that makes the host wait for a device (``.item()``,
``bool(t)``, ``nonzero``, a copy to the CPU, ...) raises ``HostSyncError`` instead of being captured. On
the CPU every tensor is on the host, so "device data" is what derives from the program's inputs (tracked
per storage through every operator); the tile tables the kernels read on the host are metadata.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from typing import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dcp.errors import ExecutionError
from dcp.kernels.masked import branch_free

BACKENDS = ("cuda", "tape")


class HostSyncError(ExecutionError):
    """A captured program made the host wait for a device (it would break a CUDA graph)."""


# aten operators whose result the host must read before it can go on (each one a device-to-host sync on CUDA)
_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2",
                       "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal", "is_nonzero",
                       "item", "allclose", "masked_scatter_", "_to_copy", "copy_"})
_SYNC_METHODS = {torch.Tensor.tolist: "tolist()", torch.Tensor.numpy: "numpy()", torch.Tensor.item: "item()",
                 torch.Tensor.__bool__: "bool()", torch.Tensor.__int__: "int()", torch.Tensor.__float__: "float()",
                 torch.Tensor.__index__: "index()"}


def _key(t: torch.Tensor):
    return None if t.device.type == "meta" else (t.device, t.untyped_storage().data_ptr())


class _Data:
    """Which storages hold data derived from the program's inputs (on the CPU, the stand-in for what lives
    on a GPU): a host read of one of them, or of any tensor not on the CPU, is a host synchronisation. Host
    metadata (tile tables, offsets) that the executor's kernels read on the host is not data."""

    def __init__(self, inputs):
        self.keys = {k for k in (_key(t) for t in inputs) if k is not None}

    def holds(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t.device.type not in ("cpu", "meta") or _key(t) in self.keys)

    def check(self, what: str, args) -> None:
        if any(self.holds(t) for t in tree_flatten(args)[0]):
            raise HostSyncError(f"the captured program reads data on the host ({what}); a CUDA graph cannot "
                                f"capture that")


class _NoSyncFunctions(TorchFunctionMode):
    def __init__(self, data: _Data):
        super().__init__()
        self.data = data

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _SYNC_METHODS.get(func)
        if name is not None:
            self.data.check(name, args[:1])
        return func(*args, **(kwargs or {}))


class _NoSyncDispatch(TorchDispatchMode):
    def __init__(self, data: _Data):
        super().__init__()
        self.data = data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _SYNC_OPS and _syncs(name, args, kwargs, self.data):
            raise HostSyncError(f"the captured program calls {func} on data (the host waits for its result); a "
                                f"CUDA graph cannot capture that")
        out = func(*args, **kwargs)
        tensors_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tainted = any(_key(t) in self.data.keys for t in tensors_in)
        if func._schema.is_mutable:  # written in place: the written arguments now hold data if any input did
            written = [a for a, arg in zip(args, func._schema.arguments) if arg.alias_info and arg.alias_info.is_write]
            written += [kwargs[arg.name] for arg in func._schema.arguments
                        if arg.alias_info and arg.alias_info.is_write and arg.name in kwargs]
            targets = tree_flatten(written)[0]
        else:
            targets = tree_flatten(out)[0]
        for t in targets:
            k = _key(t) if isinstance(t, torch.Tensor) else None
            if k is None:
                continue
            if tainted:
                self.data.keys.add(k)
            elif not func.is_view and not func._schema.is_mutable:
                self.data.keys.discard(k)  # a fresh allocation (a freed data storage's memory may be reused)
        return out


def _syncs(name: str, args, kwargs, data: _Data) -> bool:
    """Whether this call makes the host wait for data: reading it (``item``, ``nonzero``, ...) or copying it
    from a device to the CPU (a copy between CPU tensors, or to a device, does not)."""
    if name == "_to_copy":
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type not in ("cpu", "meta")
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type not in ("cpu", "meta")
    return any(data.holds(t) for t in tree_flatten((args, kwargs))[0])


@contextlib.contextmanager
def NoHostSync(inputs=()):
    """Raise ``HostSyncError`` at any host synchronisation inside the block: a host read of a tensor not on
    the CPU, or of data derived from ``inputs`` (the CPU stand-in for device data; module docstring)."""
    data = _Data(inputs)
    with _NoSyncFunctions(data), _NoSyncDispatch(data):
        yield


_NO_DATA = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_TAPE: contextvars.ContextVar = contextvars.ContextVar("dcp_tape", default=None)


def capturing_tape() -> "TapeGraph | None":
    """The ``TapeGraph`` being captured in this context (transports register their replays with it)."""
    return _TAPE.get()


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: "TapeGraph"):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "c10d":  # transfers replay through TapeGraph.call (their Work must be waited)
            self.tape.entries.append(("op", func, args, kwargs, out))
        return out


class TapeGraph:
    """A replayable record of PyTorch operator calls (module docstring), with ``torch.cuda.CUDAGraph``'s
    ``replay()``; ``capture()`` is the context manager that records."""

    def __init__(self):
        self.entries: list = []
        self.captured = False

    @contextlib.contextmanager
    def capture(self):
        if self.captured:
            raise ExecutionError("a TapeGraph is captured once")
        token = _TAPE.set(self)
        try:
            with _Recorder(self):
                yield self
        finally:
            _TAPE.reset(token)
            self.captured = True

    def call(self, fn: Callable[[], None]) -> None:
        """Replay ``fn()`` at this point of the tape (a transport re-posting or waiting for its transfers)."""
        self.entries.append(("call", fn))

    def replay(self) -> None:
        if not self.captured:
            raise ExecutionError("replay() before capture")
        for e in self.entries:
            if e[0] == "call":
                e[1]()
                continue
            _, func, args, kwargs, out = e
            res = func(*args, **kwargs)
            if func.is_view or func._schema.is_mutable or func._overloadpacket.__name__ in _NO_DATA:
                continue  # a view of recorded tensors, written in place / into out=, or uninitialized: no copy
            for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o is not r and o.numel() \
                        and not _same_memory(o, r):
                    o.copy_(r)

    @property
    def n_ops(self) -> int:
        return sum(1 for e in self.entries if e[0] == "op")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta":
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == \
        b.storage_offset() and a.stride() == b.stride()


def backend_for(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "tape"


class CapturedProgram:
    """``run(static_inputs) -> outputs``, captured once over static copies of the first call's inputs and
    replayed by every later call (module docstring). ``backend``: "cuda" or "tape" (None: by device)."""

    def __init__(self, run: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]],
                 inputs: Sequence[torch.Tensor], backend: str | None = None):
        if backend is None:
            backend = backend_for(inputs[0].device)
        if backend not in BACKENDS:
            raise ExecutionError(f"graph backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.static_in = [x.detach().clone() for x in inputs]
        if backend == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(device=inputs[0].device)
            side.wait_stream(torch.cuda.current_stream(inputs[0].device))
            with torch.cuda.stream(side):
                run(self.static_in)  # warm-up: tables, workspace, communicators
            torch.cuda.current_stream(inputs[0].device).wait_stream(side)
            with NoHostSync(self.static_in), branch_free(), torch.cuda.graph(self.graph):
                self.static_out = tuple(run(self.static_in))
            self.graph.replay()  # capture does not execute: the first call's results come from a replay
        else:
            self.graph = TapeGraph()
            run(self.static_in)  # warm-up, as for CUDA: per-plan tables and checks are built and cached here
            with NoHostSync(self.static_in), branch_free(), self.graph.capture():
                self.static_out = tuple(run(self.static_in))
        self.replays = 0

    def __call__(self, inputs: Sequence[torch.Tensor], first: bool = False) -> tuple[torch.Tensor, ...]:
        """The outputs for ``inputs`` (clones). ``first``: the call that captured (its inputs are in place)."""
        if not first:
            if len(inputs) != len(self.static_in) or any(
                    tuple(x.shape) != tuple(s.shape) or x.dtype != s.dtype or x.device != s.device
                    for x, s in zip(inputs, self.static_in)):
                raise ExecutionError("a captured program replays only inputs of its capture's shapes, dtypes "
                                     "and device")
            torch._foreach_copy_(self.static_in, [x.detach() for x in inputs])
            self.graph.replay()
            self.replays += 1
        return tuple(t.clone() for t in self.static_out)


class GraphCache:
    """Captured programs by key (plan, direction, rank, input geometry, kernels, scale), least recently used
    first out beyond ``max_programs`` (a new plan per step makes the old ones useless)."""

    def __init__(self, max_programs: int = 8, backend: str | None = None):
        if max_programs < 1:
            raise ExecutionError(f"max_programs must be >= 1, got {max_programs}")
        self.max_programs, self.backend = max_programs, backend
        self.programs: OrderedDict = OrderedDict()
        self.captures = 0

    def run(self, key, run: Callable, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        prog = self.programs.get(key)
        if prog is not None:
            self.programs.move_to_end(key)
            return prog(inputs)
        prog = CapturedProgram(run, inputs, self.backend)
        self.captures += 1
        self.programs[key] = prog
        while len(self.programs) > self.max_programs:
            self.programs.popitem(last=False)
        return prog(inputs, first=True)


__all__ = ["CapturedProgram", "GraphCache", "TapeGraph", "NoHostSync", "HostSyncError", "capturing_tape", "BACKENDS"]
