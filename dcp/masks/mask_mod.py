"""Masks from FlexAttention-style predicates ("mask_mod" callables).

A mask_mod is a callable ``fn(q_idx, kv_idx) -> bool array`` (or FlexAttention's four-argument form
``fn(b, h, q_idx, kv_idx)``; ``b`` and ``h`` are passed as 0, and since a dcp mask is shared by every
head, sample rows are also evaluated at other ``b`` / ``h`` and a predicate that depends on them is
refused with ``InvalidMaskError``) that works elementwise on broadcast integer
arrays: ``q_idx`` has shape ``[rows, 1]`` and ``kv_idx`` shape ``[1, L]``. It is evaluated densely, a chunk
of query rows at a time (so memory stays bounded, about 16M elements per chunk), which costs O(L^2)
time: fine for tests and moderate lengths, prefer a dedicated mask class for very long sequences.

``from_mask_mod`` materializes the predicate for one length into a ``RangesMask`` (serializable);
``MaskModMask`` keeps the callable and evaluates it lazily for any length.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.base import Mask, check_int, check_seqlen, dense_to_ranges
from dcp.masks.ranges import RangesMask

#: default bound on the number of (query, key) pairs evaluated at once
CHUNK_ELEMENTS = 1 << 24
BACKENDS = ("auto", "numpy", "torch")


def _num_args(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]
    return 4 if len(required) == 4 else 2


def _call(fn: Callable, nargs: int, backend: str, q_start: int, q_stop: int, seqlen: int,
          rows: np.ndarray | None = None, b: int = 0, h: int = 0) -> np.ndarray:
    """``fn`` on query rows ``q_start:q_stop`` (or the given ``rows``) against every key: bool ``[rows, L]``."""
    q_rows = np.arange(q_start, q_stop, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    if backend == "torch":
        import torch

        q_idx = torch.from_numpy(q_rows)[:, None]
        kv_idx = torch.arange(seqlen, dtype=torch.int64)[None, :]
        bb, hh = torch.tensor(b, dtype=torch.int64), torch.tensor(h, dtype=torch.int64)
    else:
        q_idx = q_rows[:, None]
        kv_idx = np.arange(seqlen, dtype=np.int64)[None, :]
        bb, hh = np.int64(b), np.int64(h)
    out = fn(bb, hh, q_idx, kv_idx) if nargs == 4 else fn(q_idx, kv_idx)
    if hasattr(out, "detach"):  # torch tensor
        out = out.detach().cpu().numpy()
    out = np.asarray(out)
    if out.dtype != bool:
        if not (np.issubdtype(out.dtype, np.integer)):
            raise InvalidMaskError(f"mask_mod must return a boolean array, got dtype {out.dtype}")
        out = out != 0
    try:
        return np.broadcast_to(out, (q_rows.size, seqlen))
    except ValueError:
        raise InvalidMaskError(f"mask_mod returned shape {out.shape}, which does not broadcast to "
                               f"[{q_rows.size}, {seqlen}]") from None


#: (batch, head) indices a four-argument mask_mod is also evaluated at, on sample rows
OTHER_BATCH_HEADS = ((0, 1), (0, 2), (0, 3), (0, 7), (1, 0), (2, 0))
SAMPLE_ROWS = 16


def _check_shared_by_heads(fn: Callable, backend: str, seqlen: int) -> None:
    """A dcp mask is one per sequence, shared by every head and batch entry; FlexAttention's mask_mod may
    depend on ``b`` and ``h``. Evaluate sample rows at other (b, h) and refuse a predicate that changes."""
    rows = np.unique(np.linspace(0, seqlen - 1, min(seqlen, SAMPLE_ROWS)).astype(np.int64))
    base = _call(fn, 4, backend, 0, 0, seqlen, rows)
    for b, h in OTHER_BATCH_HEADS:
        try:
            other = _call(fn, 4, backend, 0, 0, seqlen, rows, b, h)
        except InvalidMaskError:
            raise
        except Exception as exc:
            raise InvalidMaskError(f"mask_mod {fn!r} failed for b={b}, h={h} ({exc!r}); dcp evaluates it at "
                                   f"b = h = 0 and applies it to every head, so it must not depend on them") from exc
        diff = np.flatnonzero((other != base).any(axis=1))
        if diff.size:
            which, fix = (("head index h", "dcp cannot mask heads differently") if b == 0 else
                          ("batch index b", "give each sequence its own mask instead"))
            raise InvalidMaskError(
                f"mask_mod {getattr(fn, '__qualname__', fn)!r} depends on the {which}: query row {int(rows[diff[0]])} "
                f"attends different keys at b={b}, h={h} than at b=0, h=0. A dcp mask is one per sequence, shared "
                f"by every head ({fix})")


def mask_mod_ranges(fn: Callable, seqlen: int, chunk: int | None = None, backend: str = "auto") -> np.ndarray:
    """Evaluate ``fn`` densely in row chunks and return its KV ranges ``[seqlen, R, 2]`` (int32)."""
    seqlen = check_seqlen(seqlen)
    if not callable(fn):
        raise InvalidMaskError(f"mask_mod must be callable, got {fn!r}")
    if backend not in BACKENDS:
        raise InvalidMaskError(f"mask_mod backend must be one of {BACKENDS}, got {backend!r}")
    rows = max(1, CHUNK_ELEMENTS // seqlen) if chunk is None else check_int(chunk, "mask_mod: chunk", 1)
    nargs = _num_args(fn)
    pieces = []
    for q_start in range(0, seqlen, rows):
        q_stop = min(seqlen, q_start + rows)
        if backend == "auto":  # numpy first; fall back to torch for torch-only predicates
            try:
                allowed = _call(fn, nargs, "numpy", q_start, q_stop, seqlen)
                backend = "numpy"
            except InvalidMaskError:
                raise
            except Exception as numpy_exc:
                try:
                    allowed = _call(fn, nargs, "torch", q_start, q_stop, seqlen)
                    backend = "torch"
                except InvalidMaskError:
                    raise
                except Exception:
                    raise InvalidMaskError(f"mask_mod {fn!r} failed on index arrays: {numpy_exc!r}") from numpy_exc
        else:
            try:
                allowed = _call(fn, nargs, backend, q_start, q_stop, seqlen)
            except InvalidMaskError:
                raise
            except Exception as exc:
                raise InvalidMaskError(f"mask_mod {fn!r} failed on {backend} index arrays: {exc!r}") from exc
        pieces.append(dense_to_ranges(allowed))
    if nargs == 4:
        _check_shared_by_heads(fn, backend, seqlen)
    max_r = max(p.shape[1] for p in pieces)
    out = np.zeros((seqlen, max_r, 2), dtype=np.int32)
    row = 0
    for p in pieces:
        out[row: row + p.shape[0], : p.shape[1]] = p
        row += p.shape[0]
    return out


def from_mask_mod(fn: Callable, seqlen: int, chunk: int | None = None, backend: str = "auto") -> RangesMask:
    """Materialize the predicate ``fn(q_idx, kv_idx)`` for a ``seqlen``-token sequence as a RangesMask.

    ``chunk`` is the number of query rows evaluated at once (default: ``2**24 // seqlen``); ``backend``
    picks the index array type: "numpy", "torch", or "auto" (numpy, falling back to torch if the predicate
    raises on numpy arrays).
    """
    return RangesMask(mask_mod_ranges(fn, seqlen, chunk=chunk, backend=backend))


@dataclass(frozen=True)
class MaskModMask(Mask):
    """A mask given by a mask_mod callable, evaluated lazily (densely, O(L^2)) for any length.

    ``name`` is a free label (the family name of this class is still ``"mask_mod"``). Equality and hashing
    use the callable's identity. ``describe()`` records the callable's qualified name for information
    only: callables cannot be rebuilt from a description (``from_mask_mod`` gives a serializable mask).
    """

    fn: Callable
    name: str = "mask_mod"
    backend: str = "auto"

    def __post_init__(self):
        if not callable(self.fn):
            raise InvalidMaskError(f"mask_mod: fn must be callable, got {self.fn!r}")
        if not isinstance(self.name, str) or not self.name:
            raise InvalidMaskError(f"mask_mod: name must be a non-empty string, got {self.name!r}")
        if self.backend not in BACKENDS:
            raise InvalidMaskError(f"mask_mod: backend must be one of {BACKENDS}, got {self.backend!r}")

    def describe(self) -> dict:
        fn_name = f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"
        return {"name": "mask_mod", "label": self.name, "fn": fn_name, "backend": self.backend}

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        return mask_mod_ranges(self.fn, seqlen, backend=self.backend)
