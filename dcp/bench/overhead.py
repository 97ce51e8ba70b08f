"""``dcp bench overhead``: the executor's own host cost per device and direction, measured.

Every speedup the simulated benchmarks report charges a few microseconds per kernel and nothing for the
Python that drives it. This benchmark measures that Python: each device's ``DeviceRunner``
(``dcp.execute.local``) runs its program with the tile kernels, merges, sums and the transport replaced by
no-ops (``dcp.execute.noop``) on tensors of PyTorch's ``meta`` device (shapes and dtypes, no data), so
what is timed is the executor's Python and the dispatch of its views, copies and allocations. Any
data-dependent host operation (``.item()``, ``.tolist()`` of a tensor) would raise on ``meta``.

Times are this thread's CPU time (``us_*``; on an idle machine the same as the wall clock, which
``wall_us_*`` reports beside it), with the garbage collector paused as ``timeit`` does (``gc_paused``),
and a count that no load disturbs: ``torch_calls``, the PyTorch calls (ops, views, allocations,
attribute reads) of one step, counted by a ``TorchFunctionMode``.

Per (case, direction) and item, over every device (each device the median of ``--repeats`` steps):
- ``prepare``: what a rank pays once per plan (amortized over a model's layers): per-plan tables,
  its compiled program, buffer layout and buffers, from a cold copy of the plan (as a rank that
  receives a plan gets it: ``Plan.from_bytes``) up to a runner ready to run; direction ``both``: both
  directions of one rank from one cold copy;
- ``setup``: a warm runner's construction per step (views of the home rows, staged rows);
- ``launch``, ``wait``, ``compute``, ``reduce``: the instructions, count = the plan's instructions of
  that kind on the device (``dcp.ir.program``), time = their total, ``us_per_instruction`` = time / count;
- ``finish``: assembling the local results; ``step``: one direction on one device after preparation
  (setup + instructions + finish, timed uninstrumented in runs of their own), ``us_per_instruction`` =
  step time / all instructions.

A reduce *step* merges all the partials that arrived in one round (one grouped sum per layer), so a
``reduce`` row's count (the plan's Reduce instructions) can exceed the steps that ran them (the per-device
CSV counts both: ``n_reduce`` and ``n_reduce_steps``).

Columns ``us_median`` (median over devices) and ``us_worst`` (the slowest device, ``worst_device``); the
targets (``target_us``: 1 ms per step, 15 us per instruction, 30 ms of preparation per rank for both
directions) are checked in ``meets_target``. Cases: the paper's micro-benchmark batches (131,072 tokens,
4 x 8 devices, 8 query / 2 KV heads, head dim 128, bf16; LDC x1 and LongAlign x4, causal and lambda)
and a Megatron mock batch on 8 x 8 devices (16 / 16 heads); ``--quick``: one small batch on 4 devices.
Writes ``overhead_cpu.csv`` to ``--out-dir`` and prints the table; timings are of the machine named in
each row, under the load average recorded beside them. Not measured: the kernels' own host work (their
argument checks, a varlen schedule lookup) and the transport's (``DistComm``'s ``batch_isend_irecv``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dcp.bench.common import DEFAULT_OUT, DcpOptions, dcp_config, fmt_table, git_revision, machine, read_csv, write_csv

ITEMS = ("setup", "launch", "wait", "compute", "reduce", "finish")
KINDS = ("launch", "wait", "compute", "reduce")
#: per device and direction: the instructions of each kind, and what the host model counts besides
COUNTS = KINDS + ("moving_rounds", "messages", "reduce_steps")
TARGET_STEP_US = 1000.0
TARGET_INSTRUCTION_US = 15.0
TARGET_PREPARE_US = 30000.0
CSV_NAME = "overhead_cpu.csv"
DEVICES_CSV_NAME = "overhead_devices_cpu.csv"
FIT_NAME = "host_fit_cpu.json"


@dataclasses.dataclass(frozen=True)
class OverheadCase:
    name: str
    dataset: str
    scale: float = 1.0
    mask: str = "causal"
    nodes: int = 4
    gpus_per_node: int = 8
    tokens: int = 131072
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bfloat16"
    batch: int = 0
    dcp: DcpOptions = DcpOptions()


CASES = (
    OverheadCase("ldc_x1_causal", "ldc", 1.0, "causal"),
    OverheadCase("ldc_x1_lambda", "ldc", 1.0, "lambda"),
    OverheadCase("longalign_x4_causal", "longalign", 4.0, "causal"),
    OverheadCase("longalign_x4_lambda", "longalign", 4.0, "lambda"),
    OverheadCase("megatron_mock_8x8", "megatron_mock", 1.0, "causal", 8, 8, 2048 * 64, 16, 16),
)
QUICK_CASE = OverheadCase("quick_ldc_1x4", "ldc", 1.0, "causal", 1, 4, 16384,
                          dcp=DcpOptions(partitioner="greedy", block_size=512))


def case_plan(case: OverheadCase):
    """The plan of a case: dcp.plan with the benchmarks' configuration (a100 cost model)."""
    import dcp
    from dcp.bench.micro import make_mask
    from dcp.cluster import Cluster
    from dcp.data import make_batches
    from dcp.spec import BatchSpec

    lens = make_batches(case.dataset, case.scale, tokens_per_batch=case.tokens, num_batches=case.batch + 1,
                        seed=0)[case.batch]
    spec = BatchSpec(lens, make_mask(case.mask), case.heads, case.kv_heads, case.head_dim, case.dtype)
    return dcp.plan(spec, Cluster(case.nodes, case.gpus_per_node), dcp_config("a100", case.dcp))


