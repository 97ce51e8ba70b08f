"""Sound bounds of a mask_mod's values over blocks of (query, key) pairs (abstract evaluation).

A *block* is a rectangle of query rows ``q_lo..q_hi`` by keys ``kv_lo..kv_hi`` (inclusive). To learn what
a mask_mod does on P blocks at once, it is called once with bounds instead of index arrays: ``q_idx`` is
an ``IntBounds`` whose ``lo[p] <= q <= hi[p]`` holds for every query row of block p, ``kv_idx`` likewise.
Every operation the mask_mod applies to them returns bounds that contain every value the same operation
takes on any (q, kv) pair of the block, given that its operands lie in their bounds (interval arithmetic;
a boolean is bounded by whether it *may* be True and whether it *may* be False). By induction over the
operations the result's bounds contain the mask_mod's value on every pair of the block, so a block whose
result cannot be False is entirely allowed and one whose result cannot be True is entirely masked.

What is bounded (anything else raises ``Refused``, and the caller evaluates the mask_mod exactly):

- operands: these bounds, Python / NumPy / torch integer and boolean scalars (0-d arrays and tensors);
- ``+ - *``, ``//`` (and ``torch.div`` with ``rounding_mode`` "floor" or "trunc"), ``%`` (Python's sign
  rule, as NumPy and ``torch.remainder`` use it; ``torch.fmod`` on non-negative operands), unary ``-``,
  ``abs``, ``min``/``max``/``clamp``/``clip``, shifts by non-negative amounts, ``& | ^`` on non-negative
  integers, comparisons, ``& | ^ ~`` and ``logical_*`` on booleans, ``where``, ``ones/zeros/full_like``,
  casts to integer or boolean dtypes;
- lookups ``table[i, j, ...]`` in a torch tensor of integers or booleans whose indices are bounds or
  integer constants, one per dimension (the value range of the table over the indexed box).

Refused, among others: floating-point values, true division, Python control flow on a traced value
(``if q_idx > 3``, ``bool()``, ``int()``), shape/dtype queries, non-scalar array operands, and lookups in
NumPy arrays (``np_table[q_idx]`` calls no protocol a bounds object could answer; use a torch tensor).

Integer results are checked against a range the concrete result's dtype certainly holds (the
intersection of its operands' dtype ranges; int64 for the indices), so a block is never classified on a
value that the concrete computation would have wrapped around; a lookup whose index may fall outside its
table marks the block as "must be evaluated exactly" (``Trace.force``), so that the concrete evaluation
raises there as the dense evaluation would.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import numpy as np

if TYPE_CHECKING:
    from dcp.masks.bounds_lookup import TableCache

#: bounds are kept within +-2**61 so that a sum or difference of two never wraps in int64
SAFE = 1 << 61
INT64 = (-SAFE, SAFE)
#: ops defined above this module (``dcp.masks.bounds_lookup`` adds "lookup" when imported)
INDEXING: dict[str, Callable] = {}
BOOL_RANGE = (0, 1)


class Refused(Exception):
    """The mask_mod did something the bounds cannot follow soundly; evaluate it exactly instead."""


class Trace:
    """One abstract call over P blocks: the first refusal (kept even if the mask_mod swallowed the
    exception) and ``force`` bool ``[P]``, the blocks to evaluate exactly whatever their bounds say."""

    def __init__(self, num_blocks: int, tables: "TableCache"):
        self.num_blocks = num_blocks
        self.tables = tables
        self.refused: str | None = None
        self.force = np.zeros(num_blocks, dtype=bool)

    def refuse(self, reason: str) -> NoReturn:
        if self.refused is None:
            self.refused = reason
        raise Refused(reason)


# ----------------------------------------------------------------------------------------------------
# the bound types
# ----------------------------------------------------------------------------------------------------

class Bounds:
    """Base of the two bound types: operators, NumPy's and torch's dispatch protocols, refusals."""

    __slots__ = ("trace",)
    __array_priority__ = 1000  # NumPy binary operators defer to ours

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        op = NUMPY_UFUNCS.get(ufunc.__name__)
        if method != "__call__" or op is None or kwargs:
            self.trace.refuse(f"numpy.{ufunc.__name__}.{method}" + (f" with {sorted(kwargs)}" if kwargs else ""))
        return op(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        op = NUMPY_FUNCTIONS.get(func.__name__)
        if op is None:
            self.trace.refuse(f"numpy.{func.__name__}")
        return op(*args, **kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        trace = _trace_of(args, kwargs)
        if name == "__getitem__":  # table lookups: ``dcp.masks.bounds_lookup`` registers its op here
            op = INDEXING.get("lookup")
            if op is None:
                trace.refuse("indexing a tensor with a traced value (import dcp.masks.bounds_lookup)")
            return op(args[0], args[1], trace)
        op = TORCH_FUNCTIONS.get(name)
        if op is None:
            trace.refuse(f"torch function {name}")
        return op(*args, **(kwargs or {}))

    def __getattr__(self, name: str):
        # only reached for attributes the class does not define: tensor-style methods (q_idx.abs())
        if name.startswith("__"):
            raise AttributeError(name)
        op = TORCH_FUNCTIONS.get(name) or NUMPY_METHODS.get(name)
        if op is None:
            self.trace.refuse(f"attribute .{name}")
        return lambda *args, **kwargs: op(self, *args, **kwargs)

    # conversions a bound cannot answer: the mask_mod would branch on, or leave, the traced values
    def __bool__(self):
        self.trace.refuse("Python control flow on a traced value (bool())")

    def __int__(self):
        self.trace.refuse("int() of a traced value")

    def __float__(self):
        self.trace.refuse("float() of a traced value")

    def __array__(self, *args, **kwargs):
        self.trace.refuse("conversion of a traced value to an array (e.g. indexing a NumPy array with it)")

    # no __len__ / __iter__ / __getitem__: torch would take a bounds object for a sequence of indices;
    # without them len(), iteration and indexing of a traced value raise TypeError, itself a refusal

    __hash__ = object.__hash__

    def __add__(self, o): return add(self, o)
    def __radd__(self, o): return add(o, self)
    def __sub__(self, o): return sub(self, o)
    def __rsub__(self, o): return sub(o, self)
    def __mul__(self, o): return mul(self, o)
    def __rmul__(self, o): return mul(o, self)
    def __floordiv__(self, o): return floordiv(self, o)
    def __rfloordiv__(self, o): return floordiv(o, self)
    def __mod__(self, o): return mod(self, o)
    def __rmod__(self, o): return mod(o, self)
    def __truediv__(self, o): self.trace.refuse("true division (floating point)")
    def __rtruediv__(self, o): self.trace.refuse("true division (floating point)")
    def __pow__(self, o): self.trace.refuse("power")
    def __lshift__(self, o): return lshift(self, o)
    def __rlshift__(self, o): return lshift(o, self)
    def __rshift__(self, o): return rshift(self, o)
    def __rrshift__(self, o): return rshift(o, self)
    def __and__(self, o): return bit_and(self, o)
    def __rand__(self, o): return bit_and(o, self)
    def __or__(self, o): return bit_or(self, o)
    def __ror__(self, o): return bit_or(o, self)
    def __xor__(self, o): return bit_xor(self, o)
    def __rxor__(self, o): return bit_xor(o, self)
    def __invert__(self): return invert(self)
    def __neg__(self): return neg(self)
    def __pos__(self): return self
    def __abs__(self): return absolute(self)
    def __eq__(self, o): return eq(self, o)
    def __ne__(self, o): return ne(self, o)
    def __lt__(self, o): return lt(self, o)
    def __le__(self, o): return le(self, o)
    def __gt__(self, o): return lt(o, self)
    def __ge__(self, o): return le(o, self)


class IntBounds(Bounds):
    """Integer values with ``lo <= v <= hi`` (int64 arrays ``[P]`` or 0-d); ``rng`` is the value range
    of the concrete dtype (``None`` for a Python int, which takes its partner's dtype)."""

    __slots__ = ("lo", "hi", "rng")

    def __init__(self, lo, hi, trace: Trace, rng: tuple[int, int] | None):
        self.lo, self.hi, self.trace, self.rng = lo, hi, trace, rng

    def __index__(self) -> int:
        # exact for a constant (e.g. FlexAttention's b or h indexing a NumPy table); refused otherwise
        if np.ndim(self.lo) == 0 and self.lo == self.hi:
            return int(self.lo)
        self.trace.refuse("a traced value used as an index of a NumPy array or Python sequence (lookup tables "
                          "must be torch tensors)")


class BoolBounds(Bounds):
    """Booleans: ``can_true`` / ``can_false`` bool arrays ``[P]`` (or 0-d); at least one holds."""

    __slots__ = ("can_true", "can_false")

    def __init__(self, can_true, can_false, trace: Trace):
        self.can_true, self.can_false, self.trace = can_true, can_false, trace


def _trace_of(args, kwargs) -> Trace:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, Bounds):
            return a.trace
        if isinstance(a, (tuple, list)):
            for b in a:
                if isinstance(b, Bounds):
                    return b.trace
    raise TypeError("no bounds among the arguments")


