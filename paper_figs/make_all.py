"""Regenerate every figure and table under paper_figs/ from the CSVs in benchmarks/results.

    python paper_figs/make_all.py [--results-dir benchmarks/results] [--out-dir paper_figs] [--tag _quick]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paper_figs import fig_dryrun, fig_e2e, fig_megatron, fig_micro, fig_scale, make_tables  # noqa: E402
from paper_figs._common import FIGS, RESULTS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--out-dir", default=str(FIGS))
    ap.add_argument("--profiles", default="a100,h100")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    res, out = Path(args.results_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profiles = [p for p in args.profiles.split(",") if p]
    fig_micro.draw(res, out, profiles, args.tag)
    fig_dryrun.draw(res, out)
    fig_megatron.draw(res, out)
    fig_scale.draw(res, out)
    if (res / "e2e_a100.csv").exists():
        fig_e2e.draw(res, out)
    tag_args = [] if args.tag is None else ["--tag", args.tag]
    return make_tables.main(["--results-dir", str(res), "--out", str(out / "speedups.md"),
                             "--profiles", args.profiles, *tag_args])


if __name__ == "__main__":
    sys.exit(main())
