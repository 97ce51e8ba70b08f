"""The varlen tile path: tile tables rewritten as fused flash-style calls, checked on the CPU.

The flash kernels themselves need a GPU; here the same calls run through ``EmulatedOps`` (flash's
bottom-right window convention in plain PyTorch). What is proven on the CPU: the rewrite covers every
allowed (row, key) pair exactly once and nothing else, the merge of rows split over several pieces,
the backward's ``D`` carrier, and whole plans through the executors for every mask family.

Low-precision bound: at most 2x the error of the reference kernels in the same dtype, plus one ulp of
the result's magnitude, because flash kernels return each piece's output (and each call's gradients)
rounded to the input dtype before they are merged, plus test_kernels' absolute slack for the noise floor.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from _budget import n_examples
from dcp.errors import ExecutionError
from dcp.execute import ReferenceExecutor
from dcp.execute.local import resolve_kernels
from dcp.execute.tables import plan_tables
from dcp.kernels import TileTable, get_kernels, reference, varlen
from dcp.kernels.varlen_ops import EmulatedOps, _window_mask, select_ops
from dcp.kernels.varlen_schedule import CAUSAL, FULL, _disjoint, build_schedule
from test_execute_reference import FAMILIES, build, dense_low_precision, mask_for, max_err, truth
from test_kernels import SETTINGS, SLACK, _amax, _err, _oracle, problems


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _coverage(table: TileTable, tq: int, tk: int) -> torch.Tensor:
    """How many times the schedule's calls compute each (q row, key) pair: int64 ``[tq, tk]``."""
    sched = build_schedule(table, tq, tk)
    cover = torch.zeros(tq, tk, dtype=torch.int64)
    for call in sched.calls:
        cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
        area = 0
        for i in range(call.n_seq):
            qi = call.q_index[cu_q[i]:cu_q[i + 1]]
            ki = call.k_index[cu_k[i]:cu_k[i + 1]]
            m = _window_mask(len(qi), len(ki), call.window, "cpu")
            assert m.any(dim=1).all(), "a packed row without keys (flash would give it lse = +-inf)"
            cover.index_put_((qi[:, None].expand_as(m)[m], ki[None, :].expand_as(m)[m]),
                             torch.ones(int(m.sum()), dtype=torch.int64), accumulate=True)
            area += int(m.sum())
        assert call.n_pairs == area
        assert call.max_q == max(np.diff(cu_q)) and call.max_k == max(np.diff(cu_k))
    return cover


# ------------------------------------------------------------------------------------ the rewrite
@settings(max_examples=n_examples(150, 1500), **SETTINGS)
@given(pb=problems())
def test_schedule_covers_every_allowed_pair_once(pb):
    tq, tk = pb["q"].shape[0], pb["k"].shape[0]
    cover = _coverage(pb["tiles"], tq, tk)
    dense = pb["tiles"].to_dense(tq, tk)
    assert torch.equal(cover > 0, dense)
    assert cover.numel() == 0 or int(cover.max()) <= 1


def test_disjoint_ranges():
    rows = np.array([[[0, 5], [3, 8], [10, 12]],      # overlap -> [0, 8), [10, 12)
                     [[4, 6], [0, 2], [2, 3]],        # unsorted, touching -> [0, 3), [4, 6)
                     [[1, 1], [0, 0], [7, 9]],        # empty slots
                     [[0, 9], [2, 3], [5, 6]]])       # nested
    got = _disjoint(rows)
    norm = [sorted((int(a), int(b)) for a, b in r if b > a) for r in got]
    assert norm == [[(0, 8), (10, 12)], [(0, 3), (4, 6)], [(7, 9)], [(0, 9)]]


def _table(q_len, tiles):
    return TileTable.from_segments([(q_len, tiles)])