def dtype_range(dtype: Any) -> tuple[int, int] | None:
    """Value range of an integer or boolean NumPy/torch dtype (or Python ``int``/``bool``); None otherwise."""
    if dtype is bool:
        return BOOL_RANGE
    name = str(dtype)
    try:
        dt = np.dtype(np.int64 if dtype is int else name[6:] if name.startswith("torch.") else dtype)
    except TypeError:
        return None
    if dt.kind == "b":
        return BOOL_RANGE
    if dt.kind not in "iu":
        return None
    info = np.iinfo(dt)
    return max(int(info.min), -SAFE), min(int(info.max), SAFE)


def lift(x: Any, trace: Trace) -> Bounds:
    """``x`` as bounds: itself, or a constant from a Python/NumPy/torch integer or boolean scalar."""
    if isinstance(x, Bounds):
        return x
    if isinstance(x, (bool, np.bool_)):
        return BoolBounds(np.bool_(x), np.bool_(not x), trace)
    if isinstance(x, float):
        trace.refuse("floating-point operand")
    if isinstance(x, int):
        if not -SAFE <= x <= SAFE:
            trace.refuse(f"integer constant {x} beyond +-2**61")
        return IntBounds(np.int64(x), np.int64(x), trace, None)
    torch = sys.modules.get("torch")
    if isinstance(x, (np.generic, np.ndarray)) or (torch is not None and isinstance(x, torch.Tensor)):
        rng = dtype_range(x.dtype)
        if np.ndim(x) != 0 or rng is None:
            trace.refuse(f"operand {type(x).__name__} of shape {tuple(np.shape(x))} and dtype {x.dtype}"
                         " (only integer or boolean scalars mix with traced values)")
        value = x.item()
        if rng == BOOL_RANGE:
            return BoolBounds(np.bool_(value), np.bool_(not value), trace)
        if not -SAFE <= value <= SAFE:
            trace.refuse(f"integer constant {value} beyond +-2**61")
        return IntBounds(np.int64(value), np.int64(value), trace, None)  # a scalar: weak (see _ints)
    trace.refuse(f"operand of type {type(x).__name__}")