def ir_counts(plan, direction: str, device: int) -> dict[str, int]:
    """The plan's instructions of each kind on ``device`` (its canonical stream, ``dcp.ir.program``; of the
    plan the executors run: a grouped plan's expansion over its pieces), and what the simulator's host model
    counts (``GPUProfile.host_*``): ``moving_rounds`` (rounds in which the device sends or receives),
    ``messages`` (per round, the peers it sends to plus the peers it receives from) and ``reduce_steps``
    (runs of consecutive Reduce instructions: the executor merges each run as one step)."""
    from dcp.execute.tables import plan_tables
    from dcp.ir.program import DST, SRC

    counts = dict.fromkeys(COUNTS, 0)
    prev = None
    for op in plan_tables(plan).plan.index(direction).stream(device):
        counts[op[0]] += 1
        counts["reduce_steps"] += op[0] == "reduce" and prev != "reduce"
        prev = op[0]
        if op[0] == "launch":
            sends, recvs = op[2], op[3]
            peers = np.unique(sends[:, DST]).size + np.unique(recvs[:, SRC]).size
            counts["messages"] += peers
            counts["moving_rounds"] += peers > 0
    return counts


def _clock_cost(clock, n: int = 200) -> float:
    """Seconds one call of ``clock`` adds to an interval it measures (the median of back-to-back calls)."""
    d = []
    for _ in range(n):
        a = clock()
        d.append(clock() - a)
    return statistics.median(d)


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector paused (as ``timeit`` does while timing): a collection that happens to
    fall in a timed region costs what every object of the process costs to scan (with torch loaded, far
    more than a step), not what the executor does."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def time_step(plan, direction: str, device: int, home, kernels, scale: float, per_op: bool = True) -> dict:
    """One step of ``device`` (a warm runner: tables and buffers prepared): ``{item: (cpu s, wall s)}``.

    ``per_op``: each item timed on its own (this thread's CPU time and wall time per instruction, less
    what the clocks themselves cost), else only ``step``, uninstrumented (setup, ``run()``, finish)."""
    from dcp.execute.local import DeviceRunner
    from dcp.execute.noop import NoopComm

    cpu, wall = time.thread_time, time.perf_counter
    if not per_op:
        with gc_paused():
            c0, w0 = cpu(), wall()
            run = DeviceRunner(plan, device, direction, home, NoopComm(), kernels, scale)
            run.run()
            res = run.finish_forward() if direction == "forward" else run.finish_backward()
            out = {"step": (cpu() - c0, wall() - w0)}
        assert all(t.device.type == home[0].device.type for t in res)
        return out
    cc, wc = _CLOCK_COST.get("cpu"), _CLOCK_COST.get("wall")
    if cc is None:
        cc = _CLOCK_COST["cpu"] = _clock_cost(cpu)
        wc = _CLOCK_COST["wall"] = _clock_cost(wall)
    out = {k: [0.0, 0.0] for k in ITEMS}

    def timed(item, fn):
        c, w = cpu(), wall()
        got = fn()
        w2, c2 = wall(), cpu()
        out[item][0] += max(c2 - c - cc, 0.0)
        out[item][1] += max(w2 - w - wc, 0.0)
        return got

    with gc_paused():
        run = timed("setup", lambda: DeviceRunner(plan, device, direction, home, NoopComm(), kernels, scale))
        for st in run.steps:
            timed(st.code, lambda: run.step(st))
        res = timed("finish", run.finish_forward if direction == "forward" else run.finish_backward)
    assert all(t.device.type == home[0].device.type for t in res)
    return {k: tuple(v) for k, v in out.items()}