def test_pinned_shapes():
    # a causal diagonal tile: one call, one causal sequence over all rows
    n = 6
    causal = [[[0, t + 1]] for t in range(n)]
    s = build_schedule(_table(n, [(0, n, causal)]), n, n)
    assert [c.window for c in s.calls] == [CAUSAL] and s.calls[0].n_seq == 1 and s.rows_unique
    # full tiles of a segment merge into one piece; next to the diagonal tile rows occur twice
    s = build_schedule(_table(n, [(0, 4), (10, 3), (4, n, causal)]), n, 4 + n + 3)
    assert sorted(c.window for c in s.calls) == [FULL, CAUSAL] and not s.rows_unique
    full = next(c for c in s.calls if c.window == FULL)
    assert full.n_seq == 1 and full.k_index.tolist() == [0, 1, 2, 3, 10, 11, 12]
    # a sliding window of 3 inside one tile: causal start, then the sliding band
    w = 3
    band = [[[max(0, t - w + 1), t + 1]] for t in range(10)]
    s = build_schedule(_table(10, [(0, 10, band)]), 10, 10)
    assert sorted(c.window for c in s.calls) == [CAUSAL, (w - 1, 0)]
    # keys ending at the tile edge while the start moves: causal on reversed rows and keys
    tail = [[[t, 5]] for t in range(5)]
    s = build_schedule(_table(5, [(0, 5, tail)]), 5, 5)
    assert [c.window for c in s.calls] == [CAUSAL]
    assert s.calls[0].q_index.tolist() == [4, 3, 2, 1, 0] and s.calls[0].k_index.tolist() == [4, 3, 2, 1, 0]


@pytest.mark.parametrize("family", ["causal", "sliding_window", "lambda", "shared_question", "prefix_lm",
                                    "causal_blockwise"])
def test_real_plans_need_few_calls(family):
    """The call count is the number of distinct windows, not of tiles."""
    rng = np.random.default_rng(zlib.crc32(family.encode()))
    seqlens = [300, 170, 64]
    masks = [mask_for(family, n, rng) for n in seqlens]
    plan = build(seqlens, masks, 2, 1, 8, (1, 2), 32, None)
    # full, causal, and sliding bands of the masks' window widths (<= 2 widths per mask family; a device
    # holding sequences with different windows sees each of their bands)
    allowed = max(4, 2 + len({m.window for m in masks if hasattr(m, "window")}))
    tab = plan_tables(plan)
    n_tables = 0
    for direction in ("forward", "backward"):
        for dev in range(plan.n_devices):
            ops, _ = tab.program(direction, dev)
            for op in ops:
                for c in getattr(op, "calls", ()):
                    sched = build_schedule(c.table, c.q_hi - c.q_lo, c.kv_hi - c.kv_lo)
                    windows = {call.window for call in sched.calls}
                    assert len(sched.calls) == len(windows)
                    assert len(windows) <= allowed, (family, windows)
                    n_tables += 1
    assert n_tables > 0


