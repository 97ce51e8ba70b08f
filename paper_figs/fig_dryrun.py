"""The four dry-run plots, from ``dryrun_block_size.csv``, ``dryrun_sparsity.csv``, ``dryrun_epsilon.csv``.

- ``dryrun_comm_vs_block.png``: communication (total, and inter-node dashed) vs block size;
- ``dryrun_planning_vs_block.png``: planning time (measured) vs block size, with the simulated
  iteration time (attention fwd+bwd) for scale;
- ``dryrun_comm_vs_sparsity.png``: communication vs unmasked fraction relative to causal (lambda windows);
- ``dryrun_comm_vs_epsilon.png``: communication vs imbalance tolerance epsilon.

One line per (dataset, mask), mean over batches.

    python paper_figs/fig_dryrun.py [--results-dir benchmarks/results] [--out-dir paper_figs]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paper_figs._common import group_mean, num, pyplot, read_csv, run_figure, save  # noqa: E402


def _lines(ax, rows, x_key, y_fn, series_fn, style="-", label_suffix="", marker="o"):
    keys = list(dict.fromkeys(series_fn(r) for r in rows))
    for k in keys:
        sel = [r for r in rows if series_fn(r) == k]
        pts = group_mean(sel, lambda r: num(r[x_key]), y_fn)
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], style, marker=marker, ms=3, label=f"{k}{label_suffix}")


def _ticks(ax, rows, key, fmt="{:g}") -> None:
    """Ticks exactly at the swept values, plainly labelled (log axes otherwise print 2x10^-2)."""
    xs = sorted({num(r[key]) for r in rows})
    ax.set_xticks(xs)
    ax.set_xticklabels([fmt.format(x) for x in xs])
    ax.minorticks_off()


def draw(results: Path, out_dir: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no figures drawn (pip install matplotlib)")
        return []
    written = []
    gb = lambda key: (lambda r: num(r[key]) / 1e9)  # noqa: E731
    path = Path(results) / "dryrun_block_size.csv"
    if path.exists():
        rows = read_csv(path)
        series = lambda r: f"{r['dataset']}/{r['mask']}"  # noqa: E731
        fig, ax = plt.subplots(figsize=(5, 4))
        _lines(ax, rows, "block_size", gb("comm_bytes_total"), series, "-", " total")
        _lines(ax, rows, "block_size", gb("comm_bytes_inter_node"), series, "--", " inter-node", "s")
        ax.set_xscale("log", base=2)
        _ticks(ax, rows, "block_size")
        ax.set_xlabel("block size B (tokens)")
        ax.set_ylabel("communication, fwd+bwd (GB)")
        ax.set_title("Communication vs block size (SIMULATED plan bytes)")
        written.append(save(fig, out_dir / "dryrun_comm_vs_block.png", legend_ax=ax, ncol=2))
        fig, ax = plt.subplots(figsize=(5, 4))
        _lines(ax, rows, "block_size", lambda r: num(r["planning_time_s"]), series, "-", " planning")
        _lines(ax, rows, "block_size", lambda r: num(r["sim_iter_ms"]) / 1e3, series, ":", " attn (sim.)", "x")
        ax.set_xscale("log", base=2)
        _ticks(ax, rows, "block_size")
        ax.set_yscale("log")
        ax.set_xlabel("block size B (tokens)")
        ax.set_ylabel("seconds")
        ax.set_title("Planning time (measured, this CPU) vs block size;\n"
                     "dotted: simulated attention fwd+bwd", fontsize=8)
        written.append(save(fig, out_dir / "dryrun_planning_vs_block.png", legend_ax=ax, ncol=2))
    path = Path(results) / "dryrun_sparsity.csv"
    if path.exists():
        rows = read_csv(path)
        fig, ax = plt.subplots(figsize=(5, 4))
        # x differs per batch: average y per (dataset, window) and x likewise
        for ds in dict.fromkeys(r["dataset"] for r in rows):
            sel = [r for r in rows if r["dataset"] == ds]
            xs = group_mean(sel, lambda r: int(num(r["window"])), lambda r: num(r["unmasked_frac_vs_causal"]))
            ys = group_mean(sel, lambda r: int(num(r["window"])), gb("comm_bytes_total"))
            yi = group_mean(sel, lambda r: int(num(r["window"])), gb("comm_bytes_inter_node"))
            ws = sorted(xs)
            ax.plot([xs[w] for w in ws], [ys[w] for w in ws], "-o", ms=3, label=f"{ds} total")
            ax.plot([xs[w] for w in ws], [yi[w] for w in ws], "--s", ms=3, label=f"{ds} inter-node")
        ax.set_xlabel("unmasked fraction relative to causal")
        ax.set_ylabel("communication, fwd+bwd (GB)")
        ax.set_title("Communication vs mask sparsity (lambda windows)")
        written.append(save(fig, out_dir / "dryrun_comm_vs_sparsity.png", legend_ax=ax, ncol=2))
    path = Path(results) / "dryrun_epsilon.csv"
    if path.exists():
        rows = read_csv(path)
        series = lambda r: f"{r['dataset']}/{r['mask']}"  # noqa: E731
        fig, ax = plt.subplots(figsize=(5, 4))
        _lines(ax, rows, "epsilon_inter", gb("comm_bytes_total"), series, "-", " total")
        _lines(ax, rows, "epsilon_inter", gb("comm_bytes_inter_node"), series, "--", " inter-node", "s")
        ax.set_xscale("log")
        _ticks(ax, rows, "epsilon_inter")
        ax.set_xlabel("imbalance tolerance epsilon (inter = intra)")
        ax.set_ylabel("communication, fwd+bwd (GB)")
        ax.set_title("Communication vs imbalance tolerance")
        written.append(save(fig, out_dir / "dryrun_comm_vs_epsilon.png", legend_ax=ax, ncol=2))
    return written


def main(argv=None) -> int:
    return run_figure(draw, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
