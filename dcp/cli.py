"""Command line: ``dcp plan`` (plan one batch, print its statistics) and ``dcp demo``.

Planner names map to typed objects here, and only here (partitioner names: ``dcp.partition.named_partitioner``).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from dcp.bench.args import (add_mask_args, check_profile, default_partitioner_name, partitioner_help, plural,
                            profile_help)
from dcp.cluster import Cluster
from dcp.config import OBJECTIVES, PlannerConfig, SearchConfig
from dcp.errors import DcpError
from dcp.partition import PARTITIONER_NAMES, named_partitioner
from dcp.spec import BatchSpec

PLANNERS = ("dcp", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp", "torch_cp", "ulysses", "magi",
            "magi_dynamic")
SEARCH_PLANNERS = ("dcp_auto",)  # dcp's plan, or a static plan when that simulates faster
#: PlannerConfig's defaults, so that the flags never drift from the library
CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlannerConfig)
                   if f.default is not dataclasses.MISSING}
DATASET_FLAGS = ("dataset", "scale", "tokens", "batch_index")  # choose a synthetic batch (or a file's)


def make_planner(name: str, config: PlannerConfig):
    from dcp.planner.dcp_planner import DCPPlanner

    if name == "dcp":
        return DCPPlanner(config)
    if name == "dcp_auto":
        from dcp.baselines import MegatronDynCPPlanner, ZigzagPlanner
        from dcp.planner.search import AutoPlanner

        return AutoPlanner(config, baselines=(ZigzagPlanner(), MegatronDynCPPlanner()))
    from dcp.baselines import BASELINES

    if name not in BASELINES:
        raise DcpError(f"unknown planner {name!r}; one of {['dcp', *sorted(BASELINES)]}")
    return BASELINES[name]()


def _mask_from_args(args):
    from dcp.bench.args import masks_from_args

    return masks_from_args(args)[0].build()


def _lengths_from_args(args) -> list[tuple[int, np.ndarray]]:
    """``(index, lengths)`` of every batch to plan: the one of --lengths, every batch of a --lengths-file
    (or its --batch-index), or the --batch-index'th batch of the synthetic stream."""
    from dcp.data import load_length_batches, make_batches, parse_lengths_arg

    given = getattr(args, "given", set())
    if args.lengths:
        clash = sorted(given & set(DATASET_FLAGS))
        if clash:
            raise DcpError(f"--lengths gives the batch itself: {', '.join('--' + c.replace('_', '-') for c in clash)} "
                           f"would be ignored; drop {'it' if len(clash) == 1 else 'them'}")
        return [(0, parse_lengths_arg(args.lengths))]
    if args.lengths_file:
        clash = sorted(given & {"dataset", "scale", "tokens"})
        if clash:
            raise DcpError(f"--lengths-file gives the batches: {', '.join('--' + c for c in clash)} would be ignored")
        batches = load_length_batches(args.lengths_file)
        if "batch_index" not in given:  # every batch of the file, not silently the first
            return list(enumerate(batches))
        if not 0 <= args.batch_index < len(batches):
            raise DcpError(f"--batch-index {args.batch_index} out of range: the file holds "
                           f"{plural(len(batches), 'batch', 'batches')}")
        return [(args.batch_index, batches[args.batch_index])]
    return [(args.batch_index, make_batches(args.dataset, args.scale, tokens_per_batch=args.tokens,
                                            num_batches=args.batch_index + 1, seed=args.seed)[args.batch_index])]


