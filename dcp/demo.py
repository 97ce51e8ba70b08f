"""``dcp demo``: plan a realistic batch with dcp and every baseline, print what each achieves, then run
a dcp plan on 4 CPU processes (gloo) and report its error against dense attention."""
from __future__ import annotations

import time
import warnings

from dcp.cluster import Cluster


def run_demo(args) -> int:
    from dcp.cli import PLANNERS, _config, _spec, make_planner, print_table

    spec = _spec(args)
    cluster = Cluster(args.nodes, args.gpus_per_node)
    config = _config(args)
    print(f"dcp demo: {spec.num_seqs} sequences ({min(spec.seqlens)}..{max(spec.seqlens)} tokens, "
          f"{spec.total_tokens} in all), mask {spec.masks[0].name}, {spec.num_heads} q / {spec.num_kv_heads} kv "
          f"heads, head dim {spec.head_dim}, {spec.dtype}; cluster {cluster.nodes} nodes x "
          f"{cluster.gpus_per_node} GPUs; dcp block size {config.block_size}\n")
    from dcp.cli import STAT_COLUMNS
    from dcp.sim import simulate_both

    rows = []
    for name in PLANNERS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_planner(name, config).plan(spec, cluster)
        row = plan.stats().to_dict()
        fwd, bwd = simulate_both(plan, config.cost_model, record_events=False)
        row["sim_fwd_bwd_ms"] = (fwd.makespan_s + bwd.makespan_s) * 1e3
        rows.append(row)
    print_table(rows, columns=STAT_COLUMNS + ("sim_fwd_bwd_ms",))
    print(f"(sim_fwd_bwd_ms: SIMULATED forward + backward attention time, cost-model profile "
          f"'{config.cost_model.profile.name}' with assumed constants; every other column is exact)")
    dcp_row = rows[0]
    best = min(rows[1:], key=lambda r: r["comm_bytes_total"])
    best_inter = min(rows[1:], key=lambda r: r["comm_bytes_inter_node"])
    fastest = min(rows[1:], key=lambda r: r["sim_fwd_bwd_ms"])
    print(f"\nsimulated: dcp {dcp_row['sim_fwd_bwd_ms']:.2f} ms vs the fastest baseline ({fastest['planner']}) "
          f"{fastest['sim_fwd_bwd_ms']:.2f} ms per attention layer (forward + backward).")
    print(f"dcp communicates {dcp_row['comm_bytes_total'] / best['comm_bytes_total']:.2f}x the bytes of the best "
          f"baseline ({best['planner']}) and {_ratio(dcp_row['comm_bytes_inter_node'], best_inter['comm_bytes_inter_node'])} "
          f"its inter-node bytes ({best_inter['planner']}), at compute imbalance "
          f"{dcp_row['compute_imbalance']:.3f} (best baseline {best['compute_imbalance']:.3f}).")
    if not args.no_execute:
        return _execute_check()
    return 0


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if b else ("0 (equal)" if a == 0 else "more than the 0 of")


def _execute_check() -> int:
    try:
        from dcp.execute.demo_run import run_small_batch
    except ImportError:
        print("\n(execution check skipped: dcp.execute is not installed)")
        return 0
    started = time.perf_counter()
    report = run_small_batch(world_size=4)
    print(f"\nexecuted a dcp plan on 4 CPU processes (gloo) in {time.perf_counter() - started:.1f} s: {report}")
    return 0
