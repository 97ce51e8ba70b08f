"""Python wrappers of the native kernels in ``dcp._C`` (C++, CPU) and ``dcp._C_cuda`` (CUDA merges).

Same signatures and semantics as ``dcp.kernels.reference``; inputs are checked here and every problem
is raised as ``dcp.errors.ExecutionError``. The attention kernels take CPU tensors; the merges also take
CUDA tensors when ``dcp._C_cuda`` was built.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from dcp.errors import ExecutionError
from dcp.kernels.reference import (
    check_attention_inputs,
    check_backward_inputs,
    check_merge_inputs,
)
from dcp.kernels.tiles import TileTable

try:  # the CPU extension
    from dcp import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built
    _C = None
    _IMPORT_ERROR = exc

try:  # the optional CUDA extension
    from dcp import _C_cuda  # type: ignore[attr-defined]
except ImportError:
    _C_cuda = None


def is_available() -> bool:
    """True when the C++ extension ``dcp._C`` was built and imports."""
    return _C is not None


def cuda_merge_available() -> bool:
    return _C_cuda is not None


def _require() -> None:
    if _C is None:
        raise ExecutionError(
            "the native kernels (dcp._C) are not built; run `pip install --no-build-isolation -e .` "
            f"with torch installed, or use the 'reference' backend ({_IMPORT_ERROR})")


@contextlib.contextmanager
def _as_execution_error() -> Iterator[None]:
    try:
        yield
    except ExecutionError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # TORCH_CHECK failures from the extension
        raise ExecutionError(str(exc).split("\nException raised from")[0]) from exc


def cpu_isa() -> str:
    """The instruction-set variant of the CPU kernels in use ('avx2' or 'generic')."""
    _require()
    return _C.cpu_isa()


def available_cpu_isas() -> list[str]:
    _require()
    return _C.available_cpu_isas().split(",")


@contextlib.contextmanager
def use_cpu_isa(name: str) -> Iterator[None]:
    """Temporarily select the 'generic' or 'avx2' CPU kernels (process-wide; for tests/benchmarks)."""
    _require()
    previous = _C.cpu_isa()
    with _as_execution_error():
        _C.set_cpu_isa(name)
    try:
        yield
    finally:
        _C.set_cpu_isa(previous)


def attention_forward(q_thd, k_thd, v_thd, tiles: TileTable, scale=None):
    """Block-table attention on CPU: ``(o_thd [Tq, Hq, D] in q's dtype, lse_ht [Hq, Tq] float32)``."""
    _require()
    *_, scale = check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale, "native attention_forward",
                                       cpu_only=True)
    q_thd, k_thd, v_thd = (_last_dim_contiguous(t) for t in (q_thd, k_thd, v_thd))
    with _as_execution_error():
        return _C.attention_forward(q_thd, k_thd, v_thd, *tiles.as_tuple(), scale)


def attention_backward(do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles: TileTable, scale=None,
                       out_dtype=None):
    """Gradient contributions ``(dq [Tq,Hq,D], dk [Tk,Hkv,D], dv [Tk,Hkv,D])`` of these tiles on CPU.

    See ``reference.attention_backward`` for the meaning of ``lse_ht`` / ``delta_ht`` / ``out_dtype``.
    """
    _require()
    fn = "native attention_backward"
    tq, hq, _, _, _, scale = check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale, fn, cpu_only=True)
    check_backward_inputs(do_thd, q_thd, lse_ht, delta_ht, out_dtype, hq, tq, fn)
    fp32 = out_dtype == torch.float32
    do_thd, q_thd, k_thd, v_thd = (_last_dim_contiguous(t) for t in (do_thd, q_thd, k_thd, v_thd))
    with _as_execution_error():
        return _C.attention_backward(do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, *tiles.as_tuple(), scale,
                                     fp32)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def merge_partials(o_list: Sequence[torch.Tensor], lse_list: Sequence[torch.Tensor]):
    """Log-sum-exp merge of partial ``o_i [T, H, D]``, ``lse_i [H, T]`` -> ``(o, lse)`` (o in o_list[0]'s dtype)."""
    _require()
    fn = "native merge_partials"
    check_merge_inputs(o_list, lse_list, fn)
    dtype = o_list[0].dtype
    if any(o.dtype != dtype for o in o_list):
        raise ExecutionError(f"{fn}: all partial outputs must share one dtype, got {[o.dtype for o in o_list]}")
    o_list = [_last_dim_contiguous(o) for o in o_list]
    with _as_execution_error():
        if o_list[0].device.type == "cuda":
            if _C_cuda is None:
                raise ExecutionError(f"{fn}: CUDA tensors need dcp._C_cuda, which was not built")
            return _C_cuda.merge_partials(list(o_list), [lse.contiguous() for lse in lse_list])
        if o_list[0].device.type != "cpu":
            raise ExecutionError(f"{fn}: unsupported device {o_list[0].device}")
        return _C.merge_partials(list(o_list), list(lse_list))


def merge_into(o_acc, lse_acc, o_new, lse_new):
    """In-place ``(o_acc, lse_acc) <- merge((o_acc, lse_acc), (o_new, lse_new))``; returns them.

    ``o_acc`` must be contiguous along D; its dtype may differ from ``o_new``'s (e.g. float32 accumulator).
    """
    _require()
    fn = "native merge_into"
    check_merge_inputs([o_acc, o_new], [lse_acc, lse_new], fn)
    if o_acc.shape[-1] > 1 and o_acc.stride(-1) != 1:
        raise ExecutionError(f"{fn}: o_acc must be contiguous along its last dim to be updated in place")
    o_new = _last_dim_contiguous(o_new)
    with _as_execution_error():
        if o_acc.device.type == "cuda":
            if _C_cuda is None:
                raise ExecutionError(f"{fn}: CUDA tensors need dcp._C_cuda, which was not built")
            if not lse_acc.is_contiguous():
                raise ExecutionError(f"{fn}: lse_acc must be contiguous on CUDA")
            _C_cuda.merge_into(o_acc, lse_acc, o_new, lse_new.contiguous())
        elif o_acc.device.type == "cpu":
            _C.merge_into(o_acc, lse_acc, o_new, lse_new)
        else:
            raise ExecutionError(f"{fn}: unsupported device {o_acc.device}")
    return o_acc, lse_acc
