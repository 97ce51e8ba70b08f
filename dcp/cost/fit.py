"""Fitting cost-profile constants to timings (pure functions: timings in, constants out).

Used by ``dcp bench calibrate`` (CPU: native tile calls, merges, gloo transfers) and by
``benchmarks/bench_gpu.py`` (GPU: varlen tile calls). Each fit follows one term of ``CostModel``:

- tiles: ``t = overhead + flops / (rate * eff(q) * eff(kv) * partial)``, ``eff(n) = n / (n + half)``
  (``fit_tiles``: ``half`` by a log-spaced search, ``rate`` and ``overhead`` by least squares in relative
  error at each ``half``; the backward rate and the partial-tile efficiency with those fixed; or, for
  kernels that compute whole key sub-blocks, ``partial_waste``: a partial tile costs its attended pairs
  plus that many keys per row, at the full-tile rate, at most the whole tile -- ``fit_partial_waste``);
- links: ``t = latency + bytes / bandwidth`` (``fit_affine``);
- memory-bound kernels: ``t = overhead + bytes / bandwidth`` (``fit_affine``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dcp.errors import InvalidConfigError


@dataclass(frozen=True)
class TilePoint:
    """One timed kernel call over one square-or-rectangular tile: ``q_len`` x ``kv_len`` rows/keys,
    ``flops`` (4 * pairs * Hq * D forward, 2.5x that backward), ``full`` (no mask inside the tile),
    ``direction`` ("forward" | "backward"), ``seconds`` (median of repeats)."""

    q_len: int
    kv_len: int
    flops: float
    full: bool
    direction: str
    seconds: float


@dataclass(frozen=True)
class TileFit:
    """Fitted tile-kernel constants (rates in FLOP/s, half in tokens, overhead in seconds) and the fit's
    median / worst relative error over the points it was fitted to."""

    fwd_rate: float
    bwd_rate: float
    half: float
    partial_efficiency: float
    overhead_s: float
    median_rel_err: float
    worst_rel_err: float


@dataclass(frozen=True)
class AffineFit:
    """``seconds = intercept_s + nbytes / bytes_per_s``, with the fit's median / worst relative error."""

    intercept_s: float
    bytes_per_s: float
    median_rel_err: float
    worst_rel_err: float


def _eff(q, kv, half) -> np.ndarray:
    return (q / (q + half)) * (kv / (kv + half))


def _model(pts: Sequence[TilePoint], fwd_rate, bwd_rate, half, part, over) -> np.ndarray:
    q = np.array([p.q_len for p in pts], float)
    kv = np.array([p.kv_len for p in pts], float)
    rate = np.array([fwd_rate if p.direction == "forward" else bwd_rate for p in pts])
    pen = np.where([p.full for p in pts], 1.0, part)
    flops = np.array([p.flops for p in pts])
    return over + flops / (rate * _eff(q, kv, half) * pen)


def _rel_lstsq(x: np.ndarray, t: np.ndarray, fixed_intercept: float | None = None) -> tuple[float, float]:
    """``t ≈ a + b * x`` minimizing relative error (rows weighted by 1/t); a, b ≥ 0. Returns (a, b)."""
    w = 1.0 / t
    if fixed_intercept is not None:
        y = (t - fixed_intercept) * w
        b = float(np.dot(x * w, y) / max(np.dot(x * w, x * w), 1e-300))
        return fixed_intercept, max(b, 1e-300)
    a_mat = np.stack([w, x * w], axis=1)
    (a, b), *_ = np.linalg.lstsq(a_mat, np.ones_like(t), rcond=None)
    if a < 0:  # no overhead visible at these sizes
        return 0.0, _rel_lstsq(x, t, 0.0)[1]
    return float(a), max(float(b), 1e-300)