_CLOCK_COST: dict = {}


def time_prepare(data: bytes, directions: tuple, device: int, homes: dict, kernels, scale: float) -> tuple:
    """(CPU s, wall s) from a cold copy of the plan (``Plan.from_bytes``) to ready runners of ``directions``."""
    from dcp.execute.local import DeviceRunner
    from dcp.execute.noop import NoopComm
    from dcp.ir.plan import Plan

    cold = Plan.from_bytes(data)
    with gc_paused():
        c0, w0 = time.thread_time(), time.perf_counter()
        for direction in directions:
            DeviceRunner(cold, device, direction, homes[direction], NoopComm(), kernels, scale).release()
        return time.thread_time() - c0, time.perf_counter() - w0


def count_torch_calls(plan, direction: str, device: int, home, kernels, scale: float) -> int:
    """PyTorch calls of one (uninstrumented) step of ``device``."""
    from torch.overrides import TorchFunctionMode

    from dcp.execute.local import DeviceRunner
    from dcp.execute.noop import NoopComm

    class _Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        run = DeviceRunner(plan, device, direction, home, NoopComm(), kernels, scale)
        run.run()
        run.finish_forward() if direction == "forward" else run.finish_backward()
    return _Count.n


def _median2(pairs) -> tuple:
    pairs = list(pairs)
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def measure(plan, repeats: int = 5, prepare_repeats: int = 3, devices=None) -> dict:
    """``times[(direction, item)]``: per device, the median (CPU s, wall s) over ``repeats`` steps (per-item
    breakdowns and uninstrumented step totals are separate runs) or cold preparations; ``counts[(direction,
    kind)]``: per device, the plan's instructions of that kind."""
    from dcp.execute.local import default_scale
    from dcp.execute.noop import NoopKernels, meta_home

    kernels, scale = NoopKernels(), default_scale(plan, None)
    dtype = getattr(torch, plan.spec.dtype) if isinstance(plan.spec.dtype, str) else plan.spec.dtype
    devices = list(range(plan.n_devices)) if devices is None else list(devices)
    data = plan.to_bytes()
    times: dict = {}
    counts: dict = {}
    for d in devices:
        homes = {dr: meta_home(plan, d, dr, dtype) for dr in ("forward", "backward")}
        for direction in ("forward", "backward"):
            c = ir_counts(plan, direction, d)
            for k in c:
                counts.setdefault((direction, k), []).append(c[k])
            time_step(plan, direction, d, homes[direction], kernels, scale)  # warm: prepared, first step
            per_op, total = [], []
            for _ in range(repeats):
                per_op.append(time_step(plan, direction, d, homes[direction], kernels, scale))
                total.append(time_step(plan, direction, d, homes[direction], kernels, scale, per_op=False))
            for item in ITEMS:
                times.setdefault((direction, item), []).append(_median2(g[item] for g in per_op))
            times.setdefault((direction, "step"), []).append(_median2(g["step"] for g in total))
            counts.setdefault((direction, "torch_calls"), []).append(
                count_torch_calls(plan, direction, d, homes[direction], kernels, scale))
        for direction, dirs in (("forward", ("forward",)), ("backward", ("backward",)),
                                ("both", ("forward", "backward"))):
            prep = [time_prepare(data, dirs, d, homes, kernels, scale) for _ in range(prepare_repeats)]
            times.setdefault((direction, "prepare"), []).append(_median2(prep))
    return {"times": times, "counts": counts, "devices": devices}


def _target(item: str, direction: str) -> float | None:
    if item == "step":
        return TARGET_STEP_US
    if item == "prepare" and direction == "both":
        return TARGET_PREPARE_US
    return None


