"""Static baselines per sequence or grouped per device: does the representation change who wins?

A static baseline's plan can cut tokens into per-sequence chunks (one token block, unit, transfer row and
merge per chunk of every sequence: ``shards=False``, what the micro benchmark uses) or group each device's
chunks of every sequence into one block (``shards=True``, ``dcp.layout.pieces``: one message, one kernel call and
one merge per ring step, as ring attention implementations run). The compute model charges both the same
per-sequence sub-tiles; the grouped plan pays one merge and one message per step instead of one per
sequence chunk, but its relays carry every sequence as far as the farthest needs. This benchmark
simulates the micro grid's causal cells (first batch of each) under both and reports dcp's speedup over
the best of the five baselines with each representation (megatron_dyncp is per sequence by design).

    python benchmarks/bench_shards.py            # ~5 min on 2 cores -> benchmarks/results/baseline_shards.csv
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402

STATIC = ("ring", "zigzag", "te_a2a_p2p", "loongtrain")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="a100,h100")
    ap.add_argument("--datasets", default="longalign,ldc")
    ap.add_argument("--scales", default="0.5,1,2,4")
    ap.add_argument("--out", default=str(RESULTS / "baseline_shards.csv"))
    args = ap.parse_args(argv)
    import dcp
    from dcp.baselines import BASELINES, MegatronDynCPPlanner
    from dcp.cost import CostModel
    from dcp.data import make_batches
    from dcp.masks import CausalMask
    from dcp.sim import simulate_both

    cluster = dcp.Cluster(4, 8)
    mach, rev, rows = machine(), git_revision(), []
    for ds in args.datasets.split(","):
        for scale in (float(s) for s in args.scales.split(",")):
            lens = make_batches(ds, scale, tokens_per_batch=131072, num_batches=1, seed=0)[0]
            spec = dcp.BatchSpec(lens, CausalMask(), 8, 2, 128, "bfloat16")
            for prof in args.profiles.split(","):
                cost = CostModel.named(prof)
                ours = simulate_both(dcp.DCPPlanner(dcp.PlannerConfig(cost_model=cost)).plan(spec, cluster), cost)
                times = {("megatron_dyncp", "per_sequence"): simulate_both(MegatronDynCPPlanner().plan(spec, cluster), cost)}
                for name in STATIC:
                    for shards in (False, True):
                        plan = BASELINES[name](shards=shards).plan(spec, cluster)
                        times[name, "grouped" if shards else "per_sequence"] = simulate_both(plan, cost)
                for rep in ("per_sequence", "grouped"):
                    for i, direction in enumerate(("forward", "backward")):
                        cands = {k[0]: v[i].makespan_s for k, v in times.items()
                                 if k[1] == rep or k[0] == "megatron_dyncp"}
                        best = min(cands, key=cands.get)
                        rows.append({"dataset": ds, "scale": scale, "num_seqs": spec.num_seqs, "profile": prof,
                                     "representation": rep, "direction": direction,
                                     "dcp_ms": round(ours[i].makespan_s * 1e3, 4), "best_baseline": best,
                                     "best_ms": round(cands[best] * 1e3, 4),
                                     "speedup": round(cands[best] / ours[i].makespan_s, 4),
                                     **{f"{k}_ms": round(v * 1e3, 4) for k, v in cands.items()},
                                     "simulated": True, "machine": mach, "revision": rev})
                print(ds, scale, prof, [(r["representation"], r["direction"], r["speedup"]) for r in rows[-4:]],
                      flush=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
