"""Cache of mask_mod results by (function identity, length, options, closure contents).

A ``MaskModMask`` is evaluated for every new ``BatchSpec`` that holds it; the KV ranges of a given
predicate and length do not change, so they are kept here. The key is the function object itself (held
by weak reference where the callable allows it, so that caching never keeps a closure and its tables
alive), the length and the evaluation options, plus a *fingerprint* of what the function closes over:
the contents (hashed bytes) of NumPy arrays and torch tensors and the values of scalars found in its
closure cells, defaults, ``functools.partial`` arguments and the module globals its code names,
recursively through nested functions
(eight levels). So rebuilding a document mask_mod with new document ids, or mutating a captured tensor in place,
misses the cache. What the fingerprint cannot see — attributes of other captured objects (held by
identity only), containers such as dicts, tables reached through a module attribute — must not change
under a cached function; pass ``cache=False`` for such predicates.

At most ``MAX_BYTES`` of ranges are kept (least recently used first out); entries go with their function.
"""
from __future__ import annotations

import functools
import hashlib
import sys
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np

MAX_BYTES = 256 << 20
MAX_DEPTH = 8

_lock = threading.Lock()
_entries: OrderedDict[tuple, tuple[Any, tuple, np.ndarray]] = OrderedDict()
_bytes = 0
_dead: list[int] = []  # ids of cached functions that died (see _ref)


def _array_key(data: bytes, shape: tuple, dtype: str) -> tuple:
    return ("array", shape, dtype, hashlib.blake2b(data, digest_size=16).digest())


def _value_key(x: Any, depth: int) -> Hashable:
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return (type(x).__name__, x)
    if isinstance(x, np.generic):
        return ("scalar", x.dtype.str, x.item())
    if isinstance(x, np.ndarray):
        return _array_key(np.ascontiguousarray(x).tobytes(), x.shape, x.dtype.str)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        flat = x.detach().reshape(-1).contiguous().cpu()
        return _array_key(flat.view(torch.uint8).numpy().tobytes(), tuple(x.shape), str(x.dtype))
    if isinstance(x, (tuple, list)) and len(x) <= 256 and depth < MAX_DEPTH:
        return (type(x).__name__, tuple(_value_key(v, depth + 1) for v in x))
    if callable(x) and depth < MAX_DEPTH:
        return ("callable", id(x), fingerprint(x, depth + 1))
    return ("object", id(x))  # identity only (see the module docstring)


def closure_items(fn: Callable) -> list:
    """The values ``fn`` holds besides its code: closure cells, defaults, ``functools.partial`` arguments,
    and the module globals its code names (modules themselves excluded)."""
    if isinstance(fn, functools.partial):
        return [fn.func, *fn.args, *sorted(fn.keywords.items())]
    items = []
    code, module_globals = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is not None and module_globals is not None:
        for name in code.co_names:  # global names and attribute names; only the globals resolve
            value = module_globals.get(name)
            if value is not None and not isinstance(value, types.ModuleType):
                items.append(value)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            items.append(cell.cell_contents)
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            items.append(None)
    items += list(getattr(fn, "__defaults__", None) or ())
    items += sorted((getattr(fn, "__kwdefaults__", None) or {}).items())
    return items


def fingerprint(fn: Callable, depth: int = 0) -> tuple:
    """What ``fn``'s values depend on besides its code: its closure, defaults and partial arguments."""
    return tuple(_value_key(x, depth) for x in closure_items(fn))


def holds_tensors(fn: Callable, depth: int = 0) -> bool:
    """Whether ``fn`` (or a function or tuple it holds, ``MAX_DEPTH`` levels deep) holds a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is None or depth >= MAX_DEPTH:
        return False
    for x in closure_items(fn):
        if isinstance(x, torch.Tensor):
            return True
        nested = x if isinstance(x, (tuple, list)) and len(x) <= 256 else (x,)
        for y in nested:
            if isinstance(y, torch.Tensor) or (callable(y) and holds_tensors(y, depth + 1)):
                return True
    return False


def _ref(fn: Callable) -> Any:
    try:
        # the callback may run inside any allocation, even under _lock: it only records the dead id
        return weakref.ref(fn, lambda _ref, key=id(fn): _dead.append(key))
    except TypeError:  # not weakly referenceable: hold it (its entries then live until evicted)
        return fn


def _alive(ref: Any) -> Any:
    return ref() if isinstance(ref, weakref.ref) else ref


def _purge_dead() -> None:
    """Drop the entries of functions that died since the last call (call under _lock)."""
    global _bytes
    while _dead:
        fn_id = _dead.pop()
        for key in [k for k in _entries if k[0] == fn_id and _alive(_entries[k][0]) is None]:
            _bytes -= _entries.pop(key)[2].nbytes


def lookup(fn: Callable, options: tuple, copy: bool = True) -> np.ndarray | None:
    """The cached ranges of ``fn`` under ``options`` (a copy; with ``copy=False`` the read-only array
    itself), or None."""
    key = (id(fn), options)
    with _lock:
        _purge_dead()
        hit = _entries.get(key)
        if hit is None or _alive(hit[0]) is not fn:
            return None
    if hit[1] != fingerprint(fn):
        return None
    with _lock:
        if key in _entries:
            _entries.move_to_end(key)
    return hit[2].copy() if copy else hit[2]


def store(fn: Callable, options: tuple, ranges: np.ndarray, take: bool = False) -> None:
    """Keep ``ranges`` (copied, read-only) for ``fn`` under ``options``; ``take=True``: keep the array
    itself, made read-only (the caller hands it over and keeps no writable reference)."""
    global _bytes
    kept = ranges if take else np.array(ranges, copy=True)
    kept.setflags(write=False)
    entry = (_ref(fn), fingerprint(fn), kept)
    key = (id(fn), options)
    with _lock:
        _purge_dead()
        old = _entries.pop(key, None)
        if old is not None:
            _bytes -= old[2].nbytes
        _entries[key] = entry
        _bytes += kept.nbytes
        while _bytes > MAX_BYTES and len(_entries) > 1:
            _bytes -= _entries.popitem(last=False)[1][2].nbytes


def clear() -> None:
    """Drop every cached result."""
    global _bytes
    with _lock:
        _entries.clear()
        _dead.clear()
        _bytes = 0


def cached_count() -> int:
    with _lock:
        _purge_dead()
        return len(_entries)