def _pair(a, b) -> tuple[Bounds, Bounds]:
    trace = a.trace if isinstance(a, Bounds) else b.trace
    return lift(a, trace), lift(b, trace)


def as_int(x: Bounds) -> IntBounds:
    """A boolean as the integers 0/1 (as NumPy and torch promote it in arithmetic)."""
    if isinstance(x, IntBounds):
        return x
    return IntBounds(np.where(x.can_false, 0, 1).astype(np.int64), np.where(x.can_true, 1, 0).astype(np.int64),
                     x.trace, None)


def truth(x: Bounds) -> BoolBounds:
    """Truthiness: an integer is True unless it is 0."""
    if isinstance(x, BoolBounds):
        return x
    return BoolBounds((x.lo != 0) | (x.hi != 0), (x.lo <= 0) & (x.hi >= 0), x.trace)


def _ints(a, b, arithmetic: bool = True) -> tuple[IntBounds, IntBounds, tuple[int, int]]:
    """Both operands of an integer operation as ``IntBounds``, and the range its result must stay in.

    That range is the *intersection* of the operands' dtype ranges: the concrete result's dtype is one
    of the operands' dtypes or wider (torch keeps ``int32_tensor + int64_scalar_tensor`` int32), so a
    result inside every operand's range is inside the result dtype's range. Scalars and booleans are
    "weak" (range None: they take their partner's dtype)."""
    a, b = _pair(a, b)
    if arithmetic and isinstance(a, BoolBounds) and isinstance(b, BoolBounds):
        # NumPy and torch keep bool (+) bool boolean (True + True is True): not integer arithmetic
        a.trace.refuse("arithmetic on two booleans")
    a, b = as_int(a), as_int(b)
    given = [r for r in (a.rng, b.rng) if r is not None]
    rng = (max(r[0] for r in given), min(r[1] for r in given)) if given else INT64
    return a, b, rng


