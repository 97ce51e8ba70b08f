"""Tests of blockwise mask_mod evaluation (dcp.masks.bounds, dcp.masks.mask_mod_blocks, the cache).

The oracles: the dense reference path (``method="dense"``, every pair through ``dense_to_ranges``) and a
brute force (the predicate on the full ``[L, L]`` index grid). Random predicates are drawn as expression
trees over q, kv, constants and lookup tables; the bounds must be *sound* on random blocks (a block
classified full/empty is so on every pair) and every evaluation method must give the same ranges.
Adversarial predicates are uniform on block corners and edges but not inside.
"""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcp
from dcp.errors import InvalidMaskError
from dcp.masks import MaskModMask, RangesMask, dense_to_ranges, from_mask_mod, mask_mod_cache, ranges_to_dense
from dcp.masks import mask_mod as mm
from dcp.masks import bounds as B
from dcp.masks.bounds import INT64, BoolBounds, IntBounds, Refused, Trace
from dcp.masks.bounds_lookup import TableCache, lookup
from dcp.masks.mask_mod_blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    BlockEvaluator,
    RangesBuffer,
    classify,
    runs_numpy,
    runs_torch,
    segments_to_ranges,
)
from dcp.masks.mask_mod_zoo import ZOO
from _budget import n_examples

# NumPy-first evaluation of torch-table predicates mixes arrays and tensors (torch then warns)
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept:DeprecationWarning")
EXAMPLES = settings(max_examples=n_examples(60, 600))
TABLE_N = 23
TABLE = torch.tensor(np.random.default_rng(0).integers(-9, 10, TABLE_N), dtype=torch.int32)
BOOL_TABLE = torch.tensor(np.random.default_rng(1).random((TABLE_N, TABLE_N)) < 0.4)


def brute_force(fn, L: int, nargs: int = 2) -> np.ndarray:
    """``fn`` on the full ``[L, L]`` torch index grid: bool ``[L, L]``."""
    q, kv = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
    out = fn(torch.tensor(0), torch.tensor(0), q, kv) if nargs == 4 else fn(q, kv)
    return np.broadcast_to(np.asarray(torch.as_tensor(out) != 0), (L, L))


def evaluate(fn, L: int, **kw) -> np.ndarray:
    return mm.evaluate_mask_mod(fn, L, **kw)[0]


def same_ranges(a: np.ndarray, b: np.ndarray) -> bool:
    return RangesMask(a) == RangesMask(b)


# ----------------------------------------------------------------------------------------------------
# random predicates: expression trees compiled to torch code (lookups in torch tables)
# ----------------------------------------------------------------------------------------------------

def _const(v: int):
    t = torch.tensor(v)
    return lambda q, kv: t


def _int_leaf():
    return st.one_of(st.just(("q",)), st.just(("kv",)), st.integers(-20, 20).map(lambda v: ("c", v)))


def _int_node(children):
    c = st.integers(-7, 7).filter(lambda v: v != 0)
    return st.one_of(
        st.tuples(st.sampled_from(["add", "sub", "mul", "min", "max"]), children, children),
        st.tuples(st.sampled_from(["add_py", "sub_py", "mul_py", "floordiv", "mod", "trunc"]), children, c),
        st.tuples(st.sampled_from(["abs", "neg", "tbl"]), children),
        st.tuples(st.just("clamp"), children, st.integers(-10, 5), st.integers(0, 15)),
        st.tuples(st.sampled_from(["shl", "shr"]), children, st.integers(0, 3)),
        st.tuples(st.just("where"), st.tuples(st.sampled_from(["lt", "le", "eq", "ne"]), children, children),
                  children, children),
    )


def _bool_of(ints):
    base = st.one_of(st.tuples(st.sampled_from(["lt", "le", "eq", "ne"]), ints, ints),
                     st.tuples(st.just("btbl"), ints, ints))
    return st.recursive(base, lambda b: st.one_of(st.tuples(st.sampled_from(["and", "or", "xor"]), b, b),
                                                   st.tuples(st.just("not"), b)), max_leaves=4)


