"""Scale benchmark: planning, validation, serialization and simulation from 32 to 1,024 devices.

Cases (issue 14's targets; LDC x1 lengths, causal mask, 8 query / 2 KV heads, head dim 128, bf16,
8 GPUs per node): dcp at B = 4096 and 1024 and the five baselines on one 1,048,576-token batch over
32 ... 1,024 devices; the paper configuration (131,072 tokens, 32 devices, dcp at B = 1024) over
several batches. Every case runs in its own process, under a wall-clock limit and an address-space
limit, so a case that does not fit is recorded as ``timeout`` / ``memory`` instead of stopping the run.

Per case: ``plan_s`` (spec -> validated forward + backward programs, the planner's own timing,
validation included), ``validate_s`` (one more validation alone), ``peak_rss_gib`` (the process's
peak resident memory after planning, interpreter and libraries included; ``base_rss_gib`` is the
peak before planning), ``child_peak_rss_gib`` (the partitioner's worker process, dcp only), plan bytes and
whether ``from_bytes(to_bytes())`` gives the same bytes, and the simulated forward + backward (seconds
to simulate and the simulated makespans). ``grouped``: the static baseline grouped each device's
chunks of every sequence into one token block (``dcp.layout.pieces``; automatic above
``dcp.baselines.common.SHARD_TILES`` per-sequence tiles), ``n_pieces`` the per-sequence blocks.

    python benchmarks/bench_scale.py                       # the target table (long: minutes per case)
    python benchmarks/bench_scale.py --quick               # 1M tokens at 32 and 64 devices only
    python benchmarks/bench_scale.py --planners zigzag --devices 256 --tokens 131072
Writes benchmarks/results/scale_cpu.csv (one row per case; ``machine`` names the machine).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402

PLANNERS = ("dcp", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp")
GIB = 1 << 30


def _rss_gib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss * 1024 / GIB  # ru_maxrss is in KiB on Linux


def _children_hwm_gib() -> float:
    """Peak resident memory of this process's live children (the partitioner's persistent worker;
    a forked child's peak counts the pages it shares with this process), from /proc (Linux)."""
    total = 0
    for tasks in Path("/proc/self/task").glob("*/children"):
        for pid in tasks.read_text().split():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
    return total / GIB


