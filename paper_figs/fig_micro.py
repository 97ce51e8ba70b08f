"""Micro-benchmark figures in the paper's layout, from ``micro_<profile>[_quick]_summary.csv`` only.

- ``micro_causal_<dataset>_<profile>.png``: causal mask, forward (left) and backward (right); grouped bars
  per length scale, one bar per planner, y = simulated ms (mean over the batches of the cell); dcp's
  speedup over the best tuned baseline (``best_tuned``, black; where the CSV has it) and over the best
  baseline at default knobs are written above each group ("tuned / default").
- ``micro_sparse_<dataset>_<profile>.png``: the same for lambda, shared-question and causal-blockwise
  masks (one row per mask).

    python paper_figs/fig_micro.py [--results-dir benchmarks/results] [--out-dir paper_figs]
                                   [--profiles a100,h100] [--tag _quick]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paper_figs._common import (COLORS, DATASET_TITLES, PLANNERS, figure_parser, find_csv, num, pyplot,  # noqa: E402
                                read_csv, save)

SPARSE = ("lambda", "shared_question", "causal_blockwise")


def _bars(ax, rows, direction: str, title: str) -> None:
    rows = sorted(rows, key=lambda r: num(r["scale"]))
    planners = [p for p in PLANNERS if rows and f"{p}_{direction}_ms" in rows[0]]
    width = 0.8 / max(len(planners), 1)
    for i, p in enumerate(planners):
        xs = [g + (i - (len(planners) - 1) / 2) * width for g in range(len(rows))]
        ax.bar(xs, [num(r[f"{p}_{direction}_ms"]) for r in rows], width, label=p, color=COLORS.get(p))
    for g, r in enumerate(rows):
        sp = num(r.get(f"dcp_{direction}_speedup"))
        tuned = num(r.get(f"dcp_{direction}_speedup_vs_tuned"))
        top = max(num(r.get(f"{p}_{direction}_ms"), 0) for p in planners)
        text = f"{sp:.2f}x" if tuned != tuned else f"{tuned:.2f}x / {sp:.2f}x"
        ax.text(g, top * 1.02, text, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"x{num(r['scale']):g}" for r in rows])
    ax.set_ylabel("simulated ms")
    ax.set_title(title)
    ax.margins(y=0.15)


def draw(results: Path, out_dir: Path, profiles, tag=None) -> list[Path]:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no figures drawn (pip install matplotlib)")
        return []
    written = []
    for profile in profiles:
        path = find_csv(results, f"micro_{profile}{{tag}}_summary", tag)
        if path is None:
            print(f"no micro summary CSV for profile {profile} in {results}")
            continue
        rows = read_csv(path)
        for ds in dict.fromkeys(r["dataset"] for r in rows):
            causal = [r for r in rows if r["dataset"] == ds and r["mask"] == "causal"]
            if causal:
                fig, axes = plt.subplots(1, 2, figsize=(9, 3.3))
                for ax, d in zip(axes, ("fwd", "bwd")):
                    _bars(ax, causal, d, f"{DATASET_TITLES.get(ds, ds)}, causal, "
                                         f"{'forward' if d == 'fwd' else 'backward'}")
                fig.suptitle(f"SIMULATED ({profile} profile) - {path.name}", fontsize=8)
                written.append(save(fig, out_dir / f"micro_causal_{ds}_{profile}.png", legend_ax=axes[0]))
            masks = [m for m in SPARSE if any(r["dataset"] == ds and r["mask"] == m for r in rows)]
            if masks:
                fig, axes = plt.subplots(len(masks), 2, figsize=(9, 2.5 * len(masks) + 0.5), squeeze=False)
                for i, m in enumerate(masks):
                    sel = [r for r in rows if r["dataset"] == ds and r["mask"] == m]
                    for j, d in enumerate(("fwd", "bwd")):
                        _bars(axes[i][j], sel, d, f"{DATASET_TITLES.get(ds, ds)}, {m}, "
                                                  f"{'forward' if d == 'fwd' else 'backward'}")
                fig.suptitle(f"SIMULATED ({profile} profile) - {path.name}", fontsize=8)
                written.append(save(fig, out_dir / f"micro_sparse_{ds}_{profile}.png", legend_ax=axes[0][0]))
    return written


def main(argv=None) -> int:
    ap = figure_parser(__doc__)
    ap.add_argument("--profiles", default="a100,h100")
    ap.add_argument("--tag", default=None, help="CSV name suffix, e.g. _quick (default: full run, else _quick)")
    args = ap.parse_args(argv)
    draw(Path(args.results_dir), Path(args.out_dir), [p for p in args.profiles.split(",") if p], args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
