"""Blockwise attention kernels over a tile table, and log-sum-exp merges of partial results.

    kernels = get_kernels()            # "native" (C++ CPU) if built, else "reference" (pure PyTorch)
    o_thd, lse_ht = kernels.forward(q_thd, k_thd, v_thd, tiles)
    dq, dk, dv = kernels.backward(do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles)
    o, lse = kernels.merge_partials([o1, o2], [lse1, lse2])
    kernels.merge_into(o_acc, lse_acc, o_new, lse_new)

Backends: ``reference`` (pure PyTorch, any device), ``native`` (C++ CPU, ``dcp._C``), ``varlen`` (the tile
table as a few fused flash-attention varlen calls: flash-attn or PyTorch's flash kernel on a GPU).

Layouts: q/o/do ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, lse/delta ``[Hq, Tq]`` float32. The tile table
(``TileTable``) is described in ``dcp.kernels.tiles``.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from dcp.errors import ExecutionError
from dcp.kernels import native, reference, varlen
from dcp.kernels.tiles import TileTable

__all__ = ["AttentionKernels", "TileTable", "available_backends", "get_kernels", "native", "reference"]


@dataclasses.dataclass(frozen=True)
class AttentionKernels:
    """One backend's kernels (same signatures as ``dcp.kernels.reference``)."""

    name: str
    forward: Callable
    backward: Callable
    merge_partials: Callable
    merge_into: Callable


_BACKENDS = {
    "reference": AttentionKernels("reference", reference.attention_forward, reference.attention_backward,
                                  reference.merge_partials, reference.merge_into),
    "native": AttentionKernels("native", native.attention_forward, native.attention_backward,
                               native.merge_partials, native.merge_into),
    # fused varlen calls: flash-attn / PyTorch's flash kernel on a GPU, a plain-PyTorch emulation elsewhere
    "varlen": AttentionKernels("varlen", varlen.attention_forward, varlen.attention_backward,
                               varlen.merge_partials, varlen.merge_into),
}
_warned_fallback = False


def available_backends() -> list[str]:
    """Backends usable here: always 'reference' and 'varlen' (emulated off the GPU), plus 'native' when
    ``dcp._C`` is built."""
    return ["reference", "varlen"] + (["native"] if native.is_available() else [])


def get_kernels(name: str = "auto") -> AttentionKernels:
    """The kernels of backend ``name``: 'reference', 'native', 'varlen', or 'auto' (native if built, else
    reference with a one-time warning; executors switch CUDA half-precision inputs to 'varlen').
    Raises ``ExecutionError`` for an unknown or unavailable backend."""
    global _warned_fallback
    if name == "auto":
        if native.is_available():
            return _BACKENDS["native"]
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn("dcp: native kernels (dcp._C) are not built, using the slow pure-PyTorch reference "
                          "kernels; build them with `pip install --no-build-isolation -e .`", RuntimeWarning,
                          stacklevel=2)
        return _BACKENDS["reference"]
    if name not in _BACKENDS:
        raise ExecutionError(f"unknown kernel backend {name!r}; choose one of 'auto', {sorted(_BACKENDS)}")
    if name == "native" and not native.is_available():
        native._require()  # raises with build instructions
    return _BACKENDS[name]