def rows_of(case: OverheadCase, plan, got: dict, repeats: int) -> list[dict]:
    devices, times, counts = got["devices"], got["times"], got["counts"]
    base = dict(case=case.name, dataset=case.dataset, scale=case.scale, mask=case.mask, nodes=case.nodes,
                gpus_per_node=case.gpus_per_node, n_devices=plan.n_devices, tokens=plan.spec.total_tokens,
                num_seqs=plan.spec.num_seqs, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                dtype=case.dtype, dcp_block_size=dcp_config("a100", case.dcp).block_size,
                max_block_tokens=int(plan.layout.tb_len.max()), n_token_blocks=plan.layout.n_token_blocks)
    rows = []
    for direction in ("forward", "backward", "both"):
        items = ("prepare",) if direction == "both" else ("prepare", *ITEMS, "step")
        for item in items:
            us = [t[0] * 1e6 for t in times[(direction, item)]]
            wall = [t[1] * 1e6 for t in times[(direction, item)]]
            if item in KINDS:
                n = counts[(direction, item)]
            elif item == "step":
                n = [sum(counts[(direction, k)][i] for k in KINDS) for i in range(len(devices))]
            else:
                n = None
            worst = max(range(len(us)), key=us.__getitem__)
            row = dict(base, direction=direction, item=item,
                       count_median=statistics.median(n) if n else "", count_worst_device=n[worst] if n else "",
                       us_median=round(statistics.median(us), 1), us_worst=round(us[worst], 1),
                       worst_device=devices[worst])
            per = [u / c for u, c in zip(us, n) if c] if n else []
            row["us_per_instruction_median"] = round(statistics.median(per), 2) if per else ""
            row["us_per_instruction_worst"] = round(max(per), 2) if per else ""
            row["wall_us_median"] = round(statistics.median(wall), 1)
            row["wall_us_worst"] = round(max(wall), 1)
            calls = counts[(direction, "torch_calls")] if item == "step" else None
            row["torch_calls_median"] = statistics.median(calls) if calls else ""
            row["torch_calls_worst"] = max(calls) if calls else ""
            target = _target(item, direction)
            row["target_us"] = target if target is not None else ""
            if item == "step":
                row["target_us_per_instruction"] = TARGET_INSTRUCTION_US
                row["meets_target"] = bool(us[worst] <= TARGET_STEP_US and max(per) <= TARGET_INSTRUCTION_US)
            else:
                row["target_us_per_instruction"] = ""
                row["meets_target"] = bool(us[worst] <= target) if target is not None else ""
            rows.append(row)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    for r in rows:
        r.update(time_measure="thread CPU time (us_*); wall clock (wall_us_*)", tensor_device="meta",
                 kernels="noop", repeats=repeats, load_avg_1m=round(load[0], 2), load_avg_5m=round(load[1], 2),
                 torch=torch.__version__, machine=machine(), revision=git_revision())
    return rows


def device_rows(case: OverheadCase, got: dict) -> list[dict]:
    """One row per (direction, device): the instruction counts and each item's CPU microseconds (the
    per-device data ``dcp.bench.host_fit`` fits the profiles' host costs to)."""
    rows = []
    for direction in ("forward", "backward"):
        for i, d in enumerate(got["devices"]):
            row = dict(case=case.name, direction=direction, device=d)
            row.update({f"n_{k}": got["counts"][(direction, k)][i] for k in COUNTS})
            row.update({f"{item}_us": round(got["times"][(direction, item)][i][0] * 1e6, 2) for item in ITEMS})
            rows.append(row)
    return rows


def run_overhead(cases=CASES, repeats: int = 5, prepare_repeats: int = 3, log=print,
                 per_device: list | None = None) -> list[dict]:
    """The summary rows of every case; ``per_device``: a list that receives ``device_rows`` of each case."""
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        plan = case_plan(case)
        log(f"[overhead] {case.name}: planned in {time.perf_counter() - t0:.1f} s ({plan.n_devices} devices, "
            f"{plan.layout.n_token_blocks} token blocks); timing ...")
        got = measure(plan, repeats, prepare_repeats)
        rows += rows_of(case, plan, got, repeats)
        if per_device is not None:
            per_device += [dict(r, **{k: rows[-1][k] for k in ("load_avg_1m", "torch", "machine", "revision")})
                           for r in device_rows(case, got)]
        log(f"[overhead] {case.name}: done in {time.perf_counter() - t0:.1f} s")
    return rows


