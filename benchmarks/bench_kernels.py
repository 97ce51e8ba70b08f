"""Throughput of the native CPU attention kernels against PyTorch's own CPU flash attention.

Workload: ``--segments`` q segments of ``--block`` rows, each with ``--tiles`` FULL tiles of ``--block``
distinct keys (dense blocks), 8 query heads / 2 kv heads, D = 128 by default. PyTorch runs
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) per segment on the same keys
(kv heads expanded outside the timed region, since that op has no GQA). FLOPs: forward 4*q*k*D per head
and tile, backward counted as 2.5x forward (the flash-attention convention), whatever each
implementation actually executes.

    python benchmarks/bench_kernels.py [--dtypes float32 bfloat16] [--repeat 3]

Writes ``benchmarks/results/kernels_cpu.csv`` and prints a table: best-of-N wall time (TFLOPS, ratio to
PyTorch) and best-of-N process CPU time (GFLOP per CPU-second, ratio), the latter being steadier when
other processes share the cores.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dcp.kernels import TileTable, native  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def _time(fn, repeat: int) -> tuple[float, float]:
    """Best (minimum) wall time and best process CPU time (all threads) in seconds of ``fn()`` over
    ``repeat`` runs after one warm-up. The CPU time is the steadier figure on a shared machine."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def machine() -> str:
    """The machine (``dcp.bench.common.machine``) and the torch thread count of this run."""
    from dcp.bench.common import machine as describe

    return f"{describe()} ({torch.get_num_threads()} threads)"


def run(args) -> list[dict]:
    hq, hkv, d, blk = args.heads, args.kv_heads, args.head_dim, args.block
    n_seg, n_tiles = args.segments, args.tiles
    g = hq // hkv
    tq, tk = n_seg * blk, n_seg * n_tiles * blk
    tiles = TileTable.from_segments(
        [(blk, [((s * n_tiles + i) * blk, blk) for i in range(n_tiles)]) for s in range(n_seg)])
    fwd_flops = 4.0 * n_seg * n_tiles * blk * blk * d * hq
    bwd_flops = 2.5 * fwd_flops
    scale = 1.0 / math.sqrt(d)
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(tq, hq, d, generator=gen).to(dtype)
        k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
        v = torch.randn(tk, hkv, d, generator=gen).to(dtype)
        do = torch.randn(tq, hq, d, generator=gen).to(dtype)

        # --- PyTorch flash attention per segment, [1, H, L, D] layout, GQA expanded beforehand
        segs = []
        for s in range(n_seg):
            ks = k[s * n_tiles * blk:(s + 1) * n_tiles * blk].repeat_interleave(g, dim=1)
            vs = v[s * n_tiles * blk:(s + 1) * n_tiles * blk].repeat_interleave(g, dim=1)
            to4 = lambda x: x.transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731
            segs.append((to4(q[s * blk:(s + 1) * blk]), to4(ks), to4(vs), to4(do[s * blk:(s + 1) * blk])))
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

        def torch_fwd():
            return [flash(qs, ks, vs, scale=scale) for qs, ks, vs, _ in segs]

        fwd_out = torch_fwd()

        def torch_bwd():
            for (qs, ks, vs, dos), (o, lse) in zip(segs, fwd_out):
                flash_bwd(dos, qs, ks, vs, o, lse, 0.0, False, scale=scale)

        # --- native
        o_n, lse_n = native.attention_forward(q, k, v, tiles, scale)
        delta = (do.float() * o_n.float()).sum(-1).t().contiguous()
        results = {
            ("forward", "torch_flash_cpu"): _time(torch_fwd, args.repeat),
            ("forward", "dcp_native"): _time(lambda: native.attention_forward(q, k, v, tiles, scale), args.repeat),
        }
        if not args.no_backward:
            results[("backward", "torch_flash_cpu")] = _time(torch_bwd, args.repeat)
            results[("backward", "dcp_native")] = _time(
                lambda: native.attention_backward(do, q, k, v, lse_n, delta, tiles, scale), args.repeat)
        for (pass_, impl), (sec, cpu) in results.items():
            flops = fwd_flops if pass_ == "forward" else bwd_flops
            base, base_cpu = results[(pass_, "torch_flash_cpu")]
            rows.append(dict(machine=machine(), isa=native.cpu_isa(), dtype=name, pass_=pass_, impl=impl,
                             heads=f"{hq}/{hkv}", head_dim=d, block=blk, tiles=n_seg * n_tiles,
                             ms=round(sec * 1e3, 2), tflops=round(flops / sec / 1e12, 4),
                             vs_torch=round(base / sec, 3), cpu_s=round(cpu, 4),
                             gflops_per_cpu_s=round(flops / cpu / 1e9, 2), vs_torch_cpu=round(base_cpu / cpu, 3)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=1024, help="rows per q segment and keys per tile")
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--tiles", type=int, default=2, help="full tiles per segment")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "kernels_cpu.csv"))
    args = ap.parse_args(argv)
    if not native.is_available():
        sys.exit("dcp._C is not built: pip install --no-build-isolation -e .")
    rows = run(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"machine: {rows[0]['machine']}, kernels: {rows[0]['isa']}, heads {rows[0]['heads']}, "
          f"D={rows[0]['head_dim']}, {rows[0]['tiles']} tiles of {args.block}x{args.block}")
    print(f"{'dtype':<10}{'pass':<10}{'impl':<18}{'ms':>10}{'TFLOPS':>10}{'vs torch':>10}"
          f"{'GFLOP/cpu-s':>13}{'vs torch (cpu)':>16}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['pass_']:<10}{r['impl']:<18}{r['ms']:>10.2f}{r['tflops']:>10.4f}"
              f"{r['vs_torch']:>10.3f}{r['gflops_per_cpu_s']:>13.1f}{r['vs_torch_cpu']:>16.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