# ------------------------------------------------------------------------------------- the kernels
def _ulp(x: float, dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps * x


@settings(max_examples=n_examples(100, 1000), **SETTINGS)
@given(pb=problems(dtypes=(torch.float64, torch.float32, torch.bfloat16, torch.float16)))
def test_varlen_kernels_vs_oracle(pb):
    q, k, v, do, tiles = pb["q"], pb["k"], pb["v"], pb["do"], pb["tiles"]
    dtype = q.dtype
    ora = _oracle(pb)
    lse_in, delta_in = ora["lse"].float(), ora["delta"].float()
    o_ref, lse_ref = reference.attention_forward(q, k, v, tiles)
    g_ref = reference.attention_backward(do, q, k, v, lse_in, delta_in, tiles)
    o, lse = varlen.attention_forward(q, k, v, tiles, ops="emulated")
    g = varlen.attention_backward(do, q, k, v, lse_in, delta_in, tiles, ops="emulated")
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert _err(lse[fin], ora["lse"][fin]) <= 2 * _err(lse_ref[fin], ora["lse"][fin]) + 1e-5
    # the backward sees delta through the carrier (to ~2^-16 relative, formed in fp32 as flash does): the
    # reference given that same delta is as entitled to its error as the one given the exact delta
    cd = torch.float64 if dtype == torch.float64 else torch.float32  # the kernels form delta in this dtype
    carried = (do.to(cd) * varlen._delta_carrier(do, delta_in).to(cd)).sum(-1).t().float()
    g_carried = reference.attention_backward(do, q, k, v, lse_in, carried, tiles)
    for name, ours, mine, other, want in zip(("o", "dq", "dk", "dv"), (o, *g), (o_ref, *g_ref), (o_ref, *g_carried),
                                             (ora["o"], ora["dq"], ora["dk"], ora["dv"])):
        assert ours.dtype == dtype and ours.shape == want.shape
        e_ref = max(_err(mine, want), _err(other, want))
        bound = 2 * e_ref + _ulp(_amax(want), dtype) + SLACK[dtype] * (1 + _amax(want))
        assert _err(ours, want) <= bound, (name, dtype, _err(ours, want), _err(mine, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_delta_carrier_reproduces_delta(dtype):
    gen = torch.Generator().manual_seed(1)
    do = (torch.randn(64, 4, 32, generator=gen) * torch.logspace(-3, 2, 64)[:, None, None]).to(dtype)
    o = torch.randn(64, 4, 32, generator=gen).to(dtype)
    do[3] = 0  # dO = 0 rows: delta = 0
    delta = (do.float() * o.float()).sum(-1).t().contiguous()
    carrier = varlen._delta_carrier(do, delta)
    assert carrier.dtype == dtype
    got = (do.float() * carrier.float()).sum(-1).t()
    assert (carrier != 0).sum(-1).max() <= 2
    rel = ((got - delta).abs() / delta.abs().clamp_min(1e-30)).max()
    assert rel < (2e-6 if dtype == torch.float32 else 1e-4), rel
    assert torch.equal(got[:, 3], torch.zeros(4))


def test_ops_selection():
    assert select_ops(torch.bfloat16, torch.device("cpu"), 64).name == "emulated"
    with pytest.raises(ExecutionError, match="flash kernels need a CUDA device"):
        select_ops(torch.bfloat16, torch.device("cpu"), 64, prefer="torch_flash")
    assert isinstance(select_ops(torch.float32, torch.device("cpu"), 64, prefer="emulated"), EmulatedOps)
    assert get_kernels("varlen").name == "varlen"


def test_cuda_half_inputs_switch_to_varlen(monkeypatch):
    """Executors hand CUDA fp16/bf16 inputs to the varlen kernels when a flash kernel can run them."""
    from dcp.execute import local

    monkeypatch.setattr(local, "gpu_varlen_available", lambda dtype, device, head_dim: True)
    adapter = resolve_kernels("auto")
    assert adapter.for_input(torch.bfloat16, torch.device("cuda"), 128).name == "varlen"
    assert adapter.for_input(torch.bfloat16, torch.device("cpu"), 128).name == adapter.kernels.name
    monkeypatch.setattr(local, "gpu_varlen_available", lambda dtype, device, head_dim: False)
    assert adapter.for_input(torch.bfloat16, torch.device("cuda"), 128).name == "reference"
    assert resolve_kernels("reference").for_input(torch.bfloat16, torch.device("cuda"), 128).name == "reference"


# ------------------------------------------------------------------------------- whole plans
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_through_the_executor_bf16(family):
    rng = np.random.default_rng(zlib.crc32(f"{family}varlen".encode()))
    seqlens = [41, 9, 30]
    plan = build(seqlens, [mask_for(family, n, rng) for n in seqlens], 4, 2, 16, (1, 3), 8, 2,
                 dtype="bfloat16")
    inputs, o_ref, _, g_ref = truth(plan, int(rng.integers(0, 1 << 30)))
    executor = ReferenceExecutor(kernels="varlen")
    q, k, v, do = (x.to(torch.bfloat16) for x in inputs)
    o, lse = executor.run_forward(plan, q, k, v)
    grads = executor.run_backward(plan, q, k, v, o, lse, do)
    o_dense, g_dense = dense_low_precision(plan, inputs, torch.bfloat16)
    for name, ours, dense, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_dense, *g_dense), (o_ref, *g_ref)):
        e_ours, e_dense = max_err(ours, ref), max_err(dense, ref)
        bound = 2 * e_dense + max(2e-3, 2 * _ulp(float(ref.abs().max()), torch.bfloat16))
        assert e_ours <= bound, (family, name, e_ours, e_dense)


# --------------------------------------------------------------------------- the GPU run script
def test_gpu_script_runs_on_the_cpu(tmp_path):
    """``benchmarks/bench_gpu.py`` (issue: the GPU run) does every step at tiny sizes on the CPU, so the
    one command meant for a lent GPU is known to run before the GPU is there."""
    import csv
    import sys
    from pathlib import Path

    from dcp.cost.model import load_profile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_gpu

    assert bench_gpu.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "gpu_cpu.csv")))
    steps = {r["step"] for r in rows}
    assert steps == {"ceilings", "correct", "tiles", "fused", "merge", "calibrate"}
    checks = [r for r in rows if r["step"] == "correct"]
    assert len(checks) == 4 * 9 and all(r["passed"] == "True" for r in checks)
    assert all(float(r["value"]) > 0 for r in rows if r["metric"] in ("TFLOPS", "GB/s"))
    prof = load_profile(str(tmp_path / "gpu_cpu_profile.json"))
    assert prof.attn_fwd_tflops > 0 and prof.half_rows > 0 and 0 < prof.partial_tile_efficiency <= 1