TABLE_COLUMNS = ["case", "direction", "item", "count_median", "us_median", "us_worst", "worst_device",
                 "us_per_instruction_median", "us_per_instruction_worst", "wall_us_median", "wall_us_worst",
                 "torch_calls_median", "torch_calls_worst", "target_us", "meets_target"]


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="the executor's host time per device and instruction (meta tensors, "
                                        "no-op kernels and transport)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(c.name for c in CASES),
                   help="comma-separated case names (default: all)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per device and direction (median)")
    p.add_argument("--prepare-repeats", type=int, default=3, help="cold preparations per device (median)")
    p.add_argument("--quick", action="store_true", help="one small batch on 4 devices (seconds)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT),
                   help="where overhead_cpu.csv, overhead_devices_cpu.csv and host_fit_cpu.json go (the committed "
                        "results: --out-dir benchmarks/results)")
    p.add_argument("--fit", metavar="DEVICES_CSV", default=None,
                   help="measure nothing: fit the profiles' host_* costs to a per-device CSV of an earlier run "
                        "(dcp.bench.host_fit) and write host_fit_cpu.json to --out-dir")
    p.set_defaults(func=cmd_overhead)


def cmd_overhead(args) -> int:
    import sys

    if args.fit:
        return _write_fit(read_csv(args.fit), Path(args.out_dir), args.fit)
    if args.quick:
        cases, repeats, prep = (QUICK_CASE,), min(args.repeats, 2), min(args.prepare_repeats, 1)
    else:
        by_name = {c.name: c for c in CASES}
        names = [x.strip() for x in args.cases.split(",") if x.strip()]
        bad = [n for n in names if n not in by_name]
        if bad:
            print(f"unknown cases {bad}; choose from {sorted(by_name)}", file=sys.stderr)
            return 2
        cases, repeats, prep = tuple(by_name[n] for n in names), args.repeats, args.prepare_repeats
    if repeats < 1 or prep < 1:
        print("--repeats and --prepare-repeats must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    per_device: list = []
    rows = run_overhead(cases, repeats, prep, log=lambda m: print(m, file=sys.stderr, flush=True),
                        per_device=per_device)
    path = write_csv(Path(args.out_dir) / CSV_NAME, rows)
    print(f"wrote {path}")
    dev_path = write_csv(Path(args.out_dir) / DEVICES_CSV_NAME, per_device)
    print(f"wrote {dev_path}")
    _write_fit(per_device, Path(args.out_dir), str(dev_path))
    print("\nexecutor host time per device (meta tensors, no-op kernels/merges/transport; us = microseconds of "
          "this thread's CPU time, wall_us = wall clock)")
    print(fmt_table(rows, TABLE_COLUMNS))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"\noverhead: {time.perf_counter() - started:.0f} s on {machine()}, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


def _write_fit(rows: list[dict], out_dir: Path, source: str) -> int:
    """Fit ``GPUProfile.host_*`` to per-device rows, print it and write ``host_fit_cpu.json``."""
    import json
    import sys

    from dcp.bench.host_fit import fit_host_costs

    try:
        fit = fit_host_costs(rows)
    except ValueError as err:
        print(f"cannot fit host costs: {err}", file=sys.stderr)
        return 2
    first = rows[0]
    load = first.get("load_avg_1m", "")
    try:  # a number, whether the rows were measured here or read back from a CSV
        load = float(load)
    except (TypeError, ValueError):
        pass
    fit.update(source=source, cases=sorted({r["case"] for r in rows}), machine=first.get("machine", ""),
               revision=first.get("revision", ""), load_avg_1m=load,
               time_measure="thread CPU time, meta tensors, no-op kernels and transport")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FIT_NAME
    path.write_text(json.dumps(fit, indent=2) + "\n")
    print(f"host costs fitted over {fit['devices']} devices (GPUProfile.host_*, microseconds): "
          + ", ".join(f"{k}={v}" for k, v in fit["fields"].items()))
    print("relative error of the fit (median / worst): " + ", ".join(
        f"{k} {q['median_rel_error']}/{q['worst_rel_error']}" for k, q in fit["quality"].items()))
    print(f"wrote {path}")
    return 0


__all__ = ["OverheadCase", "CASES", "QUICK_CASE", "case_plan", "ir_counts", "measure", "run_overhead", "time_step"]