INT_EXPRS = st.recursive(_int_leaf(), _int_node, max_leaves=6)
BOOL_EXPRS = _bool_of(INT_EXPRS)


def compile_expr(e):
    """A torch mask_mod piece ``f(q, kv)`` for the expression tree ``e``."""
    op, *args = e
    if op == "q":
        return lambda q, kv: q
    if op == "kv":
        return lambda q, kv: kv
    if op == "c":
        return _const(args[0])
    f = compile_expr(args[0]) if isinstance(args[0], tuple) else None
    g = compile_expr(args[1]) if len(args) > 1 and isinstance(args[1], tuple) else None
    k = args[1] if len(args) > 1 and not isinstance(args[1], tuple) else None
    table = {
        "add": lambda q, kv: f(q, kv) + g(q, kv), "sub": lambda q, kv: f(q, kv) - g(q, kv),
        "mul": lambda q, kv: f(q, kv) * g(q, kv), "min": lambda q, kv: torch.minimum(f(q, kv), g(q, kv)),
        "max": lambda q, kv: torch.maximum(f(q, kv), g(q, kv)), "add_py": lambda q, kv: f(q, kv) + k,
        "sub_py": lambda q, kv: k - f(q, kv), "mul_py": lambda q, kv: f(q, kv) * k,
        "floordiv": lambda q, kv: f(q, kv) // k, "mod": lambda q, kv: f(q, kv) % k,
        "trunc": lambda q, kv: torch.div(f(q, kv), k, rounding_mode="trunc"),
        "abs": lambda q, kv: abs(f(q, kv)), "neg": lambda q, kv: -f(q, kv),
        "tbl": lambda q, kv: TABLE[f(q, kv) % TABLE_N],
        "clamp": lambda q, kv: f(q, kv).clamp(args[1], args[1] + args[2]),
        "shl": lambda q, kv: f(q, kv) << k, "shr": lambda q, kv: f(q, kv) >> k,
        "lt": lambda q, kv: f(q, kv) < g(q, kv), "le": lambda q, kv: f(q, kv) <= g(q, kv),
        "eq": lambda q, kv: f(q, kv) == g(q, kv), "ne": lambda q, kv: f(q, kv) != g(q, kv),
        "btbl": lambda q, kv: BOOL_TABLE[f(q, kv) % TABLE_N, g(q, kv) % TABLE_N],
        "and": lambda q, kv: f(q, kv) & g(q, kv), "or": lambda q, kv: f(q, kv) | g(q, kv),
        "xor": lambda q, kv: f(q, kv) ^ g(q, kv), "not": lambda q, kv: ~f(q, kv),
    }
    if op == "where":
        c, x, y = (compile_expr(a) for a in args)
        return lambda q, kv: torch.where(c(q, kv), x(q, kv), y(q, kv))
    return table[op]


def _mask_mod(expr):
    piece = compile_expr(expr)
    # a constant expression still has to broadcast against the indices
    return lambda q, kv: piece(q, kv) | (q < -1)


@st.composite
def blocks(draw, limit: int = 40):
    """P random blocks: inclusive ``q_lo..q_hi`` x ``kv_lo..kv_hi`` (int64 [P] each), extents 1..6."""
    p = draw(st.integers(1, 8))
    lo = draw(st.lists(st.tuples(st.integers(0, limit), st.integers(0, limit), st.integers(0, 5),
                                 st.integers(0, 5)), min_size=p, max_size=p))
    a = np.array(lo, dtype=np.int64)
    return a[:, 0], a[:, 0] + a[:, 2], a[:, 1], a[:, 1] + a[:, 3]


