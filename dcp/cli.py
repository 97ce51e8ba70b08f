"""Command line: ``dcp plan`` (plan one batch, print its statistics) and ``dcp demo``.

Planner and partitioner names map to typed objects here, and only here.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import DcpError
from dcp.spec import BatchSpec

PARTITIONERS = ("mtkahypar", "kahypar", "greedy")
PLANNERS = ("dcp", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp")
SEARCH_PLANNERS = ("dcp_auto",)  # dcp at its best block size, or a static plan when that simulates faster
STAT_COLUMNS = ("planner", "n_devices", "n_tiles", "planning_time_s", "comm_bytes_total", "comm_bytes_inter_node",
                "max_device_comm_bytes", "compute_imbalance", "memory_imbalance", "valid")


def make_partitioner(name: str, threads: int = 0):
    from dcp.partition import GreedyPartitioner, KaHyParPartitioner, MtKaHyParPartitioner

    return {"mtkahypar": lambda: MtKaHyParPartitioner(threads=threads),
            "kahypar": KaHyParPartitioner, "greedy": GreedyPartitioner}[name]()


def make_planner(name: str, config: PlannerConfig):
    from dcp.planner import DCPPlanner

    if name == "dcp":
        return DCPPlanner(config)
    if name == "dcp_auto":
        from dcp.baselines import MegatronDynCPPlanner, ZigzagPlanner
        from dcp.search import AutoPlanner

        return AutoPlanner(config, baselines=(ZigzagPlanner(), MegatronDynCPPlanner()))
    from dcp.baselines import BASELINES

    if name not in BASELINES:
        raise DcpError(f"unknown planner {name!r}; one of {['dcp', *sorted(BASELINES)]}")
    return BASELINES[name]()


def _mask_from_args(args):
    from dcp.masks import from_cli

    params = {}
    for item in args.mask_param or ():
        if "=" not in item:
            raise DcpError(f"--mask-param takes key=value, got {item!r}")
        key, value = item.split("=", 1)
        params[key.strip().replace("-", "_")] = value.strip()
    return from_cli(args.mask, **params)


def _lengths_from_args(args) -> np.ndarray:
    from dcp.data import load_length_batches, make_batches, parse_lengths_arg

    if args.lengths:
        return parse_lengths_arg(args.lengths)
    if args.lengths_file:
        batches = load_length_batches(args.lengths_file)
        if not 0 <= args.batch_index < len(batches):
            raise DcpError(f"--batch-index {args.batch_index} out of range: the file holds {len(batches)} batches")
        return batches[args.batch_index]
    return make_batches(args.dataset, args.scale, tokens_per_batch=args.tokens, num_batches=args.batch_index + 1,
                        seed=args.seed)[args.batch_index]


def _add_batch_args(p: argparse.ArgumentParser, dataset_default="ldc") -> None:
    src = p.add_argument_group("batch")
    src.add_argument("--lengths", help="comma-separated sequence lengths, e.g. 8192,4096,1000")
    src.add_argument("--lengths-file", help="a .npy/.txt/.json file of lengths (see dcp.data.load_length_batches)")
    src.add_argument("--dataset", default=dataset_default, choices=("longalign", "ldc", "megatron_mock"),
                     help="synthetic length distribution (approximates the paper's datasets)")
    src.add_argument("--scale", type=float, default=1.0, help="multiply every sampled length")
    src.add_argument("--tokens", type=int, default=131072, help="tokens per batch")
    src.add_argument("--seed", type=int, default=0)
    src.add_argument("--batch-index", type=int, default=0, help="which batch of the stream/file")
    m = p.add_argument_group("mask and heads")
    m.add_argument("--mask", default="causal", help="causal, full, sliding_window, lambda, shared_question, "
                   "causal_blockwise, modality, prefix_lm, document")
    m.add_argument("--mask-param", action="append", metavar="KEY=VALUE", help="mask parameter, e.g. window=4096")
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=128)
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float64"))
    c = p.add_argument_group("cluster and planner")
    c.add_argument("--nodes", type=int, default=4)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--block-size", type=int, default=1024)
    c.add_argument("--head-block-size", type=int, default=None)
    c.add_argument("--partitioner", default="mtkahypar", choices=PARTITIONERS)
    c.add_argument("--epsilon-intra", type=float, default=0.045)
    c.add_argument("--epsilon-inter", type=float, default=0.045)
    c.add_argument("--profile", default="a100", help="cost-model GPU profile: a100, h100, h200 or a .json path")
    c.add_argument("--no-two-phase", action="store_true", help="no node-level relay/merge of transfers")


def _config(args) -> PlannerConfig:
    from dcp.cost import CostModel

    return PlannerConfig(block_size=args.block_size, head_block_size=args.head_block_size,
                         partitioner=make_partitioner(args.partitioner), epsilon_intra=args.epsilon_intra,
                         epsilon_inter=args.epsilon_inter, seed=args.seed, two_phase=not args.no_two_phase,
                         cost_model=CostModel.named(args.profile))


def _spec(args) -> BatchSpec:
    return BatchSpec(_lengths_from_args(args), _mask_from_args(args), args.heads, args.kv_heads, args.head_dim,
                     args.dtype)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 10**6:
        return f"{v / 1e6:.1f}M"
    return str(v)


def print_table(rows: list[dict], columns=STAT_COLUMNS, out=sys.stdout) -> None:
    cells = [[c for c in columns]] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def cmd_plan(args) -> int:
    spec = _spec(args)
    cluster = Cluster(args.nodes, args.gpus_per_node)
    config = _config(args)
    names = PLANNERS if args.planner == "all" else [args.planner]
    rows = []
    for name in names:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = make_planner(name, config).plan(spec, cluster)
        row = plan.stats().to_dict()
        row.update(num_seqs=spec.num_seqs, total_tokens=spec.total_tokens, mask=spec.masks[0].name,
                   block_size=args.block_size if name == "dcp" else None,
                   warnings=[str(w.message) for w in caught])
        rows.append(row)
        if args.output and name == names[0]:
            with open(args.output, "wb") as f:
                f.write(plan.to_bytes())
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2))
    else:
        print(f"batch: {spec.num_seqs} sequences, {spec.total_tokens} tokens, mask {spec.masks[0].name}; "
              f"cluster {cluster.nodes} x {cluster.gpus_per_node}")
        print_table(rows)
        for r in rows:
            for w in r["warnings"]:
                print(f"warning ({r['planner']}): {w}")
    return 0


def cmd_demo(args) -> int:
    from dcp.demo import run_demo

    return run_demo(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dcp", description="dynamic context parallelism planner")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one batch and print what the plan achieves")
    _add_batch_args(p)
    p.add_argument("--planner", default="dcp", choices=(*PLANNERS, *SEARCH_PLANNERS, "all"))
    p.add_argument("--json", action="store_true", help="print statistics as JSON")
    p.add_argument("--output", help="write the (first) plan's bytes to this file")
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("demo", help="plan a realistic batch with dcp and the baselines (and run one on CPU)")
    _add_batch_args(d)
    d.add_argument("--no-execute", action="store_true", help="plan only, do not run the CPU execution check")
    d.set_defaults(func=cmd_demo)
    from dcp.bench.cli import add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        started = time.perf_counter()
        code = args.func(args)
        if not getattr(args, "json", False):
            print(f"done in {time.perf_counter() - started:.1f} s")
        return code
    except DcpError as err:
        print(f"dcp: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
