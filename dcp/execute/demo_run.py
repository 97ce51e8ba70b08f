"""The execution check of ``dcp demo``: plan a small mixed batch, run it on several CPU processes over
gloo (forward and backward through ``dcp.attention``), and compare every rank's output and q/k/v
gradients with dense fp64 attention of the whole batch, sliced by the plan's own token map.

The batch is deliberately small (an 8,192-token budget): the demo's planned batch (~115K tokens, 32
devices) would take a CPU minutes per attention layer and cannot run on 4 processes as planned for 32."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SMALL_TOKENS = 8192   # token budget of the checked batch: small enough for a CPU to run in seconds
TOLERANCE = 1e-4      # fp32 executor vs dense fp64 attention


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(spec, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = spec.total_tokens
    q = torch.randn(t, spec.num_heads, spec.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=g, dtype=torch.float64)
    do = torch.randn(t, spec.num_heads, spec.head_dim, generator=g, dtype=torch.float64)
    return q, k, v, do


def _worker(rank: int, world: int, port: int, plan_bytes: bytes, outdir: str) -> None:
    import dcp
    from dcp.execute import attention, dispatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        plan = dcp.Plan.from_bytes(plan_bytes)
        q, k, v, do = (x.to(torch.float32) for x in _inputs(plan.spec, seed=0))
        local = [dispatch(plan, rank, x).clone().requires_grad_(i < 3) for i, x in enumerate((q, k, v, do))]
        started = time.perf_counter()
        o = attention(local[0], local[1], local[2], plan, timeout=60)
        o.backward(local[3])
        elapsed = time.perf_counter() - started
        out = {"o": o.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad, "s": elapsed}
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class SmallRun:
    """What the execution check ran and how close it came to dense attention."""

    num_seqs: int
    tokens: int
    world_size: int
    nodes: int
    gpus_per_node: int
    masks: str
    dtype: str
    errors: dict            # max |error| of o, dq, dk, dv against dense fp64 attention, over all ranks
    slowest_s: float        # slowest rank's forward + backward
    tolerance: float = TOLERANCE

    @property
    def worst(self) -> float:
        return max(self.errors.values())

    @property
    def ok(self) -> bool:
        return self.worst < self.tolerance

    def summary(self) -> str:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in self.errors.items())
        return (f"{self.num_seqs} sequences, {self.tokens:,} tokens ({self.masks}), {self.dtype}, planned for "
                f"{self.nodes} x {self.gpus_per_node} devices and run on {self.world_size} CPU processes (gloo), "
                f"forward and backward: max |error| vs dense fp64 attention {self.worst:.1e} ({errs}) -> "
                f"{'OK' if self.ok else 'MISMATCH'} (tolerance {self.tolerance:g}); slowest rank "
                f"{self.slowest_s:.2f} s")


def run_small_batch(world_size: int = 4, seed: int = 0) -> SmallRun:
    """Plan a small mixed batch (an 8,192-token budget of LDC-like lengths scaled by 1/16, alternating
    causal and lambda masks, fp32), run it on ``world_size`` gloo processes, compare with dense fp64."""
    import dcp
    from dcp.data import make_batches
    from dcp.execute import dispatch, reference_attention
    from dcp.masks import CausalMask, LambdaMask

    lens = make_batches("ldc", 1.0 / 16, tokens_per_batch=SMALL_TOKENS, num_batches=1, seed=seed)[0]
    masks = [CausalMask() if i % 2 == 0 else LambdaMask(sink=16, window=256) for i in range(len(lens))]
    spec = dcp.BatchSpec(lens, masks, 4, 2, 64, dtype="float32")
    cluster = dcp.Cluster(2, world_size // 2) if world_size % 2 == 0 else dcp.Cluster(1, world_size)
    plan = dcp.plan(spec, cluster, dcp.PlannerConfig(block_size=256))
    q, k, v, do = _inputs(spec, seed=0)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    o_ref = reference_attention(qr, kr, vr, spec)
    o_ref.backward(do)
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(world_size, _free_port(), plan.to_bytes(), outdir), nprocs=world_size,
                           join=True, start_method="spawn")
        results = []
        for r in range(world_size):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    err = {name: 0.0 for name in ("o", "dq", "dk", "dv")}
    for r, res in enumerate(results):
        for name, ref in (("o", o_ref.detach()), ("dq", qr.grad), ("dk", kr.grad), ("dv", vr.grad)):
            want = dispatch(plan, r, ref)
            if want.numel():
                err[name] = max(err[name], float((res[name].double() - want).abs().max()))
    return SmallRun(spec.num_seqs, spec.total_tokens, world_size, cluster.nodes, cluster.gpus_per_node,
                    "causal and lambda masks", "fp32", err, max(r["s"] for r in results))
