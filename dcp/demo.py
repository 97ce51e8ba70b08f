"""``dcp demo``: plan one realistic batch with dcp and every baseline, say what each plan achieves and which
is best, then run a dcp plan of a small batch on 4 CPU processes (gloo) against dense attention.

The command line (``dcp.cli``) builds the batch, cluster, config and planners and calls ``run_demo``;
this module imports nothing from it.
"""
from __future__ import annotations

import sys
import warnings
from typing import Mapping, TextIO

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import InvalidConfigError
from dcp.report import STAT_COLUMNS, gigabytes, print_table, progress
from dcp.schedule.assemble import Planner
from dcp.spec import BatchSpec


def run_demo(spec: BatchSpec, cluster: Cluster, config: PlannerConfig, planners: Mapping[str, Planner],
             execute: bool = True, out: TextIO | None = None) -> int:
    """Plan ``spec`` on ``cluster`` with each of ``planners`` (dcp first), print the table and a verdict,
    and (``execute``) run the execution check. Returns 0, or 1 when the executed check mismatches."""
    from dcp.sim import simulate_both

    out = out or sys.stdout
    print(f"dcp demo: {spec.num_seqs} sequence{'s' if spec.num_seqs != 1 else ''} ({min(spec.seqlens):,}..{max(spec.seqlens):,} tokens, "
          f"{spec.total_tokens:,} in all), mask {spec.masks[0].name}, {spec.num_heads} q / {spec.num_kv_heads} kv "
          f"heads, head dim {spec.head_dim}, {spec.dtype}; cluster {cluster.nodes} nodes x "
          f"{cluster.gpus_per_node} GPUs; dcp block size {config.block_size}\n", file=out, flush=True)
    rows = []
    for name, planner in planners.items():
        with progress(f"planning with {name}"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                plan = planner.plan(spec, cluster)
            except InvalidConfigError as err:  # e.g. Ulysses with more devices than heads
                print(f"{name}: not applicable to this batch and cluster ({err})", file=out)
                continue
        with progress(f"simulating {name}'s plan"):
            fwd, bwd = simulate_both(plan, config.cost_model, record_events=False)
        row = plan.stats().to_dict()
        row["sim_fwd_bwd_ms"] = (fwd.makespan_s + bwd.makespan_s) * 1e3
        row["peak_buffer_MiB"] = max(row["peak_transient_bytes_forward"], row["peak_transient_bytes_backward"]) / 2**20
        rows.append(row)
    print_table(rows, columns=STAT_COLUMNS + ("max_resident_tokens", "peak_buffer_MiB", "sim_fwd_bwd_ms"), out=out)
    print(f"(sim_fwd_bwd_ms: SIMULATED forward + backward attention time of one layer, cost-model profile "
          f"'{config.cost_model.profile.name}' with assumed constants; every other column is exact. "
          f"memory_imbalance: the most resident tokens on one device over the mean (dcp's budget: "
          f"{1 + config.epsilon_memory:.2f}x); peak_buffer_MiB: the most bytes of received inputs and partial "
          f"outputs one device holds at once in one direction)\n", file=out)
    print("Verdict:", file=out)
    for line in verdict(rows, config.epsilon_memory):
        print(f"- {line}", file=out)
    if not execute:
        return 0
    from dcp.execute.demo_run import SMALL_TOKENS, run_small_batch

    with progress(f"execution check: planning and running a small batch ({SMALL_TOKENS:,}-token budget) on 4 CPU "
                  f"processes"):
        run = run_small_batch(world_size=4)
    print(f"- executed check: {run.summary()}.", file=out)
    print(f"  It ran a SMALL batch of {run.tokens:,} tokens, not the {spec.total_tokens:,}-token batch planned above: "
          f"that plan is for {cluster.n_devices} GPUs, and attention of that many tokens on 4 CPU processes would "
          f"take minutes per layer. The check shows that executing a dcp plan (transfers, tile kernels, merges, "
          f"backward) gives dense attention's result.", file=out)
    return 0 if run.ok else 1


def verdict(rows: list[dict], epsilon_memory: float = 0.1) -> list[str]:
    """Plain-words comparison of the planners' rows (``rows[0]`` is dcp's): who is fastest by simulated
    time and by how much, dcp's bytes against the baseline that moves the fewest, and the memory each
    holds (naming a faster baseline that holds more than dcp's budget, ``1 + epsilon_memory``)."""
    ours, others = rows[0], rows[1:]
    if not others:
        return [f"{ours['planner']} simulates {ours['sim_fwd_bwd_ms']:.2f} ms (no baseline to compare with)"]
    fastest = min(rows, key=lambda r: r["sim_fwd_bwd_ms"])
    best_base = min(others, key=lambda r: r["sim_fwd_bwd_ms"])
    if fastest is ours:
        speed = (f"fastest by simulated time: {ours['planner']}, {ours['sim_fwd_bwd_ms']:.2f} ms per layer, "
                 f"{best_base['sim_fwd_bwd_ms'] / ours['sim_fwd_bwd_ms']:.2f}x faster than the fastest baseline "
                 f"({best_base['planner']}, {best_base['sim_fwd_bwd_ms']:.2f} ms)")
    else:
        speed = (f"fastest by simulated time: {fastest['planner']}, {fastest['sim_fwd_bwd_ms']:.2f} ms per layer; "
                 f"{ours['planner']} simulates {ours['sim_fwd_bwd_ms']:.2f} ms "
                 f"({ours['sim_fwd_bwd_ms'] / fastest['sim_fwd_bwd_ms']:.2f}x slower)")
    fewest = min(others, key=lambda r: r["comm_bytes_total"])
    ratio = ours["comm_bytes_total"] / fewest["comm_bytes_total"] if fewest["comm_bytes_total"] else float("inf")
    bytes_line = (f"bytes: {ours['planner']} moves {gigabytes(ours['comm_bytes_total'])} per layer (forward + "
                  f"backward), {ratio:.2f}x the baseline that moves the fewest ({fewest['planner']}, "
                  f"{gigabytes(fewest['comm_bytes_total'])}), {gigabytes(ours['comm_bytes_inter_node'])} of it between "
                  f"nodes ({fewest['planner']}: {gigabytes(fewest['comm_bytes_inter_node'])}); compute imbalance "
                  f"{ours['compute_imbalance']:.3f} ({fewest['planner']}: {fewest['compute_imbalance']:.3f})")
    budget = 1 + epsilon_memory + 1e-9
    over = [r for r in others if r["memory_imbalance"] > budget and r["sim_fwd_bwd_ms"] < ours["sim_fwd_bwd_ms"]]
    memory_line = (f"memory: {ours['planner']} holds at most {ours['max_resident_tokens']:,} resident tokens on one "
                   f"device ({ours['memory_imbalance']:.2f}x the mean, budget {1 + epsilon_memory:.2f}x) and "
                   f"{ours['peak_buffer_MiB']:.1f} MiB of transient buffers")
    for r in over:
        memory_line += (f"; {r['planner']} is faster only by holding {r['memory_imbalance']:.2f}x the mean tokens "
                        f"({r['max_resident_tokens']:,}), above that budget")
    return [speed, bytes_line, memory_line]


__all__ = ["run_demo", "verdict"]