@EXAMPLES
@given(BOOL_EXPRS, blocks())
def test_bounds_are_sound_on_random_blocks(expr, box):
    """A block the bounds call full (empty) is allowed (masked) on every pair: checked pair by pair."""
    fn = _mask_mod(expr)
    q_lo, q_hi, kv_lo, kv_hi = box
    try:
        status = classify(fn, 2, q_lo, q_hi, kv_lo, kv_hi, TableCache())
    except Refused:
        return
    for p in range(q_lo.size):
        q, kv = torch.meshgrid(torch.arange(q_lo[p], q_hi[p] + 1), torch.arange(kv_lo[p], kv_hi[p] + 1), indexing="ij")
        try:
            values = torch.as_tensor(fn(q, kv)).expand(q.shape)
        except Exception:  # the concrete evaluation fails here: the block must be evaluated exactly
            assert status[p] == PARTIAL, (expr, p)
            continue
        if status[p] == FULL:
            assert bool(values.all()), (expr, p)
        elif status[p] == EMPTY:
            assert not bool(values.any()), (expr, p)


@EXAMPLES
@given(BOOL_EXPRS, st.integers(1, 90), st.sampled_from([1, 2, 4, 16]))
def test_blocks_equal_dense_and_brute_force(expr, L, leaf):
    fn = _mask_mod(expr)
    try:
        dense = evaluate(fn, L, method="dense", backend="torch")
    except InvalidMaskError:  # e.g. a division by zero somewhere: every method must refuse it too
        with pytest.raises(InvalidMaskError):
            evaluate(fn, L, leaf=leaf, backend="torch")
        return
    assert same_ranges(evaluate(fn, L, leaf=leaf, backend="torch"), dense)
    assert same_ranges(evaluate(fn, L, leaf=leaf), dense)  # "auto" picks torch for this torch code
    np.testing.assert_array_equal(ranges_to_dense(dense, L), brute_force(fn, L))


@settings(max_examples=n_examples(25, 250))
@given(BOOL_EXPRS, st.integers(50, 200), st.sampled_from([(1, 16), (2, 32), (4, 64)]))
def test_deep_block_hierarchies_equal_dense(expr, L, leaf_coarse):
    """Coarse blocks many levels above the leaves (more splits than the default sizes give at small L)."""
    fn = _mask_mod(expr)
    leaf, coarse = leaf_coarse
    try:
        dense = evaluate(fn, L, method="dense", backend="torch")
    except InvalidMaskError:
        return
    concrete = mm.ConcreteMaskMod(fn, 2, "torch")
    blocks_ = BlockEvaluator(fn, 2, L, concrete, leaf=leaf, coarse=coarse)
    try:
        got = blocks_.ranges()
    except Refused:
        return
    assert same_ranges(got, dense)


# ----------------------------------------------------------------------------------------------------
# each operation's bounds, checked exhaustively on small random intervals
# ----------------------------------------------------------------------------------------------------

def _trunc(x, y):
    return torch.div(torch.tensor(x), torch.tensor(y), rounding_mode="trunc").numpy()


OPS = {  # name: (bounds operation, the same on NumPy/torch int64 values)
    "add": (B.add, np.add), "sub": (B.sub, np.subtract), "mul": (B.mul, np.multiply),
    "floordiv": (B.floordiv, np.floor_divide), "mod": (B.mod, np.remainder), "truncdiv": (B.truncdiv, _trunc),
    "fmod": (B.fmod, np.fmod), "minimum": (B.minimum, np.minimum), "maximum": (B.maximum, np.maximum),
    "lshift": (B.lshift, np.left_shift), "rshift": (B.rshift, np.right_shift), "bit_and": (B.bit_and, np.bitwise_and),
    "bit_or": (B.bit_or, np.bitwise_or), "bit_xor": (B.bit_xor, np.bitwise_xor), "lt": (B.lt, np.less),
    "le": (B.le, np.less_equal), "eq": (B.eq, np.equal), "ne": (B.ne, np.not_equal),
    "abs": (lambda a, b: B.absolute(a), lambda x, y: np.abs(x)), "neg": (lambda a, b: B.neg(a), lambda x, y: -x),
    "invert": (lambda a, b: B.invert(a), lambda x, y: ~x),
    "clamp": (lambda a, b: B.clamp(a, b, 3), lambda x, y: np.minimum(np.maximum(x, y), 3)),
}
INTERVAL = st.tuples(st.integers(-12, 12), st.integers(0, 8))