def run_case(case: dict) -> dict:
    """Plan, validate, serialize and simulate one case in this process; returns the row's numbers."""
    import dcp
    from dcp.baselines import BASELINES
    from dcp.cost import CostModel
    from dcp.data import make_batches
    from dcp.ir.validate import validate
    from dcp.masks import CausalMask
    from dcp.sim import simulate

    lens = make_batches("ldc", 1.0, tokens_per_batch=case["tokens"], num_batches=case["batch"] + 1,
                        seed=0)[case["batch"]]
    spec = dcp.BatchSpec(lens, CausalMask(), 8, 2, 128, "bfloat16")
    cluster = dcp.Cluster(case["devices"] // 8, 8)
    name = case["planner"]
    if name == "dcp":
        search = dcp.SearchConfig() if case.get("max_tiles") is None else \
            dcp.SearchConfig(hypergraph_max_tiles=case["max_tiles"])
        planner = dcp.DCPPlanner(dcp.PlannerConfig(block_size=case["block_size"], search=search))
    else:
        planner = BASELINES[name]()
    out = {"num_seqs": spec.num_seqs, "total_tokens": spec.total_tokens, "base_rss_gib": round(_rss_gib(), 3)}
    started = time.perf_counter()
    plan = planner.plan(spec, cluster)
    out["plan_s"] = round(time.perf_counter() - started, 3)
    out["peak_rss_gib"] = round(_rss_gib(), 3)
    out["child_peak_rss_gib"] = round(max(_rss_gib(resource.RUSAGE_CHILDREN), _children_hwm_gib()), 3)
    t = time.perf_counter()
    validate(plan)
    out["validate_s"] = round(time.perf_counter() - t, 3)
    stats = plan.stats()
    # grouped static baselines (dcp.pieces): each device's chunks of every sequence form one token block
    out.update(grouped=plan.layout.grouped, n_pieces=(plan.layout.pieces or plan.layout).n_token_blocks)
    out.update(n_tiles=stats.n_tiles, compute_imbalance=round(stats.compute_imbalance, 4),
               comm_bytes_total=stats.comm_bytes_total,
               n_transfers=sum(int(plan.columns(d).transfers.shape[0]) for d in ("forward", "backward")))
    t = time.perf_counter()
    blob = plan.to_bytes()
    out["serialize_s"] = round(time.perf_counter() - t, 3)
    out["plan_mib"] = round(len(blob) / (1 << 20), 3)
    out["roundtrip_exact"] = dcp.Plan.from_bytes(blob).to_bytes() == blob
    del blob
    cost = CostModel.named("a100")
    for direction in ("forward", "backward"):
        t = time.perf_counter()
        res = simulate(plan, cost, direction, record_events=False)
        out[f"sim_{direction[:3]}_s"] = round(time.perf_counter() - t, 3)
        out[f"sim_{direction[:3]}_ms"] = round(res.makespan_s * 1e3, 4)
    out["peak_rss_all_gib"] = round(_rss_gib(), 3)
    return out


def _limit_memory(gib: float):
    def apply():
        lim = int(gib * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    return apply


def run_isolated(case: dict, timeout_s: float, mem_gib: float) -> dict:
    """``run_case`` in a fresh interpreter; ``status`` is ok, timeout, memory or error."""
    cmd = [sys.executable, __file__, "--one", json.dumps(case)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=_limit_memory(mem_gib))
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_s": round(time.perf_counter() - started, 1)}
    wall = round(time.perf_counter() - started, 1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return {"status": "ok", "wall_s": wall, **json.loads(lines[-1])}
    err = proc.stderr.strip().splitlines()[-1:] if proc.stderr else [f"exit {proc.returncode}"]
    status = "memory" if any("MemoryError" in e or "bad_alloc" in e for e in err) or proc.returncode == -9 else "error"
    return {"status": status, "wall_s": wall, "error": err[0][:200] if err else ""}


def cases(args) -> list[dict]:
    out = []
    if args.quick:
        grid = [(1 << 20, d) for d in (32, 64)]
    else:
        grid = [(int(t), int(d)) for t in args.tokens.split(",") for d in args.devices.split(",")]
    for tokens, devices in grid:
        for name in args.planners.split(","):
            blocks = [int(b) for b in args.blocks.split(",")] if name == "dcp" else [None]
            for b in blocks:
                out.append({"planner": name, "tokens": tokens, "devices": devices, "block_size": b, "batch": 0,
                            **({"max_tiles": args.max_tiles} if name == "dcp" and args.max_tiles else {})})
    if args.paper_batches:
        out += [{"planner": "dcp", "tokens": 131072, "devices": 32, "block_size": 1024, "batch": i}
                for i in range(args.paper_batches)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--tokens", default="1048576")
    ap.add_argument("--devices", default="1024")
    ap.add_argument("--blocks", default="4096,1024", help="dcp block sizes")
    ap.add_argument("--max-tiles", type=int, default=None,
                    help="dcp's SearchConfig.hypergraph_max_tiles (default: the library's)")
    ap.add_argument("--paper-batches", type=int, default=5,
                    help="also time dcp on this many 131,072-token batches over 32 devices (B = 1024)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    ap.add_argument("--mem-gib", type=float, default=14.0, help="address-space limit per case")
    ap.add_argument("--out", default=str(RESULTS / "scale_cpu.csv"))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_case(json.loads(args.one))), flush=True)
        return 0
    mach, rev = machine(), git_revision()
    rows = []
    for case in cases(args):
        row = {**case, **run_isolated(case, args.timeout, args.mem_gib), "machine": mach, "git": rev}
        rows.append(row)
        print(json.dumps({k: row[k] for k in row if k not in ("machine",)}), flush=True)
        write_csv(args.out, rows)  # after every case, so a stopped run keeps what it measured
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
