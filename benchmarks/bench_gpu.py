"""The GPU run: the CUDA path checked and measured, and the cost model calibrated from it, in one call.

    python benchmarks/bench_gpu.py                  # on a GPU: full sizes, writes gpu_<device>.csv / .json
    python benchmarks/bench_gpu.py --quick --device cpu --out /tmp/x   # the same steps, tiny, on the CPU

Steps (each row of the CSV names its step):
  ceilings     a large device-to-device copy (bytes read + written) and a bf16 matrix product
  correct      every mask family through the executor (``kernels="auto"``: the fused varlen path on a
               GPU), forward and backward, vs dense fp64 attention on the same device; fresh random inputs,
               the caching allocator poisoned with NaN before every run; pass = error <= 2x dense bf16
               attention's error + one bf16 ulp of the result
  tiles        tile kernel time and TFLOPS by tile shape and mask (full, causal, band, sink + band)
  fused        the executor (all devices of a plan in this process) against the same tiles as one
               fused varlen call per window on pre-packed inputs: TFLOPS of each and their ratio
  merge        the LSE-merge and partial-sum kernels (``dcp._C_cuda``) and the row gather against a
               device-to-device copy, in GB/s
  calibrate    cost-profile constants fitted to the tile table; then every device of an 8-device plan
               runs its forward compute alone and its measured time is compared with the simulator's
               prediction under the fitted profile
The fitted profile is written as ``gpu_<device>_profile.json`` (same fields as dcp/cost/profiles/*.json).
On the CPU the steps run with the plain-PyTorch varlen emulation and tiny sizes: a check of the script.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402
import dcp  # noqa: E402
from dcp.cost.model import CostModel, GPUProfile, load_profile  # noqa: E402
from dcp.execute import ReferenceExecutor, reference_attention  # noqa: E402
from dcp.execute.tables import plan_tables  # noqa: E402
from dcp.kernels import TileTable, native, varlen  # noqa: E402
from dcp.kernels.varlen_ops import for_call, select_ops  # noqa: E402
from dcp.kernels.varlen_schedule import VarlenCall, build_schedule  # noqa: E402
from dcp.masks import (CausalBlockwiseMask, CausalMask, DocumentMask, FullMask, LambdaMask,  # noqa: E402
                       ModalityMask, PrefixLMMask, SharedQuestionMask, SlidingWindowMask)
from dcp.partition import GreedyPartitioner  # noqa: E402
from dcp.sim import simulate  # noqa: E402

HQ, HKV, D = 8, 2, 128


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens_correct: tuple      # sequence lengths of the correctness batch
    block_correct: int
    tokens_plan: int           # tokens of the speed / calibration batches
    block_plan: int
    tile_sizes: tuple          # square tile edges of the tile table
    copy_mb: int
    matmul_n: int
    reps: int


FULL_SIZES = Sizes((3000, 1200, 700, 300), 512, 65536, 1024, (128, 256, 512, 1024, 2048, 4096), 2048, 8192, 20)
QUICK_SIZES = Sizes((90, 40, 25), 16, 512, 32, (16, 32, 64), 8, 256, 3)


# ------------------------------------------------------------------------------------------ timing
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_s(fn, dev: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def poison(dev: torch.device, gib: float = 4.0) -> None:
    """Fill a large block with NaN and free it: the caching allocator hands it out next, so a buffer
    that a kernel fails to write shows up as NaN instead of stale correct data."""
    if dev.type != "cuda":
        return
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=dev)
    x.fill_(float("nan"))
    del x


# ------------------------------------------------------------------------------------------ steps
def ceilings(dev, sz: Sizes, rows: list) -> dict:
    n = sz.copy_mb * 2**20 // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    t = time_s(lambda: dst.copy_(src), dev, sz.reps)
    copy_gbps = 2 * n * 4 / t / 1e9
    a = torch.randn(sz.matmul_n, sz.matmul_n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(sz.matmul_n, sz.matmul_n, device=dev, dtype=torch.bfloat16)
    t_mm = time_s(lambda: a @ b, dev, sz.reps)
    mm_tflops = 2 * sz.matmul_n ** 3 / t_mm / 1e12
    rows.append(dict(step="ceilings", case=f"copy {sz.copy_mb} MiB fp32", metric="GB/s", value=copy_gbps))
    rows.append(dict(step="ceilings", case=f"bf16 matmul {sz.matmul_n}^3", metric="TFLOPS", value=mm_tflops))
    return dict(copy_gbps=copy_gbps, matmul_tflops=mm_tflops)


def _family_masks(lengths, rng):
    return {
        "causal": [CausalMask()] * len(lengths),
        "full": [FullMask()] * len(lengths),
        "sliding_window": [SlidingWindowMask(window=max(1, n // 4)) for n in lengths],
        "lambda": [LambdaMask(sink=max(1, n // 16), window=max(1, n // 4)) for n in lengths],
        "shared_question": [SharedQuestionMask(question_frac=0.3, num_answers=3) for _ in lengths],
        "causal_blockwise": [CausalBlockwiseMask(block=max(1, n // 8), num_prev=1) for n in lengths],
        "modality": [ModalityMask(text_len=max(1, n // 10), image_len=max(1, n // 7)) for n in lengths],
        "prefix_lm": [PrefixLMMask(prefix_frac=float(rng.uniform(0.2, 0.8))) for _ in lengths],
        "document": [DocumentMask(doc_lengths=(n // 3, n - n // 3), inner=CausalMask()) for n in lengths],
    }


def _plan(lengths, masks, cluster, block, dtype="bfloat16"):
    spec = dcp.BatchSpec(list(lengths), masks, HQ, HKV, D, dtype=dtype)
    cfg = dcp.PlannerConfig(block_size=block, partitioner=GreedyPartitioner(), time_budget_s=None)
    return dcp.plan(spec, dcp.Cluster(*cluster), cfg)


def _err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def correct(dev, sz: Sizes, rows: list, seed: int) -> int:
    """Every family, forward + backward, 4 devices. Returns the number of failed checks."""
    rng = np.random.default_rng(seed)
    failures = 0
    executor = ReferenceExecutor(kernels="auto")
    for family, masks in _family_masks(sz.tokens_correct, rng).items():
        plan = _plan(sz.tokens_correct, masks, (1, 4), sz.block_correct)
        t = plan.spec.total_tokens
        g = torch.Generator(device=dev).manual_seed(int(rng.integers(0, 2**31)))
        q64, k64, v64, do64 = (torch.randn(t, h, D, generator=g, device=dev, dtype=torch.float64)
                               for h in (HQ, HKV, HKV, HQ))
        leaves = [x.clone().requires_grad_() for x in (q64, k64, v64)]
        o_ref = reference_attention(*leaves, plan.spec)
        g_ref = torch.autograd.grad(o_ref, leaves, do64)
        lo = [x.to(torch.bfloat16).requires_grad_() for x in (q64, k64, v64)]
        o_dense = reference_attention(*lo, plan.spec)
        g_dense = torch.autograd.grad(o_dense, lo, do64.to(torch.bfloat16))
        q, k, v, do = (x.to(torch.bfloat16) for x in (q64, k64, v64, do64))
        poison(dev)
        o, lse = executor.run_forward(plan, q, k, v)
        poison(dev)
        grads = executor.run_backward(plan, q, k, v, o, lse, do)
        kern = executor.kernels.for_input(torch.bfloat16, dev, D).name
        ops = select_ops(torch.bfloat16, dev, D).name if kern == "varlen" else "-"
        for name, ours, dense, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_dense, *g_dense),
                                          (o_ref.detach(), *g_ref)):
            e, e_dense = _err(ours, ref), _err(dense, ref)
            ulp = torch.finfo(torch.bfloat16).eps * float(ref.abs().max())
            finite = bool(torch.isfinite(ours).all())
            ok = finite and e <= 2 * e_dense + ulp
            failures += not ok
            rows.append(dict(step="correct", case=f"{family} {name}", metric="max_abs_err", value=e,
                             reference=e_dense, bound=2 * e_dense + ulp, passed=ok, kernels=kern, ops=ops))
    return failures


def _tile_table(n: int, kind: str) -> TileTable:
    if kind == "full":
        return TileTable.from_segments([(n, [(0, n)])])
    t = np.arange(n)
    if kind == "causal":
        ranges = np.stack([np.zeros(n), t + 1], 1)[:, None]
    elif kind == "band":   # sliding window of n / 4
        w = max(1, n // 4)
        ranges = np.stack([np.maximum(0, t - w + 1), t + 1], 1)[:, None]
    elif kind == "sink_band":  # lambda: n / 16 sink keys + a band of n / 4
        w, s = max(1, n // 4), max(1, n // 16)
        ranges = np.stack([np.stack([np.zeros(n), np.minimum(s, t + 1)], 1),
                           np.stack([np.maximum(0, t - w + 1), t + 1], 1)], 1)
    else:
        raise ValueError(kind)
    return TileTable.from_segments([(n, [(0, n, ranges.astype(np.int64))])])


def _rand(shape, dev, dtype=torch.bfloat16, gen=None):
    return torch.randn(shape, device=dev, dtype=torch.float32, generator=gen).to(dtype)


def tiles(dev, sz: Sizes, rows: list) -> list[dict]:
    """Tile kernel time by shape and mask. Returns the fit points."""
    points = []
    for n in sz.tile_sizes:
        for kind in ("full", "causal", "band", "sink_band"):
            table = _tile_table(n, kind)
            sched = build_schedule(table, n, n)
            pairs = sched.n_pairs
            q, k, v, do = _rand((n, HQ, D), dev), _rand((n, HKV, D), dev), _rand((n, HKV, D), dev), _rand((n, HQ, D), dev)
            o, lse = varlen.attention_forward(q, k, v, table)
            delta = (do.float() * o.float()).sum(-1).t().contiguous()
            t_f = time_s(lambda: varlen.attention_forward(q, k, v, table), dev, sz.reps)
            t_b = time_s(lambda: varlen.attention_backward(do, q, k, v, lse, delta, table), dev, sz.reps)
            flops = 4.0 * pairs * HQ * D
            for direction, t, f in (("forward", t_f, flops), ("backward", t_b, 2.5 * flops)):
                rows.append(dict(step="tiles", case=f"{n}x{n} {kind} {direction}", metric="TFLOPS",
                                 value=f / t / 1e12, seconds=t, density=pairs / n / n, calls=len(sched.calls)))
                points.append(dict(n=n, kind=kind, direction=direction, seconds=t, flops=f))
    return points


def _fused_calls(plan, direction: str):
    """Every device's tiles of ``direction`` as one call per window over pre-packed inputs:
    ``[(VarlenCall, nq_rows, nk_rows)]``, built from the same tables the executor runs."""
    tab = plan_tables(plan)
    by_window: dict = {}
    for dev_id in range(plan.n_devices):
        ops, _ = tab.program(direction, dev_id)
        for op in ops:
            for c in getattr(op, "calls", ()):
                tq, tk = c.q_hi - c.q_lo, c.kv_hi - c.kv_lo
                for call in build_schedule(c.table, tq, tk).calls:
                    by_window.setdefault(call.window, []).append(call)
    fused = []
    for window, calls in by_window.items():
        nq = np.concatenate([np.diff(c.cu_q.numpy()) for c in calls])
        nk = np.concatenate([np.diff(c.cu_k.numpy()) for c in calls])
        fused.append(VarlenCall(window, torch.arange(int(nq.sum())), torch.arange(int(nk.sum())),
                                torch.from_numpy(np.r_[0, np.cumsum(nq)].astype(np.int32)),
                                torch.from_numpy(np.r_[0, np.cumsum(nk)].astype(np.int32)),
                                int(nq.max()), int(nk.max()), sum(c.n_pairs for c in calls)))
    return fused


def fused(dev, sz: Sizes, rows: list) -> None:
    from dcp.data import make_batches

    lens = make_batches("ldc", 1.0, tokens_per_batch=sz.tokens_plan, num_batches=1, seed=3)[0]
    for mask_name, mask in (("causal", CausalMask()), ("lambda", LambdaMask(sink=64, window=4096))):
        plan = _plan(lens, [mask] * len(lens), (1, 8), sz.block_plan)
        t = plan.spec.total_tokens
        q, k, v, do = _rand((t, HQ, D), dev), _rand((t, HKV, D), dev), _rand((t, HKV, D), dev), _rand((t, HQ, D), dev)
        ex = ReferenceExecutor(kernels="auto")
        o, lse = ex.run_forward(plan, q, k, v)
        t_exec = {"forward": time_s(lambda: ex.run_forward(plan, q, k, v), dev, max(3, sz.reps // 4)),
                  "backward": time_s(lambda: ex.run_backward(plan, q, k, v, o, lse, do), dev, max(3, sz.reps // 4))}
        impl = select_ops(torch.bfloat16, dev, D)
        fwd_flops = float(plan.tiles.fwd_flops.sum())
        for direction in ("forward", "backward"):
            calls = [c.to(dev) for c in _fused_calls(plan, direction)]
            packed = []
            for c in calls:
                nq, nk = int(c.cu_q[-1]), int(c.cu_k[-1])
                qs, ks, vs, dos = _rand((nq, HQ, D), dev), _rand((nk, HKV, D), dev), _rand((nk, HKV, D), dev), _rand((nq, HQ, D), dev)
                os_, lses = for_call(impl, c).forward(qs, ks, vs, c, 1 / math.sqrt(D))
                packed.append((c, qs, ks, vs, dos, os_, lses))

            def run_all():
                for c, qs, ks, vs, dos, os_, lses in packed:
                    if direction == "forward":
                        for_call(impl, c).forward(qs, ks, vs, c, 1 / math.sqrt(D))
                    else:
                        for_call(impl, c).backward(dos, qs, ks, vs, os_, lses, c, 1 / math.sqrt(D))
            t_fused = time_s(run_all, dev, max(3, sz.reps // 4))
            flops = fwd_flops * (2.5 if direction == "backward" else 1.0)
            for who, secs in (("executor", t_exec[direction]), ("fused", t_fused)):
                rows.append(dict(step="fused", case=f"{mask_name} 8 devices {direction} {who}", metric="TFLOPS",
                                 value=flops / secs / 1e12, seconds=secs, calls=len(calls)))
            rows.append(dict(step="fused", case=f"{mask_name} 8 devices {direction}", metric="executor/fused",
                             value=t_fused / t_exec[direction]))


def merge(dev, sz: Sizes, rows: list, copy_gbps: float) -> None:
    t = max(1024, sz.copy_mb * 2**20 // (HQ * D * 10))
    o_acc = _rand((t, HQ, D), dev, torch.float32)
    o_new = _rand((t, HQ, D), dev)
    lse_acc, lse_new = torch.randn(HQ, t, device=dev), torch.randn(HQ, t, device=dev)
    if native.is_available() and (dev.type == "cpu" or native.cuda_merge_available()):
        secs = time_s(lambda: native.merge_into(o_acc, lse_acc, o_new, lse_new), dev, sz.reps)
        nbytes = t * HQ * D * (4 + 2 + 4) + 3 * t * HQ * 4
        rows.append(dict(step="merge", case=f"merge_into fp32 acc + bf16, {t} rows", metric="GB/s",
                         value=nbytes / secs / 1e9, vs_copy=nbytes / secs / 1e9 / copy_gbps))
        if dev.type == "cuda":
            from dcp.kernels.native import _C_cuda

            srcs = [_rand((t, HQ, D), dev) for _ in range(3)]
            dst = torch.zeros(t, HQ, D, device=dev)
            secs = time_s(lambda: _C_cuda.sum_partials(dst, srcs, True), dev, sz.reps)
            nbytes = t * HQ * D * (3 * 2 + 2 * 4)
            rows.append(dict(step="merge", case=f"sum_partials 3 x bf16 into fp32, {t} rows", metric="GB/s",
                             value=nbytes / secs / 1e9, vs_copy=nbytes / secs / 1e9 / copy_gbps))
    idx = torch.randperm(t, device=dev)
    secs = time_s(lambda: o_new.index_select(0, idx), dev, sz.reps)
    nbytes = 2 * t * HQ * D * 2
    rows.append(dict(step="merge", case=f"row gather (index_select) bf16, {t} rows", metric="GB/s",
                     value=nbytes / secs / 1e9, vs_copy=nbytes / secs / 1e9 / copy_gbps))


def fit_profile(points: list[dict], base: GPUProfile, copy_gbps: float, name: str) -> GPUProfile:
    """Least-squares (in log time) fit of rate, half and overhead to the full tiles, then the partial
    efficiency from the masked ones; backward rate from the backward full tiles."""
    def model(n, flops, rate, half, over, part):
        return over + flops / (rate * (n / (n + half)) ** 2 * part)

    best = None
    full_f = [p for p in points if p["kind"] == "full" and p["direction"] == "forward"]
    over = min(p["seconds"] for p in points) * 0.5
    for half in np.geomspace(8, 4096, 60):
        # the rate that best explains the full forward tiles at this half
        est = [p["flops"] / ((p["seconds"] - over) * (p["n"] / (p["n"] + half)) ** 2) for p in full_f
               if p["seconds"] > over]
        if not est:
            continue
        rate = float(np.exp(np.median(np.log(est))))
        err = sum(math.log(model(p["n"], p["flops"], rate, half, over, 1.0) / p["seconds"]) ** 2 for p in full_f)
        if best is None or err < best[0]:
            best = (err, half, rate)
    _, half, rate_f = best
    full_b = [p for p in points if p["kind"] == "full" and p["direction"] == "backward"]
    rate_b = float(np.exp(np.median([math.log(p["flops"] / ((p["seconds"] - over) * (p["n"] / (p["n"] + half)) ** 2))
                                     for p in full_b if p["seconds"] > over])))
    part = [model(p["n"], p["flops"], rate_f if p["direction"] == "forward" else rate_b, half, 0.0, 1.0)
            / max(p["seconds"] - over, 1e-12) for p in points if p["kind"] != "full" and p["seconds"] > over]
    return dataclasses.replace(base, name=name, attn_fwd_tflops=rate_f / 1e12, attn_bwd_tflops=rate_b / 1e12,
                               half_rows=float(half), half_cols=float(half),
                               partial_tile_efficiency=float(min(1.0, np.median(part))) if part else 1.0,
                               kernel_overhead_us=over * 1e6, hbm_gbps=copy_gbps)


def calibrate(dev, sz: Sizes, rows: list, profile: GPUProfile) -> float:
    """Each device of an 8-device plan runs its forward calls alone; measured vs simulated compute.
    Returns the largest relative error."""
    from dcp.data import make_batches

    lens = make_batches("ldc", 1.0, tokens_per_batch=sz.tokens_plan, num_batches=1, seed=5)[0]
    plan = _plan(lens, [CausalMask()] * len(lens), (1, 8), sz.block_plan)
    sim = simulate(plan, CostModel(profile), "forward", record_events=False)
    tab = plan_tables(plan)
    worst = 0.0
    for d in range(plan.n_devices):
        ops, _ = tab.program("forward", d)
        work = []
        for op in ops:
            for c in getattr(op, "calls", ()):
                nq, nk = c.q_hi - c.q_lo, c.kv_hi - c.kv_lo
                hq = HQ if c.hq is None else c.hq.stop - c.hq.start
                hk = HKV if c.hk is None else c.hk.stop - c.hk.start
                work.append((_rand((nq, hq, D), dev), _rand((nk, hk, D), dev), _rand((nk, hk, D), dev), c.table))
        if not work:
            continue
        secs = time_s(lambda: [varlen.attention_forward(q, k, v, tb) for q, k, v, tb in work], dev,
                      max(3, sz.reps // 4))
        pred = float(sim.compute_s[d])
        rel = secs / pred - 1 if pred > 0 else math.inf
        worst = max(worst, abs(rel))
        rows.append(dict(step="calibrate", case=f"device {d} forward compute", metric="measured/simulated",
                         value=secs / pred if pred > 0 else math.inf, seconds=secs, simulated_s=pred))
    return worst


def graphs(dev, sz: Sizes, rows: list) -> int:
    """CUDA graphs (``dcp.execute.graphs``): a one-device plan through ``DCPAttention(cuda_graphs=True)`` and a
    4-device plan run in one process (every device's program in one graph), each captured once and replayed
    with new inputs: equal to eager execution, and the time per call of both. Returns the failed checks."""
    from dcp.execute.graphs import CapturedProgram
    from dcp.integration import DCPAttention

    failures = 0
    lengths = sz.tokens_correct
    for label, n_dev in (("module, 1 device", 1), ("in-process, 4 devices", 4)):
        plan = _plan(lengths, "causal", (1, n_dev), sz.block_correct)
        t = plan.spec.total_tokens
        g = torch.Generator(device=dev).manual_seed(1)
        mk = lambda: [torch.randn(t, h, D, generator=g, device=dev, dtype=torch.bfloat16)  # noqa: E731
                      for h in (HQ, HKV, HKV)]
        try:
            if n_dev == 1:
                graphed, eager = DCPAttention(cuda_graphs=True), DCPAttention()
                run_g = lambda x: graphed(*x, plan)  # noqa: E731
                run_e = lambda x: eager(*x, plan)  # noqa: E731
            else:
                ex = ReferenceExecutor(kernels="auto")
                prog = CapturedProgram(lambda st: ex.run_forward(plan, *st), mk(), "cuda")
                run_g = lambda x: prog(x)[0]  # noqa: E731
                run_e = lambda x: ex.run_forward(plan, *x)[0]  # noqa: E731
            x = mk()
            same = bool(torch.equal(run_g(x), run_e(x)))
            t_g, t_e = time_s(lambda: run_g(x), dev, 10), time_s(lambda: run_e(x), dev, 10)
        except Exception as err:  # noqa: BLE001 - a GPU finding to record, not a crash of the whole run
            rows.append(dict(step="graphs", case=label, metric="error", value=float("nan"), passed=False,
                             error=f"{type(err).__name__}: {err}"[:300]))
            failures += 1
            continue
        failures += not same
        rows.append(dict(step="graphs", case=f"{label} forward", metric="replay_equals_eager", value=float(same),
                         passed=same))
        rows.append(dict(step="graphs", case=f"{label} forward", metric="replay_ms", value=t_g * 1e3))
        rows.append(dict(step="graphs", case=f"{label} forward", metric="eager_ms", value=t_e * 1e3))
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check of the script)")
    ap.add_argument("--out", default=str(RESULTS), help="folder for gpu_<device>.csv and _profile.json")
    ap.add_argument("--steps", default="ceilings,correct,graphs,tiles,fused,merge,calibrate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sz = QUICK_SIZES if args.quick else FULL_SIZES
    steps = set(args.steps.split(","))
    name = torch.cuda.get_device_name(dev).replace(" ", "_") if dev.type == "cuda" else "cpu"
    tag = name.lower().replace("nvidia_", "").split("_")[0] if dev.type == "cuda" else "cpu"
    rows: list[dict] = []
    started = time.perf_counter()
    ceil = ceilings(dev, sz, rows)
    failures = correct(dev, sz, rows, args.seed) if "correct" in steps else 0
    if "graphs" in steps and dev.type == "cuda":
        failures += graphs(dev, sz, rows)
    points = tiles(dev, sz, rows) if "tiles" in steps or "calibrate" in steps else []
    if "fused" in steps:
        fused(dev, sz, rows)
    if "merge" in steps:
        merge(dev, sz, rows, ceil["copy_gbps"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "calibrate" in steps and points:
        base = load_profile(tag if tag in ("a100", "h100", "h200") else "h100")
        prof = fit_profile(points, base, ceil["copy_gbps"], f"{tag}_measured")
        worst = calibrate(dev, sz, rows, prof)
        rows.append(dict(step="calibrate", case="worst device", metric="abs(measured/simulated - 1)", value=worst))
        doc = dataclasses.asdict(prof)
        doc["sources"] = {k: f"measured by benchmarks/bench_gpu.py on {name}" for k in
                          ("attn_fwd_tflops", "attn_bwd_tflops", "half_rows", "half_cols",
                           "partial_tile_efficiency", "kernel_overhead_us", "hbm_gbps")}
        (out / f"gpu_{tag}_profile.json").write_text(json.dumps(doc, indent=2) + "\n")
    info = dict(device=name, torch=torch.__version__, machine=machine(), revision=git_revision(),
                cuda_merges=native.cuda_merge_available(), quick=args.quick)
    for r in rows:
        r.update(info)
    path = write_csv(out / f"gpu_{tag}.csv", rows)
    for r in rows:
        extra = f"  (ref {r['reference']:.3g}, pass {r['passed']})" if "passed" in r else ""
        print(f"{r['step']:<10} {r['case']:<48} {r['metric']:<28} {r['value']:.4g}{extra}")
    print(f"{len(rows)} rows -> {path} in {time.perf_counter() - started:.0f} s; correctness failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
