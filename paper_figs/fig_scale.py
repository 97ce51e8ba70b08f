"""Scale plots from ``scale_cpu_*.csv`` (``benchmarks/bench_scale.py``): how planning and simulation
cost grow with the plan.

- ``scale_cost_vs_tiles.png``: plan+validate seconds (left) and simulated forward+backward seconds
  (right) against the plan's tile count, log-log, one point per case that finished, colored by planner,
  marker by device count (hollow: a grouped static baseline); the dotted slope-1 line (cost proportional to tiles) sits at the median cost
  per tile of the plans with >= 100K tiles.
- ``scale_cost_vs_devices.png``: the same two costs against the device count at 1,048,576 tokens;
  cases that ran out of time or memory are marked at the top of the panel with an x; grouped static
  baselines (``dcp.layout.pieces``) dashed and hollow. The points come from runs of several revisions
  (the 1,024-device rows were measured later than the 32/256-device grid): the marker names the revision,
  and a join between runs of different revisions is thin and dotted, so a step there may be the code's
  change, not the scale's. ``scale_cpu_1024_maxtiles.csv`` (an ablation of a search limit) is left out.

    python paper_figs/fig_scale.py [--results-dir benchmarks/results] [--out-dir paper_figs]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paper_figs._common import COLORS, PLANNERS, num, pyplot, read_csv, run_figure, save  # noqa: E402

MARKERS = {32: "o", 64: "v", 128: "^", 256: "s", 512: "D", 1024: "*"}
MARKERS_REV = ("o", "s", "D", "^", "v", "P")  # devices figure: marker = the revision (git) a run measured
COSTS = (("plan_s", "plan + validate (s)"), ("sim_s", "simulate fwd+bwd (s)"))


def _rows(results: Path) -> list[dict]:
    rows = []
    for path in sorted(Path(results).glob("scale_cpu*.csv")):
        for r in read_csv(path):
            r["sim_s"] = num(r.get("sim_for_s")) + num(r.get("sim_bac_s"))
            r["_file"] = path.name
            rows.append(r)
    return rows


def draw(results: Path, out_dir: Path) -> list[Path]:
    rows = _rows(results)
    plt = pyplot()
    if plt is None or not rows:
        print("no scale_cpu*.csv or no matplotlib: no scale figures drawn")
        return []
    ok = [r for r in rows if r["status"] == "ok"]
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, (key, label) in zip(axes, COSTS):
        for r in ok:
            c = COLORS.get(r["planner"], "k")
            hollow = {"facecolors": "none", "edgecolors": c} if r.get("grouped") == "True" else {"color": c}
            ax.scatter(num(r["n_tiles"]), num(r[key]), s=18, marker=MARKERS.get(int(r["devices"]), "x"), **hollow)
        xs = [num(r["n_tiles"]) for r in ok]
        lo, hi = min(xs), max(xs)
        # slope-1 line at the median cost per tile of the big plans (small ones are fixed-cost bound)
        per = sorted(num(r[key]) / num(r["n_tiles"]) for r in ok if num(r["n_tiles"]) >= 1e5) or [1e-6]
        ref = per[len(per) // 2]
        ax.plot([lo, hi], [ref * lo, ref * hi], ":", color="0.5", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tiles in the plan")
        ax.set_ylabel(label)
    for p in PLANNERS:
        if any(r["planner"] == p for r in ok):
            axes[0].scatter([], [], color=COLORS[p], label=p)
    for d, m in MARKERS.items():
        if any(int(r["devices"]) == d for r in ok):
            axes[0].scatter([], [], color="0.4", marker=m, label=f"{d} devices")
    axes[0].set_title("Planning cost vs plan size (measured, CPU)")
    axes[1].set_title("Simulation cost vs plan size (measured, CPU)")
    written.append(save(fig, Path(out_dir) / "scale_cost_vs_tiles.png", legend_ax=axes[0], ncol=6))
    # the devices figure: default configurations only (the _maxtiles file is an ablation of
    # SearchConfig.hypergraph_max_tiles, not dcp's default plan)
    big = [r for r in rows if int(r["tokens"]) == 1048576 and r["batch"] == "0" and "maxtiles" not in r["_file"]]
    revisions = list(dict.fromkeys(r.get("git", "") for r in big))  # first seen, files in name order
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, (key, label) in zip(axes, COSTS):
        top = max([num(r[key]) for r in big if r["status"] == "ok"] + [1.0]) * 2
        for p, grouped in ((p, g) for p in PLANNERS for g in (False, True)):
            # grouped static baselines (each device's chunks of every sequence one block): dashed
            sel = sorted((r for r in big if r["planner"] == p and (r.get("grouped") == "True") == grouped),
                         key=lambda r: (int(r["devices"]), revisions.index(r.get("git", ""))))
            pts = [(int(r["devices"]), num(r[key]), r.get("git", "")) for r in sel if r["status"] == "ok"]
            style = "--" if grouped else "-"
            for (x0, y0, g0), (x1, y1, g1) in zip(pts, pts[1:]):
                # runs of one revision are joined as usual; a join across revisions is dotted and thin
                ax.plot([x0, x1], [y0, y1], style if g0 == g1 else ":", lw=1.5 if g0 == g1 else 0.8,
                        color=COLORS[p])
            for x, y, g in pts:
                ax.plot([x], [y], MARKERS_REV[revisions.index(g) % len(MARKERS_REV)], ms=4, color=COLORS[p],
                        mfc="none" if grouped else COLORS[p])
            if pts:
                ax.plot([], [], style, color=COLORS[p], label=f"{p} (grouped)" if grouped else p)
            failed = [int(r["devices"]) for r in sel if r["status"] != "ok"]
            if failed:
                ax.scatter(failed, [top] * len(failed), marker="x", color=COLORS[p])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices (1,048,576 tokens; x: out of time or memory)")
        ax.set_ylabel(label)
    for i, g in enumerate(revisions):
        axes[0].plot([], [], MARKERS_REV[i % len(MARKERS_REV)], color="0.4", ms=4, label=f"revision {g}")
    axes[0].plot([], [], ":", color="0.4", lw=0.8, label="dotted: joins runs of different revisions")
    axes[0].set_title("Planning cost vs devices (measured, CPU)")
    axes[1].set_title("Simulation cost vs devices (measured, CPU)")
    written.append(save(fig, Path(out_dir) / "scale_cost_vs_devices.png", legend_ax=axes[0], ncol=4))
    return written


def main(argv=None) -> int:
    return run_figure(draw, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
