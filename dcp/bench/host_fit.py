"""Fit the cost model's host costs (``GPUProfile.host_*``) to ``dcp bench overhead``'s per-device timings.

``dcp bench overhead`` times every device's executor step by step on meta tensors with no-op kernels and
transport, and writes one row per (case, direction, device) to ``overhead_devices_cpu.csv``: the
device's instruction counts (``n_launch``, ``n_wait``, ``n_compute``, ``n_reduce``, ``n_moving_rounds``,
``n_messages``) and the CPU microseconds of each item. The simulator charges a device's host

    program + Σ_rounds that move (launch + message × messages + wait) + compute × computes
            + reduce × reduces + reduce_step × rounds with reduces

(``dcp.sim.streams.host_tables``), so the fit is per item, by least squares through the origin over every
device of every case and both directions, coefficients kept >= 0:

- ``launch_us ≈ host_launch_us × n_moving_rounds + a × n_messages`` and
  ``wait_us ≈ host_wait_us × n_moving_rounds + b × n_messages``; ``host_message_us = a + b`` (the model
  charges a message once, with its launch);
- ``compute_us ≈ host_compute_us × n_compute``;
- ``reduce_us ≈ host_reduce_us × n_reduce + host_reduce_step_us × n_reduce_steps``: the executor merges a
  round's partials as one step (its views made in one batch, one grouped sum per layer), so a step costs
  about the same whether it merges two units or two hundred, and each unit adds a little;
- ``host_program_us``: the median over devices of ``setup_us + finish_us``.

A launch or wait of a round in which the device moves nothing costs the executor a little too; the model
does not charge it, so the fit spreads it over the moving rounds. ``quality`` reports, per item and for
the whole step, the median and worst relative error of the fitted time against the measured one.
These are CPU times of the machine named in the CSV, with no GPU work issued: a lower bound for a GPU
host, whose launches also go through the CUDA driver.
"""
from __future__ import annotations

import statistics

import numpy as np

ITEM_COLUMNS = {"launch": ("n_moving_rounds", "n_messages"), "wait": ("n_moving_rounds", "n_messages"),
                "compute": ("n_compute",), "reduce": ("n_reduce", "n_reduce_steps")}


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``y ≈ x @ c`` through the origin with ``c >= 0`` (by trying every support: two columns)."""
    best, best_res = np.zeros(x.shape[1]), float(y @ y)
    n = x.shape[1]
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub = x[:, cols]
        if not sub.any():
            continue
        c, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if (c < 0).any():
            continue
        res = float(((sub @ c) - y) @ ((sub @ c) - y))
        if res < best_res:
            best_res, best = res, np.zeros(n)
            best[cols] = c
    return best


def _rel_errors(pred: np.ndarray, got: np.ndarray) -> np.ndarray:
    keep = got > 0
    return np.abs(pred[keep] - got[keep]) / got[keep]


def fit_host_costs(rows: list[dict]) -> dict:
    """``{"fields": {host_*: microseconds}, "quality": {...}, "devices": n}`` from per-device rows (module
    docstring). Raises ``ValueError`` when the rows lack a column or hold no device that does anything."""
    need = {"setup_us", "finish_us", *(f"{k}_us" for k in ITEM_COLUMNS),
            *(c for cols in ITEM_COLUMNS.values() for c in cols)}
    if not rows:
        raise ValueError("no per-device rows to fit (run `dcp bench overhead` first)")
    missing = sorted(need - set(rows[0]))
    if missing:
        raise ValueError(f"per-device rows lack columns {missing} (an overhead_devices CSV from an older dcp?)")
    col = {k: np.array([float(r[k]) for r in rows]) for k in need}
    busy = (col["n_compute"] + col["n_moving_rounds"] + col["n_reduce"]) > 0
    if not busy.any():
        raise ValueError("no device in the rows runs any instruction")
    coef, quality = {}, {}
    pred_total = np.zeros(len(rows))
    for item, cols in ITEM_COLUMNS.items():
        x = np.stack([col[c] for c in cols], axis=1)
        c = _nonneg_lstsq(x, col[f"{item}_us"])
        coef[item] = c
        pred = x @ c
        pred_total += pred
        err = _rel_errors(pred, col[f"{item}_us"])
        quality[item] = {"median_rel_error": round(float(np.median(err)), 3) if err.size else None,
                         "worst_rel_error": round(float(err.max()), 3) if err.size else None}
    program = float(statistics.median((col["setup_us"] + col["finish_us"])[busy]))
    pred_total += np.where(busy, program, 0.0)
    got_total = sum(col[f"{k}_us"] for k in ("setup", "finish", *ITEM_COLUMNS))
    err = _rel_errors(pred_total[busy], got_total[busy])
    quality["step"] = {"median_rel_error": round(float(np.median(err)), 3), "worst_rel_error": round(float(err.max()), 3)}
    fields = {"host_program_us": program, "host_launch_us": coef["launch"][0],
              "host_message_us": coef["launch"][1] + coef["wait"][1], "host_wait_us": coef["wait"][0],
              "host_compute_us": coef["compute"][0], "host_reduce_us": coef["reduce"][0],
              "host_reduce_step_us": coef["reduce"][1]}
    return {"fields": {k: round(float(v), 2) for k, v in fields.items()}, "quality": quality,
            "devices": int(busy.sum())}


__all__ = ["fit_host_costs", "ITEM_COLUMNS"]
