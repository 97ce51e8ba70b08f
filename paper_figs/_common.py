"""Shared helpers of the figure scripts: read the benchmark CSVs (stdlib only), set up matplotlib.

The scripts read ONLY the CSVs written by ``dcp bench ...`` (default folder benchmarks/results) and
never import dcp. matplotlib is needed only to draw (``pip install matplotlib``, the [bench] extra).
"""
from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGS = Path(__file__).resolve().parent

PLANNERS = ("dcp", "dcp_auto", "best_tuned", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp", "torch_cp",
            "ulysses", "magi", "magi_dynamic")
COLORS = {"dcp": "#d62728", "dcp_auto": "#ff9896", "best_tuned": "#000000", "ring": "#7f7f7f", "zigzag": "#1f77b4",
          "te_a2a_p2p": "#2ca02c", "loongtrain": "#9467bd", "megatron_dyncp": "#8c564b", "torch_cp": "#e377c2",
          "ulysses": "#bcbd22", "magi": "#17becf", "magi_dynamic": "#aec7e8"}
DATASET_TITLES = {"longalign": "LongAlign (synthetic)", "ldc": "Long-Data-Collections (synthetic)"}


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(x, default=float("nan")) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


def find_csv(results: Path, stem: str, tag: str | None) -> Path | None:
    """``results/<stem><tag>.csv``; with ``tag=None`` the full run's file, else the ``_quick`` one."""
    tags = [tag] if tag is not None else ["", "_quick"]
    for t in tags:
        p = Path(results) / f"{stem.format(tag=t)}.csv"
        if p.exists():
            return p
    return None


def pyplot():
    """matplotlib.pyplot with a non-interactive backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7, "figure.dpi": 100})
    return plt


def save(fig, path: Path, legend_ax=None, ncol: int = 7) -> Path:
    """Save a figure; with ``legend_ax`` one shared legend goes below the panels."""
    if legend_ax is not None:
        handles, labels = legend_ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
        rows = -(-len(labels) // ncol)  # legend rows, ~0.2 inch each
        fig.tight_layout(rect=(0, min(0.4, (0.15 + 0.2 * rows) / fig.get_size_inches()[1]), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}")
    return path


def group_mean(rows, key_fn, value_fn) -> dict:
    acc: dict = {}
    for r in rows:
        v = value_fn(r)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        acc.setdefault(key_fn(r), []).append(v)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def figure_parser(doc: str) -> argparse.ArgumentParser:
    """The options every figure script takes: ``--results-dir`` (the CSVs) and ``--out-dir`` (the PNGs)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--out-dir", default=str(FIGS))
    return ap


def run_figure(draw, doc: str, argv=None) -> int:
    """``main`` of a figure script whose ``draw(results_dir, out_dir)`` takes no other option."""
    args = figure_parser(doc).parse_args(argv)
    draw(Path(args.results_dir), Path(args.out_dir))
    return 0
