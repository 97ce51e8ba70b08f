"""Masks from FlexAttention-style predicates ("mask_mod" callables).

A mask_mod is a callable ``fn(q_idx, kv_idx) -> bool array`` (or FlexAttention's four-argument form
``fn(b, h, q_idx, kv_idx)``; ``b`` and ``h`` are passed as 0, and since a dcp mask is shared by every
head, sample rows are also evaluated at other ``b`` / ``h`` and a predicate that depends on them is
refused with ``InvalidMaskError``; with ``num_heads`` known — a ``BatchSpec`` passes its own — only heads
the model has are probed, so a mask_mod reading per-head tables that are equal for every head is fine)
that works elementwise on broadcast integer arrays.

Three ways to evaluate it (``method``):

- ``"dense"`` — the reference: every (q, kv) pair, ``q_idx [rows, 1]`` against ``kv_idx [1, L]`` in row
  chunks of about 16M pairs, encoded by ``dense_to_ranges``. O(L^2) time; kept as the oracle.
- ``"blocks"`` — FlexAttention-style block masks, exact: blocks of pairs are classified full / empty /
  partial by evaluating the mask_mod once on *bounds* of its index arrays (``dcp.masks.bounds``), partial
  blocks are split down to 16 x 16 leaves, and only the pairs of partial leaves are evaluated on concrete
  indices (``dcp.masks.mask_mod_blocks``). A partial block whose every column is constant over its rows
  (a strided mask far from the diagonal) is a *pattern*, none of its pairs evaluated and its rows written
  by broadcasting (``dcp.masks.mask_mod_bands``). Raises ``InvalidMaskError`` if the bounds cannot follow the
  mask_mod (e.g. it looks up a NumPy array: use a torch tensor for lookup tables).
- ``"auto"`` (default) — ``"blocks"``, or, where the bounds cannot follow the mask_mod, every pair
  evaluated in row chunks with a transition encoder into reused buffers (a warning says why when the
  sequence is long).

**Exactness.** All three give the same KV ranges for every mask_mod that is a pure function of its
index values (no state, no dependence on whether it is handed NumPy arrays, torch tensors or dcp's
bounds objects). ``"blocks"`` skips a block only when interval bounds, computed operation by operation
with rules that each contain every value the operation can take (integer results checked not to wrap in
their dtype), prove the predicate constant on *every* pair of the block — corners or samples are never
taken as evidence. Whatever the bounds cannot follow (floats, Python branches on traced values, NumPy
lookups, shape queries, a possibly out-of-range lookup index, ...) is evaluated exactly.

``from_mask_mod`` materializes the predicate for one length into a ``RangesMask`` (serializable);
``MaskModMask`` keeps the callable and evaluates it lazily for any length. Results are cached by
(function, length, options, closure contents) — see ``dcp.masks.mask_mod_cache``; ``cache=False`` for a
predicate that reads mutable global state.

``backend``: index arrays as NumPy arrays or torch tensors; "auto" tries torch first for a predicate
that holds torch tensors (in its closure, defaults or the globals it names: FlexAttention's mask_mods),
else NumPy first, and keeps the first that works.

``device``: concrete evaluations (partial leaves, the dense fallback) can run on a torch accelerator
(``"cuda"``, or ``"auto"``: CUDA when available) with transitions found there; the default is the CPU, so
that a planner process never opens a CUDA context by surprise. The accelerator path has not run on a GPU
in dcp's CI (it is tested with torch CPU tensors through the same code).
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks import box_counts, mask_mod_cache
from dcp.masks.base import Mask, check_int, check_seqlen, dense_to_ranges
from dcp.masks.bounds import Refused
from dcp.masks.mask_mod_blocks import BlockEvaluator, BlockStats, dense_ranges
from dcp.masks.progress import ProgressArg, reporter
from dcp.masks.ranges import RangesMask

#: default bound on the number of (query, key) pairs evaluated at once
CHUNK_ELEMENTS = 1 << 24
BACKENDS = ("auto", "numpy", "torch")
METHODS = ("auto", "blocks", "dense")
#: "auto" warns when it must evaluate every pair of a sequence at least this long
WARN_DENSE_SEQLEN = 8192


def _num_args(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]
    return 4 if len(required) == 4 else 2


def _call(fn: Callable, nargs: int, backend: str, q_idx: np.ndarray, kv_idx: np.ndarray, b: int = 0, h: int = 0,
          device: Any = None) -> Any:
    """``fn`` on int64 index arrays ``q_idx`` / ``kv_idx`` (broadcastable, e.g. ``[rows, 1]`` and ``[1, L]``):
    a bool NumPy array of their broadcast shape, or a torch bool tensor when ``device`` (a torch device)."""
    shape = np.broadcast_shapes(q_idx.shape, kv_idx.shape)
    if backend == "torch":
        import torch

        q, kv = torch.from_numpy(q_idx).to(device or "cpu"), torch.from_numpy(kv_idx).to(device or "cpu")
        bb, hh = (torch.tensor(x, dtype=torch.int64, device=device or "cpu") for x in (b, h))
    else:
        q, kv, bb, hh = q_idx, kv_idx, np.int64(b), np.int64(h)
    out = fn(bb, hh, q, kv) if nargs == 4 else fn(q, kv)
    if device is not None:
        return _on_device(out, shape, device)
    if hasattr(out, "detach"):  # torch tensor
        out = out.detach().cpu().numpy()
    out = np.asarray(out)
    if out.dtype != bool:
        if not (np.issubdtype(out.dtype, np.integer)):
            raise InvalidMaskError(f"mask_mod must return a boolean array, got dtype {out.dtype}")
        out = out != 0
    try:
        return np.broadcast_to(out, shape)
    except ValueError:
        raise InvalidMaskError(f"mask_mod returned shape {out.shape}, which does not broadcast to "
                               f"{list(shape)}") from None


def _on_device(out: Any, shape: tuple, device: Any) -> Any:
    import torch

    out = torch.as_tensor(out, device=device)
    if out.dtype != torch.bool:
        if out.is_floating_point() or out.is_complex():
            raise InvalidMaskError(f"mask_mod must return a boolean array, got dtype {out.dtype}")
        out = out != 0
    try:
        return out.expand(shape)
    except RuntimeError:
        raise InvalidMaskError(f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to "
                               f"{list(shape)}") from None


class ConcreteMaskMod:
    """A mask_mod on concrete index arrays, with its backend resolved on the first call ("auto": torch
    then NumPy for a predicate holding tensors, else NumPy then torch) and kept; failures become
    ``InvalidMaskError``.

    Called as ``(q_idx, kv_idx)``; returns what ``_call`` returns: a torch bool tensor on ``device`` when
    one is given and the mask_mod runs there, else a NumPy bool array. A mask_mod that fails on the
    device at its first call (NumPy-only code, lookup tables on another device) runs on the CPU instead.
    """

    def __init__(self, fn: Callable, nargs: int, backend: str, device: Any = None):
        self.fn, self.nargs, self.device = fn, nargs, device
        self.backend = backend
        # a predicate holding torch tensors is written for torch (FlexAttention): NumPy arrays mixed with
        # tensors can go silently wrong (``ndarray != torch.tensor(0)`` is the Python bool True)
        self.auto_order = ("torch", "numpy") if mask_mod_cache.holds_tensors(fn) else ("numpy", "torch")
        self.resolved = False

    def __call__(self, q_idx: np.ndarray, kv_idx: np.ndarray) -> Any:
        if self.resolved:
            candidates = [(self.backend, self.device)]
        else:  # the device first (if any), then the CPU backends in order; the first that works is kept
            candidates = [("torch", self.device)] if self.device is not None else []
            candidates += [(b, None) for b in (self.auto_order if self.backend == "auto" else (self.backend,))]
        first_exc = None
        for backend, device in candidates:
            try:
                out = _call(self.fn, self.nargs, backend, q_idx, kv_idx, device=device)
            except InvalidMaskError:
                raise
            except Exception as exc:
                first_exc = first_exc or exc
                continue
            self.backend, self.device, self.resolved = backend, device, True
            return out
        what = "" if self.backend == "auto" else f"{self.backend} "
        raise InvalidMaskError(f"mask_mod {self.fn!r} failed on {what}index arrays: {first_exc!r}") from first_exc

    def at(self, q_idx: np.ndarray, kv_idx: np.ndarray, b: int, h: int) -> np.ndarray:
        """At batch ``b``, head ``h`` with the resolved backend, as a NumPy array; exceptions unwrapped."""
        if not self.resolved:
            self(q_idx, kv_idx)
        out = _call(self.fn, self.nargs, self.backend, q_idx, kv_idx, b, h, self.device)
        return out.cpu().numpy() if hasattr(out, "cpu") else out


#: (batch, head) indices a four-argument mask_mod is also evaluated at, on sample rows, when the model's
#: head count is not known; with ``num_heads`` given, heads 1, 2, 3, 7 and the last one below it
OTHER_BATCH_HEADS = ((0, 1), (0, 2), (0, 3), (0, 7), (1, 0), (2, 0))
SAMPLE_ROWS = 16


def probe_points(num_heads: int | None) -> tuple[tuple[int, int], ...]:
    """The (b, h) a four-argument mask_mod is compared at against (0, 0): only heads the model has."""
    if num_heads is None:
        return OTHER_BATCH_HEADS
    heads = sorted({h for h in (1, 2, 3, 7, num_heads - 1) if 0 < h < num_heads})
    return tuple((0, h) for h in heads) + tuple(bh for bh in OTHER_BATCH_HEADS if bh[0])


def _check_shared_by_heads(concrete: ConcreteMaskMod, seqlen: int, num_heads: int | None = None) -> None:
    """A dcp mask is one per sequence, shared by every head and batch entry; FlexAttention's mask_mod may
    depend on ``b`` and ``h``. Evaluate sample rows at other (b, h) (``probe_points``: only heads below
    ``num_heads`` when it is known) and refuse a predicate that changes. A mask_mod that fails at a head
    it is probed at is refused too (name the model's head count to probe only heads it has); one that
    fails at a batch index b >= 1 is not probed there: its tables hold one batch entry (packed
    sequences), and dcp evaluates it at b = 0 only."""
    fn = concrete.fn
    rows = np.unique(np.linspace(0, seqlen - 1, min(seqlen, SAMPLE_ROWS)).astype(np.int64))[:, None]
    kv_idx = np.arange(seqlen, dtype=np.int64)[None, :]
    base = concrete.at(rows, kv_idx, 0, 0)  # resolves the backend (InvalidMaskError if none works)
    for b, h in probe_points(num_heads):
        try:
            other = concrete.at(rows, kv_idx, b, h)
        except InvalidMaskError:
            raise
        except Exception as exc:
            if b:
                continue
            hint = ("" if num_heads is not None else f". If the model has at most {h} heads, say so: "
                    f"num_heads= (a BatchSpec passes its own)")
            raise InvalidMaskError(f"mask_mod {fn!r} failed for b={b}, h={h} ({exc!r}); dcp evaluates it at "
                                   f"b = h = 0 and applies it to every head, so it must not depend on them"
                                   f"{hint}") from exc
        diff = np.flatnonzero((other != base).any(axis=1))
        if diff.size:
            which, fix = (("head index h", "dcp cannot mask heads differently") if b == 0 else
                          ("batch index b", "give each sequence its own mask instead"))
            raise InvalidMaskError(
                f"mask_mod {getattr(fn, '__qualname__', fn)!r} depends on the {which}: query row {int(rows[diff[0], 0])} "
                f"attends different keys at b={b}, h={h} than at b=0, h=0. A dcp mask is one per sequence, shared "
                f"by every head ({fix})")


def _reference_ranges(concrete: ConcreteMaskMod, seqlen: int, rows: int) -> np.ndarray:
    """The dense reference: every pair, row chunks of ``rows``, ``dense_to_ranges`` per chunk."""
    pieces = []
    kv_idx = np.arange(seqlen, dtype=np.int64)[None, :]
    for q_start in range(0, seqlen, rows):
        q_idx = np.arange(q_start, min(seqlen, q_start + rows), dtype=np.int64)[:, None]
        allowed = concrete(q_idx, kv_idx)
        pieces.append(dense_to_ranges(allowed.cpu().numpy() if hasattr(allowed, "cpu") else allowed))
    max_r = max(p.shape[1] for p in pieces)
    out = np.zeros((seqlen, max_r, 2), dtype=np.int32)
    row = 0
    for p in pieces:
        out[row: row + p.shape[0], : p.shape[1]] = p
        row += p.shape[0]
    return out


def _resolve_device(device: Any) -> Any:
    """None for the NumPy/CPU path ("cpu", None, or "auto" without CUDA), else the torch device that
    concrete evaluations run on (a ``torch.device`` object, even ``torch.device("cpu")``, selects this
    torch path: that is how the accelerator code is tested without one)."""
    if device is None or (isinstance(device, str) and device == "cpu"):
        return None
    import torch

    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidMaskError(f"mask_mod: device must be 'cpu', 'auto' or a torch device, got {device!r}") from exc


def evaluate_mask_mod(fn: Callable, seqlen: int, chunk: int | None = None, backend: str = "auto",
                      method: str = "auto", device: Any = "cpu", leaf: int = 16, num_heads: int | None = None,
                      progress: ProgressArg = None) -> tuple[np.ndarray, BlockStats]:
    """KV ranges ``[seqlen, R, 2]`` (int32) of ``fn`` and what the evaluation did (uncached)."""
    ranges, stats, _ = _evaluate(fn, seqlen, chunk, backend, method, device, leaf, num_heads, progress)
    return ranges, stats


def _evaluate(fn: Callable, seqlen: int, chunk: int | None, backend: str, method: str, device: Any, leaf: int,
              num_heads: int | None, progress: ProgressArg) -> tuple[np.ndarray, BlockStats, Any]:
    """``evaluate_mask_mod`` plus (the result's ``RangesIndex``, its ``range_profile``) where the blockwise
    path made them (else None)."""
    seqlen = check_seqlen(seqlen)
    if not callable(fn):
        raise InvalidMaskError(f"mask_mod must be callable, got {fn!r}")
    if backend not in BACKENDS:
        raise InvalidMaskError(f"mask_mod backend must be one of {BACKENDS}, got {backend!r}")
    if method not in METHODS:
        raise InvalidMaskError(f"mask_mod method must be one of {METHODS}, got {method!r}")
    rows = max(1, CHUNK_ELEMENTS // seqlen) if chunk is None else check_int(chunk, "mask_mod: chunk", 1)
    leaf = check_int(leaf, "mask_mod: leaf", 1)
    if leaf & (leaf - 1):
        raise InvalidMaskError(f"mask_mod: leaf must be a power of two, got {leaf}")
    if num_heads is not None:
        num_heads = check_int(num_heads, "mask_mod: num_heads", 1)
    nargs = _num_args(fn)
    torch_device = _resolve_device(device)
    concrete = ConcreteMaskMod(fn, nargs, backend, torch_device)
    if nargs == 4:
        _check_shared_by_heads(concrete, seqlen, num_heads)
    stats = BlockStats(seqlen=seqlen, leaf=leaf)
    if method == "dense":
        stats.exact_pairs = seqlen * seqlen
        return _reference_ranges(concrete, seqlen, rows), stats, (None, None)
    report = reporter(progress, f"mask_mod {getattr(fn, '__qualname__', fn)!r} on {seqlen:,} tokens")
    try:
        blocks = BlockEvaluator(fn, nargs, seqlen, concrete, leaf=leaf, progress=report)
        try:
            return blocks.ranges(), blocks.stats, (blocks.index, blocks.profile)
        except Refused as why:
            if method == "blocks":
                raise InvalidMaskError(f"mask_mod {getattr(fn, '__qualname__', fn)!r} cannot be evaluated blockwise: "
                                       f"{why} (see dcp.masks.bounds for what can)") from None
            stats.fallback = str(why)
        if seqlen >= WARN_DENSE_SEQLEN:
            warnings.warn(f"mask_mod {getattr(fn, '__qualname__', fn)!r}: evaluating all {seqlen}^2 (q, kv) pairs, "
                          f"since its blocks cannot be bounded ({stats.fallback}); see dcp.masks.bounds for what "
                          "can (e.g. lookups in torch tensors rather than NumPy arrays)", stacklevel=4)
        return dense_ranges(concrete, seqlen, chunk_elements=rows * seqlen, stats=stats, progress=report), stats, \
            (None, None)
    finally:
        if report is not None:
            report.close()


def shared_ranges(fn: Callable, seqlen: int, chunk: int | None = None, backend: str = "auto",
                  method: str = "auto", device: Any = "cpu", leaf: int = 16, cache: bool = True,
                  num_heads: int | None = None, progress: ProgressArg = None) -> np.ndarray:
    """``mask_mod_ranges`` as one read-only array, the cache's own (not a copy): what a ``RangesMask`` or
    a ``BatchSpec`` holds. A blockwise result of many ranges per row comes with its pair-count index
    (``dcp.masks.box_counts``), so that planning with it does not build one from the ranges."""
    options = (check_seqlen(seqlen), chunk, backend, method, str(device), leaf, num_heads)
    if cache and callable(fn):
        hit = mask_mod_cache.lookup(fn, options, copy=False)
        if hit is not None:
            return hit
    ranges, _, (index, profile) = _evaluate(fn, seqlen, chunk, backend, method, device, leaf, num_heads, progress)
    if ranges.base is not None:  # a view (the dense paths): own the data, so that it can be read-only
        ranges = ranges.copy()
    ranges.setflags(write=False)
    if index is not None or profile is not None:
        box_counts.register_index(ranges, index, profile)
    if cache:
        mask_mod_cache.store(fn, options, ranges, take=True)
    return ranges


def mask_mod_ranges(fn: Callable, seqlen: int, chunk: int | None = None, backend: str = "auto",
                    method: str = "auto", device: Any = "cpu", leaf: int = 16,
                    cache: bool = True, num_heads: int | None = None, progress: ProgressArg = None) -> np.ndarray:
    """KV ranges ``[seqlen, R, 2]`` (int32) of the predicate ``fn`` (see the module docstring): a fresh,
    writable array."""
    return shared_ranges(fn, seqlen, chunk=chunk, backend=backend, method=method, device=device, leaf=leaf,
                         cache=cache, num_heads=num_heads, progress=progress).copy()


def from_mask_mod(fn: Callable, seqlen: int, chunk: int | None = None, backend: str = "auto",
                  method: str = "auto", device: Any = "cpu", cache: bool = True, num_heads: int | None = None,
                  progress: ProgressArg = None) -> RangesMask:
    """Materialize the predicate ``fn(q_idx, kv_idx)`` for a ``seqlen``-token sequence as a RangesMask.

    ``chunk`` is the number of query rows the dense paths evaluate at once (default: ``2**24 // seqlen``);
    ``backend`` picks the index array type: "numpy", "torch", or "auto" (see the module docstring, as for
    ``method``, ``device`` and ``cache``). ``num_heads``: the model's query heads, for a four-argument
    mask_mod built from per-head tables (it is probed for head dependence at those heads only).
    ``progress``: None (a line on stderr every few seconds once it has run for a few: ``dcp.masks.progress``),
    False, or a callable ``fn(fraction_done)``.
    """
    return RangesMask.from_valid(shared_ranges(fn, seqlen, chunk=chunk, backend=backend, method=method,
                                               device=device, cache=cache, num_heads=num_heads, progress=progress))


@dataclass(frozen=True)
class MaskModMask(Mask):
    """A mask given by a mask_mod callable, evaluated lazily for any length (blockwise, cached).

    ``name`` is a free label (the family name of this class is still ``"mask_mod"``). Equality and hashing
    use the callable's identity. ``describe()`` records the callable's qualified name for information
    only: callables cannot be rebuilt from a description (``from_mask_mod`` gives a serializable mask).
    """

    fn: Callable
    name: str = "mask_mod"
    backend: str = "auto"
    method: str = "auto"
    device: Any = "cpu"
    cache: bool = True
    #: the model's query heads, if known (a ``BatchSpec`` passes its own): see ``from_mask_mod``
    num_heads: int | None = None
    progress: Any = field(default=None, compare=False)

    def __post_init__(self):
        if not callable(self.fn):
            raise InvalidMaskError(f"mask_mod: fn must be callable, got {self.fn!r}")
        if not isinstance(self.name, str) or not self.name:
            raise InvalidMaskError(f"mask_mod: name must be a non-empty string, got {self.name!r}")
        if self.backend not in BACKENDS:
            raise InvalidMaskError(f"mask_mod: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.method not in METHODS:
            raise InvalidMaskError(f"mask_mod: method must be one of {METHODS}, got {self.method!r}")

    def describe(self) -> dict:
        fn_name = f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"
        return {"name": "mask_mod", "label": self.name, "fn": fn_name, "backend": self.backend,
                "method": self.method}

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        return self.validated_ranges(seqlen).copy()

    def validated_ranges(self, seqlen: int, num_heads: int | None = None) -> np.ndarray:
        """The cached read-only ranges (valid by construction); ``num_heads``: the model's, else the
        mask's own."""
        return shared_ranges(self.fn, seqlen, backend=self.backend, method=self.method, device=self.device,
                             cache=self.cache, num_heads=self.num_heads if num_heads is None else num_heads,
                             progress=self.progress)