class _Given(argparse.Action):
    """Store the value and remember that the flag was given, so that conflicting flags are refused."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def _time_budget(text: str):
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the time budget must be positive, got {text!r}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help (argparse's formatter), except where there is none."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_batch_args(p: argparse.ArgumentParser, dataset_default="ldc") -> None:
    src = p.add_argument_group("batch (--lengths, --lengths-file, or a synthetic --dataset batch)")
    which = src.add_mutually_exclusive_group()
    which.add_argument("--lengths", help="comma-separated sequence lengths, e.g. 8192,4096,1000")
    which.add_argument("--lengths-file", help="a .npy/.txt/.json file of lengths (see dcp.data.load_length_batches)")
    src.add_argument("--dataset", default=dataset_default, choices=("longalign", "ldc", "megatron_mock"), action=_Given,
                     help="synthetic length distribution (approximates the paper's datasets)")
    src.add_argument("--scale", type=float, default=1.0, action=_Given, help="multiply every sampled length")
    src.add_argument("--tokens", type=int, default=131072, action=_Given,
                     help="token budget per batch (batches are kept when at least 75%% full)")
    src.add_argument("--seed", type=int, default=0, help="sampling and partitioner seed")
    src.add_argument("--batch-index", type=int, default=0, action=_Given,
                     help="which batch of the synthetic stream; with --lengths-file, plan only this batch of the "
                          "file (without it: every batch)")
    m = p.add_argument_group("mask and heads")
    add_mask_args(m)
    m.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="a model whose layers differ: its window layers see the last W keys (itself included) "
                        "through --mask; dcp plans one placement for both kinds (a dcp.LayeredPlan)")
    m.add_argument("--layer-counts", default=None, metavar="FULL,SLIDING",
                   help="with --sliding-window: how many full and window layers the model has (default 1,1)")
    m.add_argument("--heads", type=int, default=8, help="query heads")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA: must divide --heads)")
    m.add_argument("--head-dim", type=int, default=128, help="size of one head")
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float64"),
                   help="element type (sets the bytes moved)")
    c = p.add_argument_group("cluster and planner")
    c.add_argument("--nodes", type=int, default=4, help="machines of the cluster")
    c.add_argument("--gpus-per-node", type=int, default=8, help="devices per machine")
    c.add_argument("--block-size", type=int, default=CONFIG_DEFAULTS["block_size"], help="tokens per token block")
    c.add_argument("--head-block-size", type=int, default=None,
                   help="query heads per head block (default: packings keep all heads together, the hypergraph "
                        "cuts them into two KV groups)")
    c.add_argument("--partitioner", default=default_partitioner_name(), choices=PARTITIONER_NAMES + ("mtkahypar",),
                   help=partitioner_help())
    c.add_argument("--objective", default="time", choices=OBJECTIVES,
                   help="what dcp's search minimizes: estimated time, or bytes within the tolerances (the paper's)")
    c.add_argument("--epsilon-intra", type=float, default=CONFIG_DEFAULTS["epsilon_intra"],
                   help="compute imbalance allowed between the GPUs of a node")
    c.add_argument("--epsilon-inter", type=float, default=CONFIG_DEFAULTS["epsilon_inter"],
                   help="compute imbalance allowed between nodes")
    c.add_argument("--epsilon-memory", type=float, default=CONFIG_DEFAULTS["epsilon_memory"],
                   help="memory budget: resident tokens per device <= (1 + this) x mean, for every candidate")
    c.add_argument("--max-tokens-per-device", type=int, default=None,
                   help="an explicit cap on resident tokens per device (the budget is the smaller of the two)")
    c.add_argument("--transient-budget", type=_transient_budget, default=CONFIG_DEFAULTS["transient_budget"],
                   metavar="FACTOR", help="peak transient buffer bytes per device <= FACTOR x the q/k/v/o bytes of the "
                                          "budget's tokens ('none': no limit)")
    c.add_argument("--strict-memory", action="store_true",
                   help="refuse (MemoryBudgetError) instead of warning when no plan fits the memory budget")
    c.add_argument("--time-budget", type=_time_budget, default=CONFIG_DEFAULTS["time_budget_s"], metavar="SECONDS",
                   help="partitioning time limit per plan ('none': no limit); past it the hypergraph candidate is "
                        "dropped (the packings stand) and the plan says so")
    c.add_argument("--profile", default="a100", help=profile_help())
    c.add_argument("--no-two-phase", action="store_true", help="no node-level relay/merge of transfers")


def _transient_budget(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _config(args) -> PlannerConfig:
    from dcp.cost import CostModel

    return PlannerConfig(block_size=args.block_size, head_block_size=args.head_block_size,
                         partitioner=named_partitioner(args.partitioner), epsilon_intra=args.epsilon_intra,
                         epsilon_inter=args.epsilon_inter, epsilon_memory=args.epsilon_memory, seed=args.seed,
                         max_tokens_per_device=args.max_tokens_per_device, transient_budget=args.transient_budget,
                         strict_memory=args.strict_memory,
                         two_phase=not args.no_two_phase, time_budget_s=args.time_budget,
                         cost_model=CostModel.named(check_profile(args.profile)),
                         search=SearchConfig(objective=args.objective))


def _spec(args, lengths: np.ndarray | None = None) -> BatchSpec:
    if lengths is None:
        lengths = _lengths_from_args(args)[0][1]
    mask = _mask_from_args(args)
    window = getattr(args, "sliding_window", None)
    counts = getattr(args, "layer_counts", None)
    if window is None:
        if counts is not None:
            raise DcpError("--layer-counts counts the full and window layers of --sliding-window: give both")
        return BatchSpec(lengths, mask, args.heads, args.kv_heads, args.head_dim, args.dtype)
    from dcp.integration.layer_kinds import LayerKind, windowed_mask

    try:
        full, sliding = (int(x) for x in (counts or "1,1").split(","))
        LayerKind(full), LayerKind(sliding, window)
    except ValueError as err:
        raise DcpError(f"--layer-counts FULL,SLIDING (positive ints) with --sliding-window W >= 1: {err}") from None
    windowed = [windowed_mask(mask, int(n), window, args.heads) for n in lengths]
    return BatchSpec(lengths, {"full": mask, "sliding": windowed}, args.heads, args.kv_heads, args.head_dim,
                     args.dtype, layers={"full": full, "sliding": sliding})


def cmd_plan(args) -> int:
    from dcp.bench.plan_report import plan_batches

    batches = _lengths_from_args(args)
    specs = [(index, _spec(args, lengths)) for index, lengths in batches]
    names = PLANNERS if args.planner == "all" else [args.planner]
    return plan_batches(specs, Cluster(args.nodes, args.gpus_per_node), _config(args), names, args,
                        make_planner)


def cmd_demo(args) -> int:
    from dcp.demo import run_demo

    config = _config(args)
    planners = {name: make_planner(name, config) for name in PLANNERS}
    return run_demo(_spec(args), Cluster(args.nodes, args.gpus_per_node), config, planners,
                    execute=not args.no_execute)


def main(argv=None) -> int:
    from dcp import __version__

    parser = argparse.ArgumentParser(prog="dcp", description="dynamic context parallelism planner",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"dcp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one batch and print what the plan achieves", formatter_class=HelpFormatter)
    _add_batch_args(p)
    p.add_argument("--planner", default="dcp", choices=(*PLANNERS, *SEARCH_PLANNERS, "all"),
                   help="dcp, a static baseline, dcp_auto (the fastest by simulation) or all of them")
    p.add_argument("--json", action="store_true",
                   help="print statistics, simulated times and the search's choice as JSON (one object per plan; "
                        "a list when there are several batches or planners)")
    p.add_argument("--output", help="write the (first) planner's plan bytes to this file (several batches: "
                                    "NAME.<batch>.EXT each)")
    p.add_argument("--trace", metavar="OUT.json",
                   help="write the (first) planner's simulated forward and backward as a Chrome trace "
                        "(chrome://tracing, ui.perfetto.dev; several batches: NAME.<batch>.json each)")
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("demo", help="plan a realistic batch with dcp and the baselines (and run one on CPU)",
                       formatter_class=HelpFormatter)
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