def _interval(trace, lo_w):
    lo, w = lo_w
    return IntBounds(np.array([lo]), np.array([lo + w]), trace, INT64)


def _contains(out, values) -> bool:
    if isinstance(out, BoolBounds):
        return bool((out.can_true[()] if np.ndim(out.can_true) == 0 else out.can_true[0]) or not values.any()) and \
            bool((out.can_false[()] if np.ndim(out.can_false) == 0 else out.can_false[0]) or values.all())
    lo, hi = np.min(out.lo), np.max(out.hi)
    return bool(lo <= values.min() and values.max() <= hi)


@pytest.mark.parametrize("name", sorted(OPS))
@settings(max_examples=n_examples(40, 400))
@given(a=INTERVAL, b=INTERVAL)
def test_each_operation_bounds_every_value(name, a, b):
    bounds_op, value_op = OPS[name]
    trace = Trace(1, TableCache())
    try:
        out = bounds_op(_interval(trace, a), _interval(trace, b))
    except Refused:
        return
    xs = np.arange(a[0], a[0] + a[1] + 1, dtype=np.int64)[:, None]
    ys = np.arange(b[0], b[0] + b[1] + 1, dtype=np.int64)[None, :]
    with np.errstate(all="ignore"):
        values = np.asarray(value_op(xs, ys))
    assert _contains(out, np.broadcast_to(values, (xs.size, ys.size))), (name, a, b)


@EXAMPLES
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=12), st.integers(-15, 15), st.integers(0, 5),
       st.booleans())
def test_lookup_bounds_every_value_and_forces_out_of_range_blocks(values, lo, width, as_bool):
    table = torch.tensor(values) > 0 if as_bool else torch.tensor(values, dtype=torch.int16)
    trace = Trace(1, TableCache())
    out = lookup(table, IntBounds(np.array([lo]), np.array([lo + width]), trace, INT64), trace)
    n = len(values)
    idx = np.arange(lo, lo + width + 1)
    inside = idx[(idx >= -n) & (idx < n)]
    if inside.size < idx.size:  # the concrete lookup raises somewhere in the block
        assert trace.force[0]
    if inside.size:
        assert _contains(out, table.numpy()[inside])


@EXAMPLES
@given(st.integers(1, 7), st.integers(1, 7), st.tuples(st.integers(0, 6), st.integers(0, 3)),
       st.tuples(st.integers(0, 6), st.integers(0, 3)), st.integers(0, 2**31))
def test_two_dimensional_lookup_bounds_every_value(n, m, a, b, seed):
    table = torch.tensor(np.random.default_rng(seed).integers(-9, 10, (n, m)))
    trace = Trace(1, TableCache())
    out = lookup(table, (_interval(trace, a), _interval(trace, b)), trace)
    rows = [i for i in range(a[0], a[0] + a[1] + 1) if i < n]
    cols = [j for j in range(b[0], b[0] + b[1] + 1) if j < m]
    assert trace.force[0] == (len(rows) <= a[1] or len(cols) <= b[1])
    if rows and cols:
        assert _contains(out, table.numpy()[np.ix_(rows, cols)])


def _random_int_expr(rng: np.random.Generator, depth: int):
    if depth == 0 or rng.random() < 0.3:
        return [("q",), ("kv",), ("c", int(rng.integers(-20, 21)))][rng.integers(3)]
    op = ["add", "sub", "mul", "min", "max", "floordiv", "mod", "abs", "tbl", "clamp", "shr"][rng.integers(11)]
    a = _random_int_expr(rng, depth - 1)
    if op in ("add", "sub", "mul", "min", "max"):
        return (op, a, _random_int_expr(rng, depth - 1))
    if op in ("floordiv", "mod"):
        return (op, a, int(rng.choice([-5, -2, 3, 7])))
    return {"abs": ("abs", a), "tbl": ("tbl", a), "clamp": ("clamp", a, -3, 9), "shr": ("shr", a, 1)}[op]