def int_result(lo, hi, trace: Trace, rng: tuple[int, int], what: str) -> IntBounds:
    # the concrete dtype holds all of ``rng`` (see _ints), so a result inside it did not wrap around;
    # outside it, it might have: refuse rather than bound a wrapped value
    if np.min(lo) < rng[0] or np.max(hi) > rng[1]:
        trace.refuse(f"{what} may overflow its integer dtype")
    return IntBounds(np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64), trace, rng)


def is_const(x: IntBounds) -> bool:
    return np.ndim(x.lo) == 0 and x.lo == x.hi


# ----------------------------------------------------------------------------------------------------
# integer arithmetic
# ----------------------------------------------------------------------------------------------------

def add(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    return int_result(a.lo + b.lo, a.hi + b.hi, a.trace, rng, "+")


def sub(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    return int_result(a.lo - b.hi, a.hi - b.lo, a.trace, rng, "-")


def neg(a) -> IntBounds:
    return sub(0, a)


def _corners(a: IntBounds, b: IntBounds, f: Callable) -> tuple[np.ndarray, np.ndarray]:
    # f is monotone in each argument where these callers use it, so its extremes lie at the corners
    c = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return np.minimum(np.minimum(c[0], c[1]), np.minimum(c[2], c[3])), np.maximum(np.maximum(c[0], c[1]),
                                                                                  np.maximum(c[2], c[3]))


def mul(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    big = max(np.max(np.abs(a.lo)), np.max(np.abs(a.hi))) * float(max(np.max(np.abs(b.lo)), np.max(np.abs(b.hi))))
    if big > SAFE:
        a.trace.refuse("* may overflow int64")
    lo, hi = _corners(a, b, np.multiply)
    return int_result(lo, hi, a.trace, rng, "*")


def _nonzero_divisor(b: IntBounds, what: str) -> None:
    if np.any((b.lo <= 0) & (b.hi >= 0)):
        b.trace.refuse(f"{what} by a divisor that may be 0")


def floordiv(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    _nonzero_divisor(b, "//")
    lo, hi = _corners(a, b, np.floor_divide)  # x / y is monotone in each argument while y keeps its sign
    return int_result(lo, hi, a.trace, rng, "//")


def truncdiv(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    _nonzero_divisor(b, "trunc division")

    def trunc(x, y):
        return np.sign(x) * np.sign(y) * (np.abs(x) // np.abs(y))

    lo, hi = _corners(a, b, trunc)
    return int_result(lo, hi, a.trace, rng, "trunc division")


def mod(a, b) -> IntBounds:
    """``a % b`` with Python's rule (the result takes the divisor's sign), as NumPy and torch.remainder."""
    a, b, rng = _ints(a, b)
    _nonzero_divisor(b, "%")
    if not is_const(b):  # a varying divisor: only the sign rule, 0 <= r < b (or b < r <= 0)
        if np.all(b.lo > 0):
            lo, hi = np.zeros_like(b.hi), b.hi - 1
            hi = np.where(a.lo >= 0, np.minimum(hi, a.hi), hi)  # r <= a for a >= 0
        elif np.all(b.hi < 0):
            lo, hi = b.lo + 1, np.zeros_like(b.lo)
        else:
            a.trace.refuse("% by divisors of both signs")
        return int_result(lo, hi, a.trace, rng, "%")
    m = int(b.lo)
    if m < 0:  # x % m == -((-x) % -m)
        pos = mod(neg(a), -m)
        return int_result(-pos.hi, -pos.lo, a.trace, rng, "%")
    r_lo, r_hi = a.lo % m, a.hi % m
    # the interval maps monotonically unless it wraps past a multiple of m
    whole = (a.hi - a.lo >= m) | (r_lo > r_hi)
    return int_result(np.where(whole, 0, r_lo), np.where(whole, m - 1, r_hi), a.trace, rng, "%")


def fmod(a, b) -> IntBounds:
    """C's remainder (torch.fmod): equal to ``%`` on a non-negative dividend and a positive divisor."""
    a, b = _pair(a, b)
    if not (np.all(as_int(a).lo >= 0) and np.all(as_int(b).lo > 0)):
        a.trace.refuse("fmod with possibly negative operands")
    return mod(a, b)


def absolute(a) -> Bounds:
    a = as_int(a)
    lo = np.where(a.lo >= 0, a.lo, np.where(a.hi <= 0, -a.hi, 0))
    hi = np.maximum(np.abs(a.lo), np.abs(a.hi))
    return int_result(lo, hi, a.trace, a.rng or INT64, "abs")


def _extreme(a, b, pick: Callable, on_bools: Callable, what: str) -> Bounds:
    # minimum / maximum are monotone in both arguments: bound by the picked ends; on booleans they are
    # the logical and / or
    a, b = _pair(a, b)
    if isinstance(a, BoolBounds) and isinstance(b, BoolBounds):
        return on_bools(a, b)
    a, b, rng = _ints(a, b)
    return int_result(pick(a.lo, b.lo), pick(a.hi, b.hi), a.trace, rng, what)


def minimum(a, b) -> Bounds:
    return _extreme(a, b, np.minimum, logical_and, "minimum")


def maximum(a, b) -> Bounds:
    return _extreme(a, b, np.maximum, logical_or, "maximum")


def clamp(a, min=None, max=None) -> Bounds:  # noqa: A002 - torch's keyword names
    """``minimum(maximum(a, min), max)``: torch.clamp's and numpy.clip's definition (also when min > max)."""
    out = a if min is None else maximum(a, min)
    return out if max is None else minimum(out, max)


def _shift_amount(b, what: str) -> IntBounds:
    if not np.all(b.lo >= 0) or np.any(b.hi > 62):
        b.trace.refuse(f"{what} by an amount outside 0..62")
    return b


def lshift(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    _shift_amount(b, "<<")
    return mul(a, IntBounds(np.left_shift(1, b.lo), np.left_shift(1, b.hi), a.trace, rng))


def rshift(a, b) -> IntBounds:
    a, b, rng = _ints(a, b)
    _shift_amount(b, ">>")
    return floordiv(a, IntBounds(np.left_shift(1, b.lo), np.left_shift(1, b.hi), a.trace, rng))


def _bitwise_ints(a: IntBounds, b: IntBounds, rng, op, lo, hi, what: str) -> IntBounds:
    if is_const(a) and is_const(b):
        v = op(a.lo, b.lo)
        return int_result(v, v, a.trace, rng, what)
    if not (np.all(a.lo >= 0) and np.all(b.lo >= 0)):
        a.trace.refuse(f"{what} on possibly negative integers")
    return int_result(lo, hi, a.trace, rng, what)


def bit_and(a, b) -> Bounds:
    a, b = _pair(a, b)
    if isinstance(a, BoolBounds) and isinstance(b, BoolBounds):
        return logical_and(a, b)
    a, b, rng = _ints(a, b)
    # for non-negative x, y: 0 <= x & y <= min(x, y)
    return _bitwise_ints(a, b, rng, np.bitwise_and, np.zeros_like(a.lo + b.lo), np.minimum(a.hi, b.hi), "&")


def bit_or(a, b) -> Bounds:
    a, b = _pair(a, b)
    if isinstance(a, BoolBounds) and isinstance(b, BoolBounds):
        return logical_or(a, b)
    a, b, rng = _ints(a, b)
    # for non-negative x, y: max(x, y) <= x | y <= x + y
    return _bitwise_ints(a, b, rng, np.bitwise_or, np.maximum(a.lo, b.lo), a.hi + b.hi, "|")


def bit_xor(a, b) -> Bounds:
    a, b = _pair(a, b)
    if isinstance(a, BoolBounds) and isinstance(b, BoolBounds):
        return logical_xor(a, b)
    a, b, rng = _ints(a, b)
    # for non-negative x, y: 0 <= x ^ y <= x | y <= x + y
    return _bitwise_ints(a, b, rng, np.bitwise_xor, np.zeros_like(a.lo + b.lo), a.hi + b.hi, "^")


def invert(a) -> Bounds:
    if isinstance(a, BoolBounds):
        return logical_not(a)
    if a.rng is not None and a.rng[0] >= 0:
        a.trace.refuse("~ on an unsigned integer")
    return sub(-1, a)  # two's complement: ~x == -x - 1


# ----------------------------------------------------------------------------------------------------
# comparisons and booleans
# ----------------------------------------------------------------------------------------------------

def lt(a, b) -> BoolBounds:
    a, b, _ = _ints(a, b, arithmetic=False)
    return BoolBounds(a.lo < b.hi, a.hi >= b.lo, a.trace)


def le(a, b) -> BoolBounds:
    a, b, _ = _ints(a, b, arithmetic=False)
    return BoolBounds(a.lo <= b.hi, a.hi > b.lo, a.trace)


def eq(a, b) -> BoolBounds:
    a, b = _pair(a, b)
    if isinstance(a, BoolBounds) and isinstance(b, BoolBounds):
        return logical_not(logical_xor(a, b))
    a, b, _ = _ints(a, b)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    single = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    return BoolBounds(overlap, ~single, a.trace)


def ne(a, b) -> BoolBounds:
    return logical_not(eq(a, b))


def logical_not(a) -> BoolBounds:
    a = truth(a)
    return BoolBounds(a.can_false, a.can_true, a.trace)


def logical_and(a, b) -> BoolBounds:
    a, b = (truth(x) for x in _pair(a, b))
    return BoolBounds(a.can_true & b.can_true, a.can_false | b.can_false, a.trace)


def logical_or(a, b) -> BoolBounds:
    a, b = (truth(x) for x in _pair(a, b))
    return BoolBounds(a.can_true | b.can_true, a.can_false & b.can_false, a.trace)


def logical_xor(a, b) -> BoolBounds:
    a, b = (truth(x) for x in _pair(a, b))
    return BoolBounds((a.can_true & b.can_false) | (a.can_false & b.can_true),
                      (a.can_true & b.can_true) | (a.can_false & b.can_false), a.trace)


def where(cond, x, y) -> Bounds:
    trace = _trace_of((cond, x, y), None)
    c, x, y = truth(lift(cond, trace)), lift(x, trace), lift(y, trace)
    both = c.can_true & c.can_false
    if isinstance(x, BoolBounds) and isinstance(y, BoolBounds):
        return BoolBounds((c.can_true & x.can_true) | (c.can_false & y.can_true),
                          (c.can_true & x.can_false) | (c.can_false & y.can_false), trace)
    x, y, rng = _ints(x, y)
    lo = np.where(both, np.minimum(x.lo, y.lo), np.where(c.can_true, x.lo, y.lo))
    hi = np.where(both, np.maximum(x.hi, y.hi), np.where(c.can_true, x.hi, y.hi))
    return int_result(lo, hi, trace, rng, "where")


# ----------------------------------------------------------------------------------------------------
# casts and constructors
# ----------------------------------------------------------------------------------------------------

_DEVICES = ("cpu", "cuda", "mps", "meta", "xpu")


def _dtype_arg(args: tuple, kwargs: dict) -> Any:
    """The dtype among ``.to(...)`` / ``.astype(...)`` arguments; None for a device move."""
    for x in (kwargs.get("dtype"), *args):
        if x is None or isinstance(x, bool):  # non_blocking / copy flags given positionally
            continue
        if type(x).__name__ == "device" or (isinstance(x, str) and x.split(":")[0] in _DEVICES):
            continue
        return x
    return None


def cast(a, *args, **kwargs) -> Bounds:
    """``.to(dtype)`` / ``.astype(dtype)``: to bool is truthiness, to an integer dtype must not wrap."""
    dtype = _dtype_arg(args, kwargs)
    if dtype is None:
        return a  # a device move: values unchanged
    rng = dtype_range(dtype)
    if rng is None:
        a.trace.refuse(f"cast to {dtype}")
    if rng == BOOL_RANGE:
        return truth(a)
    a = as_int(a)
    return int_result(a.lo, a.hi, a.trace, rng, f"cast to {dtype}")


def _like(value) -> Callable:
    def make(a, *args, dtype=None, **kwargs):
        if dtype is not None and dtype_range(dtype) is None:
            a.trace.refuse(f"{value}-like of dtype {dtype}")
        fill = value if value is not None else (args[0] if args else kwargs["fill_value"])
        if isinstance(a, BoolBounds) and dtype is None:
            fill = bool(fill)
        out = lift(fill, a.trace)
        return cast(out, dtype) if dtype is not None else out
    return make


def _to_bool(a, *args, **kwargs) -> BoolBounds:
    return truth(a)


def _to_int64(a, *args, **kwargs) -> Bounds:
    return cast(a, np.int64)


def _to_int32(a, *args, **kwargs) -> Bounds:
    return cast(a, np.int32)


def _identity(a, *args, **kwargs) -> Bounds:
    return a


# ----------------------------------------------------------------------------------------------------
# protocol name maps (one place for NumPy ufuncs/functions, torch functions and tensor methods)
# ----------------------------------------------------------------------------------------------------

def _swap(f: Callable) -> Callable:
    return lambda a, b, *args, **kwargs: f(b, a)


def _div(a, b, *, rounding_mode=None):
    if rounding_mode == "floor":
        return floordiv(a, b)
    if rounding_mode == "trunc":
        return truncdiv(a, b)
    _trace_of((a, b), None).refuse("true division (floating point)")


_BINARY = {"add": add, "sub": sub, "subtract": sub, "mul": mul, "multiply": mul, "floor_divide": floordiv,
           "remainder": mod, "fmod": fmod, "minimum": minimum, "maximum": maximum, "fmin": minimum,
           "fmax": maximum, "bitwise_and": bit_and, "bitwise_or": bit_or, "bitwise_xor": bit_xor,
           "logical_and": logical_and, "logical_or": logical_or, "logical_xor": logical_xor,
           "bitwise_left_shift": lshift, "left_shift": lshift, "bitwise_right_shift": rshift,
           "right_shift": rshift, "eq": eq, "equal": eq, "ne": ne, "not_equal": ne, "lt": lt, "less": lt,
           "le": le, "less_equal": le, "gt": _swap(lt), "greater": _swap(lt), "ge": _swap(le),
           "greater_equal": _swap(le)}
_UNARY = {"neg": neg, "negative": neg, "abs": absolute, "absolute": absolute, "logical_not": logical_not,
          "bitwise_not": invert, "invert": invert, "positive": _identity}

NUMPY_UFUNCS: dict[str, Callable] = {**_BINARY, **_UNARY, "clip": clamp}
NUMPY_FUNCTIONS: dict[str, Callable] = {"where": where, "clip": clamp, "ones_like": _like(1), "zeros_like": _like(0),
                                        "full_like": _like(None), "abs": absolute, "absolute": absolute,
                                        "minimum": minimum, "maximum": maximum}
NUMPY_METHODS: dict[str, Callable] = {"astype": cast, "clip": clamp, "copy": _identity}
TORCH_FUNCTIONS: dict[str, Callable] = {
    **_BINARY, **_UNARY, "where": where, "clamp": clamp, "clip": clamp,
    "clamp_min": lambda a, m: clamp(a, min=m), "clamp_max": lambda a, m: clamp(a, max=m),
    "div": _div, "divide": _div, "rsub": _swap(sub), "ones_like": _like(1), "zeros_like": _like(0),
    "full_like": _like(None), "to": cast, "type": cast, "bool": _to_bool, "long": _to_int64, "int": _to_int32,
    "clone": _identity, "contiguous": _identity, "detach": _identity, "cpu": _identity, "cuda": _identity,
    **{f"__{n}__": f for n, f in (("add", add), ("sub", sub), ("mul", mul), ("floordiv", floordiv),
                                 ("mod", mod), ("and", bit_and), ("or", bit_or), ("xor", bit_xor),
                                 ("lshift", lshift), ("rshift", rshift), ("eq", eq), ("ne", ne), ("lt", lt),
                                 ("le", le), ("gt", _swap(lt)), ("ge", _swap(le)))},
    **{f"__r{n}__": _swap(f) for n, f in (("add", add), ("sub", sub), ("mul", mul), ("floordiv", floordiv),
                                         ("mod", mod), ("and", bit_and), ("or", bit_or), ("xor", bit_xor),
                                         ("lshift", lshift), ("rshift", rshift))},
    "__invert__": invert, "__neg__": neg, "__abs__": absolute,
}
