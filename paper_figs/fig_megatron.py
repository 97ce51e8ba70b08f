"""Megatron mock figure from ``megatron_mock_summary.csv``: simulated attention fwd+bwd time of
megatron_dyncp, dcp and dcp_auto per cluster size (one panel per profile), ratio above dcp's bar.

    python paper_figs/fig_megatron.py [--results-dir benchmarks/results] [--out-dir paper_figs]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paper_figs._common import COLORS, num, pyplot, read_csv, run_figure, save  # noqa: E402


def draw(results: Path, out_dir: Path) -> list[Path]:
    plt = pyplot()
    path = Path(results) / "megatron_mock_summary.csv"
    if plt is None or not path.exists():
        print("matplotlib missing or no megatron_mock_summary.csv: nothing drawn")
        return []
    rows = read_csv(path)
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.5 * len(profiles), 3), squeeze=False)
    planners = ("megatron_dyncp", "dcp", "dcp_auto")
    for ax, prof in zip(axes[0], profiles):
        sel = sorted((r for r in rows if r["profile"] == prof), key=lambda r: num(r["n_gpus"]))
        width = 0.27
        for i, p in enumerate(planners):
            xs = [g + (i - 1) * width for g in range(len(sel))]
            ax.bar(xs, [num(r.get(f"{p}_iter_ms")) for r in sel], width, label=p, color=COLORS[p])
        for g, r in enumerate(sel):
            top = max(num(r.get(f"{p}_iter_ms"), 0) for p in planners)
            ax.text(g, top * 1.02, f"{num(r['dcp_speedup_iter']):.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([f"{r['nodes']}x{r['gpus_per_node']}" for r in sel])
        ax.set_xlabel("nodes x GPUs")
        ax.set_ylabel("simulated attention fwd+bwd (ms)")
        ax.set_title(f"Megatron mock workload, SIMULATED ({prof});\nlabel: megatron_dyncp / dcp", fontsize=8)
        ax.margins(y=0.15)
        ax.legend(loc="upper left")
    return [save(fig, out_dir / "megatron_mock.png")]


def main(argv=None) -> int:
    return run_figure(draw, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