def test_random_predicates_mostly_take_the_block_path():
    """The property tests above are not vacuous: most random predicates are bounded, not refused, and
    the bounds decide many blocks (not everything is partial)."""
    rng = np.random.default_rng(0)
    refused = decided = 0
    for _ in range(100):
        expr = (["lt", "le", "eq", "ne"][rng.integers(4)], _random_int_expr(rng, 3), _random_int_expr(rng, 3))
        try:
            status = classify(_mask_mod(expr), 2, np.arange(0, 64, 8), np.arange(7, 71, 8), np.arange(56, -8, -8),
                              np.arange(63, -1, -8), TableCache())
        except Refused:
            refused += 1
            continue
        decided += int((status != PARTIAL).sum())
    assert refused < 20 and decided > 200


# ----------------------------------------------------------------------------------------------------
# adversarial predicates: uniform on every block's corners and edges, not inside
# ----------------------------------------------------------------------------------------------------

SPIKE_DOC = torch.tensor(np.r_[np.zeros(37), [1], np.full(300, 2)].astype(np.int64))
ONE_CELL = torch.zeros(300, 300, dtype=torch.bool)
ONE_CELL[37, 91] = True

ADVERSARIAL = {
    "single pair": lambda q, kv: (q == 37) & (kv == 91),
    "single hole": lambda q, kv: (q >= kv) & ~((q == 100) & (kv == 50)),
    "checkerboard": lambda q, kv: (q + kv) % 2 == 0,
    "diamonds inside 16-blocks": lambda q, kv: (abs(q % 16 - 8) + abs(kv % 16 - 8)) < 3,
    "hash": lambda q, kv: (q * 7919 + kv * 104729) % 1009 < 3,
    "one-token document": lambda q, kv: (SPIKE_DOC[q] == SPIKE_DOC[kv]) & (q >= kv),
    "one cell of a 2-D table": lambda q, kv: ONE_CELL[q, kv],
    "interior line": lambda q, kv: q - kv == 7,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize("L", [256, 300])
def test_adversarial_predicates(name, L):
    fn = ADVERSARIAL[name]
    ranges, stats = mm.evaluate_mask_mod(fn, L, method="blocks")
    assert stats.fallback is None
    assert same_ranges(ranges, evaluate(fn, L, method="dense"))
    np.testing.assert_array_equal(ranges_to_dense(ranges, L), brute_force(fn, L))


def test_leaves_inside_full_looking_regions_are_evaluated():
    """A single masked pair inside a region whose block corners are all allowed is found."""
    fn = ADVERSARIAL["single hole"]
    dense = ranges_to_dense(evaluate(fn, 300, method="blocks"), 300)
    assert not dense[100, 50] and dense[100, 49] and dense[100, 51] and dense[101, 50]


# ----------------------------------------------------------------------------------------------------
# what the bounds follow, and what they refuse
# ----------------------------------------------------------------------------------------------------

TABLE64 = torch.arange(120) // 9
SUPPORTED = {
    "numpy functions": lambda q, kv: np.where(np.clip(q - kv, -3, 50) > 0, np.minimum(q, 40) >= kv, np.abs(q - kv) < 2),
    "numpy scalars": lambda q, kv: (q - np.int64(3) >= kv) | (kv < np.int32(2)),
    "four arguments": lambda b, h, q, kv: (q >= kv) & (q - kv < 10 + 0 * b * h),
    "torch methods": lambda q, kv: (q - kv).abs().clamp(max=20).le(5).logical_or(kv.eq(0)),
    "casts": lambda q, kv: ((q // 3).to(torch.int32) - (kv // 3).int()).long().bool(),
    "trunc and fmod": lambda q, kv: torch.fmod(q, 7) == torch.div(kv, 5, rounding_mode="trunc") % 7,
    "negative divisor": lambda q, kv: (q % -5) == (kv // -3) % -5,
    "bitwise on non-negative ints": lambda q, kv: ((q & 12) | (kv >> 2)) ^ 3 > 5,
    "shifts": lambda q, kv: (q << 2) > (kv >> 1),
    "like constructors": lambda q, kv: torch.where(q > kv, torch.ones_like(q), torch.zeros_like(kv)) > 0,
    "negative table index": lambda q, kv: TABLE64[q - 3] == TABLE64[kv - 3],
    "constant lookup": lambda b, h, q, kv: kv <= TABLE64[b + 100] * 5,
    "scalar result": lambda q, kv: True,
    "integer result": lambda q, kv: (q - kv) % 3,
}


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_operations_take_the_block_path(name):
    fn = SUPPORTED[name]
    ranges, stats = mm.evaluate_mask_mod(fn, 100, method="blocks", leaf=4)
    assert stats.fallback is None and stats.refused_calls == 0
    assert same_ranges(ranges, evaluate(fn, 100, method="dense"))


NUMPY_DOC = np.repeat(np.arange(10), 12)
BIG = torch.tensor([400_000_000])
REFUSED = {
    "numpy table lookup": (lambda q, kv: NUMPY_DOC[q] == NUMPY_DOC[kv], "NumPy array"),
    "numpy reduction": (lambda q, kv: (q >= kv) & np.all(q >= 0), "numpy.all"),
    "floats": (lambda q, kv: q * 0.5 >= kv, "floating"),
    "true division": (lambda q, kv: q / 2 >= kv, "true division"),
    "divisor may be zero": (lambda q, kv: (q // (kv - 5)) >= 1, "may be 0"),
    "int32 overflow": (lambda q, kv: TABLE[q % TABLE_N] * 1_000_000_000 > kv, "overflow"),
    # torch keeps int32 * (0-d int64 tensor) int32, so this wraps: bounded in int64 it would look fine
    "int32 times a 0-d int64 tensor": (lambda b, h, q, kv: TABLE[q % TABLE_N] * BIG[b * 0] > kv - 60, "overflow"),
    "bool arithmetic": (lambda q, kv: (q > kv) + (q > 3) == 2, "two booleans"),
    "shape query": (lambda q, kv: (q >= kv) & (q.shape[0] > 0), "attribute .shape"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_refused_predicates_fall_back_exactly(name, monkeypatch):
    fn, reason = REFUSED[name]
    with pytest.raises(InvalidMaskError, match="cannot be evaluated blockwise"):
        evaluate(fn, 120, method="blocks")
    monkeypatch.setattr(mm, "WARN_DENSE_SEQLEN", 100)
    with pytest.warns(UserWarning, match="evaluating all 120"):
        ranges, stats = mm.evaluate_mask_mod(fn, 120)
    assert reason in stats.fallback
    assert same_ranges(ranges, evaluate(fn, 120, method="dense"))


def test_python_control_flow_on_a_traced_value_is_refused():
    with pytest.raises(Refused, match="control flow"):
        classify(lambda q, kv: q >= kv if q > 3 else kv < 2, 2, np.array([0]), np.array([7]), np.array([0]),
                 np.array([7]), TableCache())


def test_a_swallowed_refusal_still_refuses():
    def sneaky(q, kv):
        try:
            return kv < 0 if int(q) > 0 else q >= kv  # int() of bounds refuses ...
        except Exception:  # ... and the predicate hides it, answering differently than on arrays
            return kv >= 0

    with pytest.raises(InvalidMaskError, match="int"):
        evaluate(sneaky, 40, method="blocks")


def test_out_of_range_lookups_raise_like_the_dense_path():
    table = torch.arange(50)
    shifted = lambda q, kv: table[q + 5] >= kv  # noqa: E731 - q + 5 leaves the table for q >= 45
    for method in ("dense", "blocks", "auto"):
        with pytest.raises(InvalidMaskError, match="out of bounds"):
            evaluate(shifted, 50, method=method)
    # an index out of range where the bounds alone would call the block full: still evaluated, still raises
    uniform = lambda q, kv: (table[q + 5] >= 0) | (kv < 0)  # noqa: E731
    with pytest.raises(InvalidMaskError, match="out of bounds"):
        evaluate(uniform, 50, method="blocks")
    inside = lambda q, kv: table[q + 5] >= kv  # noqa: E731 - fine for a 45-token sequence
    assert same_ranges(evaluate(inside, 45, method="blocks"), evaluate(inside, 45, method="dense"))


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("L", [1, 37, 1024])
def test_flex_attention_style_masks(name, L):
    """The attention-gym-like workloads of the benchmark: blockwise (never refused) and exact."""
    fn = ZOO[name](L)
    ranges, stats = mm.evaluate_mask_mod(fn, L, method="blocks")
    assert stats.fallback is None and stats.refused_calls == 0
    assert same_ranges(ranges, evaluate(fn, L, method="dense"))


def test_auto_backend_uses_torch_for_predicates_holding_tensors():
    """NumPy arrays compared with a 0-d tensor give the Python bool True: such predicates run on torch."""
    zero = torch.tensor(0)
    fn = lambda q, kv: (q != zero) & (q >= kv)  # noqa: E731
    expect = np.tril(np.ones((20, 20), dtype=bool)) & (np.arange(20)[:, None] != 0)
    for method in ("dense", "blocks"):
        np.testing.assert_array_equal(ranges_to_dense(evaluate(fn, 20, method=method), 20), expect)


def test_head_dependent_mask_mods_are_still_refused():
    per_head = lambda b, h, q, kv: (kv <= q) & (q - kv < 4 + 8 * h)  # noqa: E731
    for kw in ({"method": "blocks"}, {"method": "auto"}, {"device": torch.device("cpu")}):
        with pytest.raises(InvalidMaskError, match="depends on the head index h"):
            from_mask_mod(per_head, 300, cache=False, **kw)


# ----------------------------------------------------------------------------------------------------
# the torch-device path (run here on torch CPU tensors; the same code runs on CUDA)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["causal", "document", "natten"])
def test_device_path_matches(name):
    fn = ZOO[name](512)
    got, stats = mm.evaluate_mask_mod(fn, 512, device=torch.device("cpu"))
    assert stats.exact_calls > 0
    assert same_ranges(got, evaluate(fn, 512, method="dense"))


def test_device_path_dense_fallback_and_cpu_fallback():
    fn = lambda q, kv: (q >= kv) & (q * 0.5 < kv + 3)  # noqa: E731 - refused bounds (floats)
    got, stats = mm.evaluate_mask_mod(fn, 200, device=torch.device("cpu"))
    assert stats.fallback and same_ranges(got, evaluate(fn, 200, method="dense"))
    numpy_only = lambda q, kv: np.take(np.arange(200), q) >= kv  # noqa: E731 - fails on tensors
    assert same_ranges(evaluate(numpy_only, 200, device=torch.device("cpu")), evaluate(numpy_only, 200, method="dense"))
    with pytest.raises(InvalidMaskError, match="device"):
        evaluate(numpy_only, 10, device="no-such-device")


# ----------------------------------------------------------------------------------------------------
# encoders: runs, segment merging, the growing output
# ----------------------------------------------------------------------------------------------------

@EXAMPLES
@given(st.integers(0, 12), st.integers(1, 40), st.floats(0, 1), st.integers(0, 2**31))
def test_runs_match_the_reference_encoder(n, w, density, seed):
    allowed = np.random.default_rng(seed).random((n, w)) < density
    row, start, end = runs_numpy(allowed)
    expect = np.zeros((n, w), dtype=bool)
    for r, s, e in zip(row, start, end):
        assert not expect[r, s:e].any()
        expect[r, s:e] = True
    np.testing.assert_array_equal(expect, allowed)
    assert np.all(np.diff(row * (w + 1) + start) > 0)  # sorted, maximal (no two runs touch)
    assert np.all((start[1:] > end[:-1]) | (row[1:] != row[:-1]))
    t_row, t_start, t_end = runs_torch(torch.from_numpy(allowed))
    for a, b in ((row, t_row), (start, t_start), (end, t_end)):
        np.testing.assert_array_equal(a, b)


@EXAMPLES
@given(st.integers(1, 30), st.integers(1, 30), st.integers(0, 2**31))
def test_segments_to_ranges_equals_dense_to_ranges(n, w, seed):
    """Runs cut into touching pieces at random points and shuffled merge back into dense_to_ranges."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((n, w)) < rng.random()
    row, start, end = runs_numpy(allowed)
    pieces = []
    for r, s, e in zip(row, start, end):
        cuts = np.unique(np.r_[s, rng.integers(s, e, rng.integers(0, 3)), e])
        pieces += [(r, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    rng.shuffle(pieces)
    arr = np.array(pieces, dtype=np.int64).reshape(-1, 3)
    out = RangesBuffer(n)
    out.write(*segments_to_ranges(arr[:, 0], arr[:, 1], arr[:, 2], w))
    np.testing.assert_array_equal(out.result(), dense_to_ranges(allowed))


# ----------------------------------------------------------------------------------------------------
# the cache
# ----------------------------------------------------------------------------------------------------

def _counting(fn):
    calls = []

    def counted(q, kv):
        calls.append(1)
        return fn(q, kv)
    return counted, calls


def test_mask_mod_mask_is_evaluated_once_per_length_across_batch_specs():
    counted, calls = _counting(lambda q, kv: (q >= kv) & (q - kv < 64))
    mask = MaskModMask(counted)
    first = dcp.BatchSpec([3000, 1000], mask, num_heads=2, num_kv_heads=1, head_dim=8).kv_ranges(0)
    n = len(calls)
    again = dcp.BatchSpec([3000, 512], mask, num_heads=2, num_kv_heads=1, head_dim=8).kv_ranges(0)
    assert len(calls) == n and np.array_equal(first, again)
    dcp.BatchSpec([3000, 512], mask, num_heads=2, num_kv_heads=1, head_dim=8).kv_ranges(1)
    assert len(calls) > n  # a new length is evaluated


def test_cache_sees_closure_contents_and_returns_copies():
    doc = torch.tensor(np.repeat(np.arange(4), 25))
    fn = lambda q, kv: (doc[q] == doc[kv]) & (q >= kv)  # noqa: E731
    a = from_mask_mod(fn, 100)
    out = mm.mask_mod_ranges(fn, 100)
    out[:] = 0  # a caller mutating its result does not touch the cache
    assert from_mask_mod(fn, 100) == a
    doc[50:] = 7  # the captured tensor changes in place: a miss, re-evaluated
    b = from_mask_mod(fn, 100)
    assert b != a and b == from_mask_mod(fn, 100, cache=False)


def test_cache_entries_go_with_their_function():
    mask_mod_cache.clear()
    fn = lambda q, kv: q >= kv  # noqa: E731
    from_mask_mod(fn, 64)
    assert mask_mod_cache.cached_count() == 1
    del fn
    gc.collect()
    assert mask_mod_cache.cached_count() == 0


def test_no_cache_evaluates_every_time():
    counted, calls = _counting(lambda q, kv: q >= kv)
    from_mask_mod(counted, 50, cache=False)
    n = len(calls)
    from_mask_mod(counted, 50, cache=False)
    assert len(calls) == 2 * n
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskModMask(counted, cache=False).kv_ranges(50)
    assert len(calls) == 3 * n


def test_benchmark_script_runs_and_checks_against_the_reference(tmp_path):
    """``benchmarks/bench_mask_mod.py`` at tiny sizes: every row written, no failures, equal ranges."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_mask_mod.py"
    out = tmp_path / "mm.csv"
    subprocess.run([sys.executable, str(script), "--seqlen", "256", "--compare-len", "128", "--masks", "causal",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = list(csv.DictReader(open(out)))
    assert [r["method"] for r in rows] == ["blocks", "cached_spec", "blocks", "dense_stream", "dense_reference"]
    assert all(not r.get("error") and r["machine"] for r in rows)
    assert all(r["equal_to_reference"] == "True" for r in rows if r["seqlen"] == "128")
