"""End-to-end figure from ``e2e_a100.csv`` (or ``e2e_a100_quick.csv``): SIMULATED GPT-8B iteration time of
dcp vs the best Megatron static CP size per (dataset, max length, mask), speedup above each pair.

    python paper_figs/fig_e2e.py [--results-dir benchmarks/results] [--out-dir paper_figs] [--profile a100]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paper_figs._common import COLORS, DATASET_TITLES, figure_parser, find_csv, num, pyplot, read_csv, save  # noqa: E402


def _klabel(n) -> str:
    n = int(num(n))
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def draw(results: Path, out_dir: Path, profile: str = "a100") -> list[Path]:
    plt = pyplot()
    path = find_csv(Path(results), f"e2e_{profile}{{tag}}", None)
    if plt is None or path is None:
        print(f"matplotlib missing or no e2e_{profile}.csv: nothing drawn")
        return []
    rows = read_csv(path)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.2), squeeze=False)
    colors = {"dcp": COLORS["dcp"], "megatron_best": COLORS["megatron_dyncp"]}
    for ax, ds in zip(axes[0], datasets):
        sel = [r for r in rows if r["dataset"] == ds]
        cells = list(dict.fromkeys((int(num(r["max_len"])), r["mask"]) for r in sel))
        get = {(int(num(r["max_len"])), r["mask"], r["planner"]): r for r in sel}
        width = 0.38
        for i, p in enumerate(("megatron_best", "dcp")):
            xs = [g + (i - 0.5) * width for g in range(len(cells))]
            ax.bar(xs, [num(get.get((L, mk, p), {}).get("iteration_s")) for L, mk in cells], width,
                   label=p, color=colors[p])
        for g, (L, mk) in enumerate(cells):
            d = get.get((L, mk, "dcp"), {})
            top = max(num(get.get((L, mk, p), {}).get("iteration_s"), 0) for p in ("dcp", "megatron_best"))
            ax.text(g, top * 1.02, f"{num(d.get('speedup_vs_megatron_best')):.2f}x", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{_klabel(L)}\n{mk}" for L, mk in cells])
        ax.set_xlabel("max length (= batch tokens), mask")
        ax.set_ylabel("simulated iteration time (s)")
        ax.set_title(f"GPT-8B e2e, {DATASET_TITLES.get(ds, ds)}\nSIMULATED ({profile}); label: dcp speedup",
                     fontsize=8)
        ax.margins(y=0.15)
        ax.legend(loc="upper left")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [save(fig, Path(out_dir) / f"e2e_{profile}.png")]


def main(argv=None) -> int:
    ap = figure_parser(__doc__)
    ap.add_argument("--profile", default="a100")
    args = ap.parse_args(argv)
    draw(Path(args.results_dir), Path(args.out_dir), args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
