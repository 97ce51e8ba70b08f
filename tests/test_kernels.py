"""Block-table attention kernels: native (both CPU ISAs) vs pure-PyTorch reference vs a dense fp64 oracle.

Low-precision tolerance follows flash-attention's tests: the error of the kernel under test against the
fp64 oracle must be at most 2x the error of the reference implementation run in the same precision
(plus a tiny absolute slack).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.errors import ExecutionError
from dcp.kernels import TileTable, available_backends, get_kernels, native, reference

try:
    from _budget import n_examples
except ImportError:  # run outside this tests/ folder
    def n_examples(fast: int, slow: int) -> int:
        return fast

HAVE_NATIVE = native.is_available()
ISAS = native.available_cpu_isas() if HAVE_NATIVE else []
needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="dcp._C is not built")
# absolute slack per unit of the oracle's magnitude (max-abs errors at the rounding-noise floor of fp32
# fluctuate by a factor ~3 between two equally accurate implementations)
SLACK = {torch.float64: 1e-10, torch.float32: 4e-6, torch.bfloat16: 1e-4, torch.float16: 2e-5}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These problems are tiny: intra-op threads only add overhead (and spin on a loaded machine).
    Multi-threaded native runs are checked against single-threaded ones bit for bit below."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(_THREADS)


# ------------------------------------------------------------------------------------- problems
def _random_ranges(rng, q_len: int, k_len: int, n_ranges: int) -> np.ndarray:
    """[q_len, R, 2] random relative ranges; some rows empty, some ranges empty or overlapping."""
    starts = rng.integers(0, k_len + 1, size=(q_len, n_ranges))
    ends = starts + rng.integers(0, k_len + 1, size=(q_len, n_ranges))
    out = np.stack([starts, np.minimum(ends, k_len)], axis=-1)
    out[rng.random((q_len, n_ranges)) < 0.2] = 0  # empty (0, 0) slots anywhere
    out[rng.random(q_len) < 0.1] = 0  # rows with no key in this tile
    return out


def _random_segments(rng, n_seg: int, tk: int, max_q: int):
    """List of (q_len, tiles) with disjoint random tiles per segment (shuffled order)."""
    segments = []
    for _ in range(n_seg):
        q_len = int(rng.integers(0, max_q + 1))
        n_tiles = int(rng.integers(0, 4)) if tk else 0
        cuts = np.sort(rng.integers(0, tk + 1, size=2 * n_tiles))
        tiles = []
        for i in range(n_tiles):
            k0, k1 = int(cuts[2 * i]), int(cuts[2 * i + 1])
            if rng.random() < 0.4:
                tiles.append((k0, k1 - k0))
            else:
                tiles.append((k0, k1 - k0, _random_ranges(rng, q_len, k1 - k0, int(rng.integers(1, 4)))))
        rng.shuffle(tiles)
        segments.append((q_len, tiles))
    return segments


@st.composite
def problems(draw, dtypes=(torch.float64, torch.float32, torch.bfloat16)):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    hkv = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([16, 24, 64, 128]))
    big = draw(st.booleans())  # exceed the 48-row / 96-key blocks
    tk = draw(st.integers(0, 260 if big else 40))
    q_start = draw(st.integers(0, 3))
    segments = _random_segments(rng, draw(st.integers(0, 4)), tk, 120 if big else 20)
    tiles = TileTable.from_segments(segments, q_start=q_start)
    tq = q_start + sum(s[0] for s in segments) + draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(dtypes))
    mag = draw(st.sampled_from([0.5, 1.0, 3.0]))  # score magnitude
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tq, hkv * ratio, d, generator=gen, dtype=torch.float64) * mag).to(dtype)
    k = torch.randn(tk, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
    do = torch.randn(tq, hkv * ratio, d, generator=gen, dtype=torch.float64).to(dtype)
    return dict(q=q, k=k, v=v, do=do, tiles=tiles, segments=segments, q_start=q_start, seed=seed)


def _oracle(pb):
    """fp64 dense attention + autograd: o, lse, delta, dq, dk, dv."""
    q, k, v = (pb[n].double().requires_grad_() for n in "qkv")
    allowed = pb["tiles"].to_dense(q.shape[0], k.shape[0])
    o, lse = reference.dense_attention(q, k, v, allowed)
    do = pb["do"].double()
    o.backward(do)
    delta = (do * o.detach()).sum(-1).t().contiguous()
    return dict(o=o.detach(), lse=lse.detach(), delta=delta, dq=q.grad, dk=k.grad, dv=v.grad)


def _sum_scales(pb, ora) -> dict:
    """Per gradient, the largest sum of absolute terms that make up one of its elements (fp64): a sum
    that cancels to ~0 is still rounded at the scale of its terms, so a tolerance scaled by the result
    alone fails exactly where gradients cancel (a key that only its own query attends to gets dK = 0)."""
    q, k, v, do = (pb[n].double() for n in ("q", "k", "v", "do"))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g, scale = hq // hkv, 1.0 / math.sqrt(d)
    allowed = pb["tiles"].to_dense(tq, k.shape[0])
    qg, dog = q.reshape(tq, hkv, g, d), do.reshape(tq, hkv, g, d)
    lse = ora["lse"].reshape(hkv, g, tq)
    s = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
    p = torch.where(allowed, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    dp = torch.einsum("qhgd,khd->hgqk", dog, v).abs()
    ds = p * (dp + ora["delta"].reshape(hkv, g, tq).abs()[..., None])
    return {"dq": _amax(torch.einsum("hgqk,khd->qhgd", ds, k.abs())) * scale,
            "dk": _amax(torch.einsum("hgqk,qhgd->khd", ds, qg.abs())) * scale,
            "dv": _amax(torch.einsum("hgqk,qhgd->khd", p, dog.abs()))}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _check_lse(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    assert got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf rows differ"
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all(), f"{what}: non-finite lse"
    err = _err(got[fin], want[fin])
    assert err <= bound, f"{what}: lse error {err:.3g} > {bound:.3g}"


def _kernel_variants():
    out = [("reference", None)]
    out += [("native", isa) for isa in ISAS]
    return out


def _run(backend: str, isa, fn_name: str, *args, **kwargs):
    ks = get_kernels(backend)
    if isa is None:
        return getattr(ks, fn_name)(*args, **kwargs)
    with native.use_cpu_isa(isa):
        return getattr(ks, fn_name)(*args, **kwargs)


# ---------------------------------------------------------------------------------- correctness
@settings(max_examples=n_examples(120, 2000), **SETTINGS)
@given(pb=problems())
def test_forward_backward_vs_oracle(pb):
    q, k, v, do, tiles = pb["q"], pb["k"], pb["v"], pb["do"], pb["tiles"]
    dtype = q.dtype
    slack = SLACK[dtype]
    ora = _oracle(pb)
    lse_in, delta_in = ora["lse"].float(), ora["delta"].float()

    # the reference in the input precision sets the error budget
    o_ref, lse_ref = reference.attention_forward(q, k, v, tiles)
    g_ref = reference.attention_backward(do, q, k, v, lse_in, delta_in, tiles)
    assert o_ref.dtype == dtype and lse_ref.shape == (q.shape[1], q.shape[0])
    e_o = _err(o_ref, ora["o"])
    e_lse = _err(lse_ref[torch.isfinite(lse_ref)], ora["lse"][torch.isfinite(lse_ref)])
    e_g = [_err(g, w) for g, w in zip(g_ref, (ora["dq"], ora["dk"], ora["dv"]))]
    terms = _sum_scales(pb, ora)
    if dtype == torch.float64:  # the reference itself must be (almost) exact
        assert e_o < 1e-10 and max(e_g) < 1e-4 * (1 + max(_amax(ora[n]) for n in ("dq", "dk", "dv")))
    _check_lse(lse_ref, ora["lse"], 1e-5 * (1 + _amax(ora["lse"][torch.isfinite(ora["lse"])])), "reference")

    for isa in ISAS:
        with native.use_cpu_isa(isa):
            o, lse = native.attention_forward(q, k, v, tiles)
            grads = native.attention_backward(do, q, k, v, lse_in, delta_in, tiles)
        assert o.dtype == dtype and o.shape == q.shape
        assert torch.isfinite(o).all()
        bound = 2 * e_o + slack * (1 + _amax(ora["o"]))
        assert _err(o, ora["o"]) <= bound, f"{isa} o: {_err(o, ora['o']):.3g} vs ref {e_o:.3g}"
        _check_lse(lse, ora["lse"], 2 * e_lse + 1e-5, f"{isa}")
        for name, g, want, e in zip(("dq", "dk", "dv"), grads, (ora["dq"], ora["dk"], ora["dv"]), e_g):
            assert g.dtype == dtype and g.shape == want.shape
            assert torch.isfinite(g).all(), f"{isa} {name}: non-finite"
            err = _err(g, want)
            bound = 2 * e + slack * (1 + max(_amax(want), terms[name]))
            assert err <= bound, f"{isa} {name}: {err:.3g} vs ref {e:.3g} (bound {bound:.3g})"


@needs_native
@settings(max_examples=n_examples(25, 300), **SETTINGS)
@given(pb=problems(dtypes=(torch.float16,)))
def test_float16_native_vs_reference(pb):
    q, k, v, do, tiles = pb["q"], pb["k"], pb["v"], pb["do"], pb["tiles"]
    ora = _oracle(pb)
    o_ref, _ = reference.attention_forward(q, k, v, tiles)
    g_ref = reference.attention_backward(do, q, k, v, ora["lse"].float(), ora["delta"].float(), tiles)
    o, _ = native.attention_forward(q, k, v, tiles)
    g = native.attention_backward(do, q, k, v, ora["lse"].float(), ora["delta"].float(), tiles)
    slack = SLACK[torch.float16]
    assert _err(o, ora["o"]) <= 2 * _err(o_ref, ora["o"]) + slack * (1 + _amax(ora["o"]))
    for a, b, w in zip(g, g_ref, (ora["dq"], ora["dk"], ora["dv"])):
        assert _err(a, w) <= 2 * _err(b, w) + slack * (1 + _amax(w))


@needs_native
@settings(max_examples=n_examples(25, 300), **SETTINGS)
@given(pb=problems(dtypes=(torch.float32, torch.bfloat16)))
def test_fp32_grads_deterministic_and_thread_independent(pb):
    """float32 grads match the reference; results do not depend on the number of threads."""
    q, k, v, do, tiles = pb["q"], pb["k"], pb["v"], pb["do"], pb["tiles"]
    o, lse = native.attention_forward(q, k, v, tiles)
    delta = (do.float() * o.float()).sum(-1).t().contiguous()
    g32 = native.attention_backward(do, q, k, v, lse, delta, tiles, out_dtype=torch.float32)
    g_ref = reference.attention_backward(do, q, k, v, lse, delta, tiles, out_dtype=torch.float32)
    for a, b in zip(g32, g_ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(3, _THREADS))  # more workers than cores: many interleavings
        o1, lse1 = native.attention_forward(q, k, v, tiles)
        g1 = native.attention_backward(do, q, k, v, lse, delta, tiles, out_dtype=torch.float32)
        assert torch.get_num_threads() > 1
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(o, o1) and torch.equal(lse, lse1)
    for a, b in zip(g32, g1):
        assert torch.equal(a, b)


@needs_native
def test_strided_inputs():
    torch.manual_seed(0)
    tq, tk, hq, hkv, d = 70, 130, 4, 2, 32
    qkv = torch.randn(max(tq, tk), 3, hq, d)
    q, k, v = qkv[:tq, 0], qkv[:tk, 1, :hkv], qkv[:tk, 2, hkv:]
    tiles = TileTable.from_segments([(30, [(0, 50), (60, 70, np.tile([[[0, 40]]], (30, 1, 1)))]),
                                     (40, [(10, 120)])])
    o_ref, lse_ref = reference.attention_forward(q, k, v, tiles)
    o, lse = native.attention_forward(q, k, v, tiles)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    o2, _ = native.attention_forward(q.transpose(0, 1).contiguous().transpose(0, 1),
                                     k.clone(), v[..., :].clone(), tiles)
    torch.testing.assert_close(o2, o)
    do = torch.randn(tq, hq, 2 * d)[..., ::2]  # non-unit last stride: copied by the wrapper
    delta = (do * o).sum(-1).t().contiguous()
    gn = native.attention_backward(do, q, k, v, lse.t().contiguous().t(), delta, tiles)
    gr = reference.attention_backward(do, q, k, v, lse, delta, tiles)
    for a, b in zip(gn, gr):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------- merges
def _split_tile(tile, cut: int):
    """Cut a tile at relative key `cut` into two tiles (ranges clipped and shifted)."""
    k0, kl = tile[0], tile[1]
    ranges = tile[2] if len(tile) > 2 else None
    if ranges is None:
        return (k0, cut), (k0 + cut, kl - cut)
    left = np.minimum(ranges, cut)
    right = np.clip(ranges - cut, 0, kl - cut)
    return (k0, cut, left), (k0 + cut, kl - cut, right)


@settings(max_examples=n_examples(60, 600), **SETTINGS)
@given(pb=problems(dtypes=(torch.float64, torch.float32)), n_parts=st.integers(1, 3),
       backend=st.sampled_from(["reference", "native"] if HAVE_NATIVE else ["reference"]))
def test_merge_of_split_kv_equals_whole(pb, n_parts, backend):
    ks = get_kernels(backend)
    q, k, v, tiles = pb["q"], pb["k"], pb["v"], pb["tiles"]
    rng = np.random.default_rng(pb["seed"] + 1)
    parts = [[] for _ in range(n_parts)]  # per part: list of (q_len, tiles)
    for q_len, seg_tiles in pb["segments"]:
        buckets = [[] for _ in range(n_parts)]
        for tile in seg_tiles:
            if tile[1] >= 2 and rng.random() < 0.5:  # split the tile's KV range across two parts
                a, b = _split_tile(tile, int(rng.integers(1, tile[1])))
                buckets[int(rng.integers(n_parts))].append(a)
                buckets[int(rng.integers(n_parts))].append(b)
            else:
                buckets[int(rng.integers(n_parts))].append(tile)
        for p in range(n_parts):
            parts[p].append((q_len, buckets[p]))
    o_whole, lse_whole = ks.forward(q, k, v, tiles)
    outs = [ks.forward(q, k, v, TileTable.from_segments(p, q_start=pb["q_start"])) for p in parts]
    o, lse = ks.merge_partials([x[0] for x in outs], [x[1] for x in outs])
    tol = 1e-6 if q.dtype == torch.float64 else 2e-5  # partial lse are float32
    torch.testing.assert_close(o, o_whole, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_whole, rtol=tol, atol=tol)
    # incremental merge into a float64 accumulator
    o_acc = torch.zeros(q.shape, dtype=torch.float64)
    lse_acc = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for x in outs:
        ks.merge_into(o_acc, lse_acc, x[0], x[1])
    torch.testing.assert_close(o_acc, o_whole.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse_acc, lse_whole, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_edge_rows(backend, dtype):
    ks = get_kernels(backend)
    t, h, d = 5, 2, 8
    ninf = float("-inf")
    o1 = torch.randn(t, h, d).to(dtype)
    o2 = torch.randn(t, h, d).to(dtype)
    lse1 = torch.tensor([[0.0, ninf, ninf, 3.0, -1e4], [1.0, 2.0, ninf, 3.0, 50.0]])
    lse2 = torch.tensor([[ninf, 1.0, ninf, 3.0, -1e4], [1.0, ninf, ninf, 100.0, 50.0]])
    o2[2] = float("nan")  # a partial with lse = -inf must not leak into the result
    o1[2] = float("nan")
    o, lse = ks.merge_partials([o1, o2], [lse1, lse2])
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.isneginf(lse[:, 2]).all()
    torch.testing.assert_close(o[0, 0].float(), o1[0, 0].float())
    torch.testing.assert_close(o[1, 0].float(), o2[1, 0].float())
    torch.testing.assert_close(o[3, 0].float(), 0.5 * (o1[3, 0].float() + o2[3, 0].float()), atol=1e-2, rtol=1e-2)
    assert math.isclose(float(lse[0, 3]), 3.0 + math.log(2), rel_tol=1e-6)
    assert math.isclose(float(lse[0, 4]), -1e4 + math.log(2), rel_tol=1e-6)
    torch.testing.assert_close(o[3, 1].float(), o2[3, 1].float())
    assert torch.isfinite(o).all()
    single_o, single_lse = ks.merge_partials([o1], [lse1])
    assert torch.equal(single_lse, lse1)


# ------------------------------------------------------------------------------------ bad inputs
def _good():
    q = torch.randn(10, 4, 16)
    k = torch.randn(12, 2, 16)
    tiles = TileTable.from_segments([(6, [(0, 5), (5, 7, np.zeros((6, 1, 2)))])], q_start=2)
    return q, k, k.clone(), tiles


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _bad_tile_tables():
    q, k, v, t = _good()
    rep = lambda **kw: TileTable(**{**{f: getattr(t, f) for f in (
        "seg_cu", "seg_tile_ptr", "tile_k_start", "tile_k_len", "tile_mask_row", "mask_ranges")}, **kw})
    return {
        "k past Tk": rep(tile_k_start=_i32([0, 6])),
        "overlapping tiles": rep(tile_k_start=_i32([0, 4])),
        "negative k_len": rep(tile_k_len=_i32([-1, 7])),
        "range past k_len": rep(mask_ranges=torch.full((6, 1, 2), 3, dtype=torch.int32).index_fill_(
            2, torch.tensor([1]), 8)),
        "reversed range": rep(mask_ranges=torch.tensor([[[3, 2]]] * 6, dtype=torch.int32)),
        "mask rows missing": rep(tile_mask_row=_i32([-1, 1])),
        "seg_cu decreasing": rep(seg_cu=_i32([8, 2]), seg_tile_ptr=_i32([0, 2])),
        "seg past Tq": rep(seg_cu=_i32([2, 11])),
        "ptr end wrong": rep(seg_tile_ptr=_i32([0, 1])),
        "int64 field": rep(tile_k_len=torch.tensor([5, 7])),
        "bad mask shape": rep(mask_ranges=torch.zeros(6, 1, 3, dtype=torch.int32)),
    }


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("case", sorted(_bad_tile_tables()))
def test_bad_tile_table_raises(backend, case):
    q, k, v, _ = _good()
    tiles = _bad_tile_tables()[case]
    with pytest.raises(ExecutionError):
        get_kernels(backend).forward(q, k, v, tiles)


@needs_native
@pytest.mark.parametrize("case", sorted(set(_bad_tile_tables()) - {"int64 field", "bad mask shape"}))
def test_extension_checks_tables_itself(case):
    """The C++ entry validates tables on its own (memory safety when called without the wrapper)."""
    from dcp import _C

    q, k, v, _ = _good()
    with pytest.raises(RuntimeError, match="invalid tile table|must"):
        _C.attention_forward(q, k, v, *_bad_tile_tables()[case].as_tuple(), 0.25)


def _bad_inputs():
    q, k, v, t = _good()
    lse, delta, do = torch.zeros(4, 10), torch.zeros(4, 10), torch.zeros_like(q)
    return {
        "int dtype": ((q.int(), k.int(), v.int(), t), {}),
        "mixed dtype": ((q, k.double(), v, t), {}),
        "head ratio": ((torch.randn(10, 3, 16), k, v, t), {}),
        "head dim": ((torch.randn(10, 4, 8), k, v, t), {}),
        "k/v shapes": ((q, k, v[:5], t), {}),
        "2-d q": ((q[0], k, v, t), {}),
        "not a table": ((q, k, v, "tiles"), {}),
        "nan scale": ((q, k, v, t), {"scale": float("nan")}),
        "meta device": ((q.to("meta"), k, v, t), {}),
        "bwd lse shape": ((do, q, k, v, lse[:, :5], delta, t), {"backward": True}),
        "bwd lse dtype": ((do, q, k, v, lse.double(), delta, t), {"backward": True}),
        "bwd do dtype": ((do.double(), q, k, v, lse, delta, t), {"backward": True}),
        "bwd out dtype": ((do, q, k, v, lse, delta, t), {"backward": True, "out_dtype": torch.int32}),
    }


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_bad_inputs_raise(backend, case):
    args, kw = _bad_inputs()[case]
    kw = dict(kw)
    fn = get_kernels(backend).backward if kw.pop("backward", False) else get_kernels(backend).forward
    with pytest.raises(ExecutionError):
        fn(*args, **kw)


@pytest.mark.parametrize("backend", available_backends())
def test_bad_merge_inputs_raise(backend):
    ks = get_kernels(backend)
    o, lse = torch.zeros(4, 2, 8), torch.zeros(2, 4)
    for o_list, lse_list in (([], []), ([o], []), ([o, o[:3]], [lse, lse]), ([o], [lse.double()]),
                             ([o], [lse.t()]), ([o.long()], [lse])):
        with pytest.raises(ExecutionError):
            ks.merge_partials(o_list, lse_list)
    with pytest.raises(ExecutionError):
        ks.merge_into(o, lse, o[:, :1], lse[:1])


def test_backend_selection():
    assert "reference" in available_backends()
    assert get_kernels("reference").name == "reference"
    assert get_kernels().name == ("native" if HAVE_NATIVE else "reference")
    with pytest.raises(ExecutionError):
        get_kernels("cuda-magic")
    if HAVE_NATIVE:
        assert native.cpu_isa() in ISAS
        with pytest.raises(ExecutionError):
            with native.use_cpu_isa("avx9000"):
                pass


def test_empty_problems():
    for backend in available_backends():
        ks = get_kernels(backend)
        q, k = torch.randn(3, 2, 8), torch.randn(0, 1, 8)
        o, lse = ks.forward(q, k, k, TileTable.from_segments([(3, [])]))
        assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
        dq, dk, dv = ks.backward(q, q, k, k, lse, torch.zeros(2, 3), TileTable.from_segments([(3, [])]))
        assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == (0, 1, 8)
        o, lse = ks.forward(q[:0], torch.randn(4, 1, 8), torch.randn(4, 1, 8), TileTable.from_segments([]))
        assert o.shape == (0, 2, 8) and lse.shape == (2, 0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_single_key_rows_copy_v_exactly(dtype):
    """With one allowed key per row o = v (P = 1): exercises the storage conversions bit for bit,
    including subnormal, tiny and huge values."""
    info = torch.finfo(dtype)
    vals = torch.tensor([0.0, -0.0, 1.0, -2.5, info.max, -info.max, info.tiny, info.tiny / 4, 1e-3, 3.14159],
                        dtype=torch.float64).to(dtype)
    tk, d = vals.numel(), 16
    v = vals[:, None, None].expand(tk, 1, d).contiguous()
    k = torch.randn(tk, 1, d).to(dtype)
    q = torch.randn(tk, 2, d).to(dtype)
    ranges = np.stack([np.arange(tk), np.arange(tk) + 1], axis=-1)[:, None, :]  # row i sees key i
    tiles = TileTable.from_segments([(tk, [(0, tk, ranges)])])
    for isa in ISAS:
        with native.use_cpu_isa(isa):
            o, lse = native.attention_forward(q, k, v, tiles)
        assert torch.equal(o[:, 0], v[:, 0]) and torch.equal(o[:, 1], v[:, 0]), isa
        s = (q.double() * k.double()).sum(-1).t() / math.sqrt(d)
        torch.testing.assert_close(lse.double(), s, rtol=1e-5, atol=1e-5)