def fit_tiles(points: Sequence[TilePoint], halves: Sequence[float] | None = None,
              overhead_s: float | None = None) -> TileFit:
    """Fit the tile-kernel curve to timed calls (see the module docstring). ``overhead_s``: the calls'
    fixed cost when known (``dcp bench calibrate`` passes 0: its calls hold many tiles and the executor's
    fixed costs are fitted apart), None: fitted with the rest.

    Needs full forward tiles of at least two sizes and at least one full backward tile; partial tiles
    are optional (partial efficiency 1.0 without them). Raises ``InvalidConfigError`` otherwise."""
    pts = [p for p in points if p.seconds > 0 and p.flops > 0]
    full_f = [p for p in pts if p.full and p.direction == "forward"]
    full_b = [p for p in pts if p.full and p.direction == "backward"]
    if len({(p.q_len, p.kv_len) for p in full_f}) < 2 or not full_b:
        raise InvalidConfigError("fit_tiles needs full forward tiles of >= 2 sizes and >= 1 full backward tile, "
                                 f"got {len(full_f)} forward / {len(full_b)} backward full points")
    halves = np.geomspace(1.0, 8192.0, 160) if halves is None else np.asarray(halves, float)
    t_f = np.array([p.seconds for p in full_f])

    def score(half):
        x = np.array([p.flops / _eff(p.q_len, p.kv_len, half) for p in full_f])
        over, inv_rate = _rel_lstsq(x, t_f, overhead_s)
        return float(np.sum(np.log((over + x * inv_rate) / t_f) ** 2)), float(half), over, 1.0 / inv_rate

    best = min((score(h) for h in halves), key=lambda r: r[0])
    for _ in range(3):  # refine around the best grid point (the grid is coarse)
        step = (halves[1] / halves[0]) ** 0.5 if len(halves) > 1 else 1.0
        halves = np.geomspace(best[1] / step, best[1] * step, 41)
        best = min([best] + [score(h) for h in halves], key=lambda r: r[0])
    _, half, over, fwd_rate = best
    xb = np.array([p.flops / _eff(p.q_len, p.kv_len, half) for p in full_b])
    _, inv_b = _rel_lstsq(xb, np.array([p.seconds for p in full_b]), over)
    bwd_rate = 1.0 / inv_b
    part_pts = [p for p in pts if not p.full and p.seconds > over]
    if part_pts:
        ratios = [float(_model([p], fwd_rate, bwd_rate, half, 1.0, 0.0)[0]) / (p.seconds - over) for p in part_pts]
        part = float(min(1.0, np.median(ratios)))
    else:
        part = 1.0
    rel = np.abs(_model(pts, fwd_rate, bwd_rate, half, part, over) / np.array([p.seconds for p in pts]) - 1)
    return TileFit(fwd_rate, bwd_rate, half, part, over, float(np.median(rel)), float(rel.max()))


def fit_partial_waste(shapes: Sequence[tuple[float, float, float]],
                      grid: Sequence[float] | None = None) -> tuple[float, float, float]:
    """``GPUProfile.partial_waste_keys`` from partial tiles timed against the same tiles full:
    ``shapes`` = (rows = keys of the tile, attended fraction of its pairs, measured time / full time).
    The model's ratio is ``min(fraction + waste / rows, 1)``; waste by a log-spaced search minimizing the
    squared log error. Returns (waste keys, median and worst relative error). Needs >= 2 shapes."""
    if len(shapes) < 2:
        raise InvalidConfigError("fit_partial_waste needs >= 2 partial tile shapes")
    rows = np.array([s[0] for s in shapes], float)
    frac = np.array([s[1] for s in shapes], float)
    meas = np.array([s[2] for s in shapes], float)
    grid = np.geomspace(0.5, 4096.0, 321) if grid is None else np.asarray(grid, float)

    def err(w):
        return float(np.sum(np.log(np.minimum(frac + w / rows, 1.0) / meas) ** 2))

    waste = float(min(grid, key=err))
    rel = np.abs(np.minimum(frac + waste / rows, 1.0) / meas - 1)
    return waste, float(np.median(rel)), float(rel.max())


def fit_affine(nbytes: Sequence[float], seconds: Sequence[float]) -> AffineFit:
    """``seconds ≈ intercept + nbytes / bandwidth`` in relative error (so small and large sizes both count).
    Needs at least two distinct sizes; raises ``InvalidConfigError`` otherwise."""
    x = np.asarray(nbytes, float)
    t = np.asarray(seconds, float)
    if x.shape != t.shape or np.unique(x).size < 2 or (t <= 0).any():
        raise InvalidConfigError("fit_affine needs >= 2 distinct sizes and positive times, one time per size")
    a, b = _rel_lstsq(x, t)
    rel = np.abs((a + b * x) / t - 1)
    return AffineFit(a, 1.0 / b, float(np.median(rel)), float(rel.max()))


def rel_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured (inf when nothing was measured)."""
    return abs(predicted - measured) / measured if measured > 0 else math.inf


__all__ = ["AffineFit", "TileFit", "TilePoint", "fit_affine", "fit_partial_waste", "fit_tiles", "rel_error"]
