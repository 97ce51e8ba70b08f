"""flash-attn's varlen call on every rank, run as a dcp plan: torchrun --nproc-per-node 2 experiments/varlen_example.py

Without torchrun, ``python experiments/varlen_example.py --nproc 2`` spawns the gloo ranks itself (CPU).
Each rank plans the packed batch once (``dcp.varlen_plan``: rank 0 plans, every rank gets its plan),
keeps its home rows (``dcp.dispatch``), runs ``dcp.varlen_attention(q, k, v, cu_seqlens, causal=True)``
forward and backward, and checks its rows of the output and of the q/k/v gradients against dense
attention of the whole batch. Exits non-zero when they differ by more than ``--tolerance``.
"""
from __future__ import annotations

import argparse
import itertools
import os
import socket
import sys
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcp  # noqa: E402


@dataclass(frozen=True)
class ExampleConfig:
    """The batch, the attention geometry and the run."""

    lengths: tuple[int, ...] = (1200, 400, 200, 64)  # tokens per sequence of the packed batch
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    window: int = -1          # flash's window_size=(window, 0): keys [i - window, i]; -1: plain causal
    block_size: int = 128     # dcp's token block: the unit a plan places on a rank
    nproc: int = 2            # ranks to spawn when not started by torchrun
    seed: int = 0
    tolerance: float = 1e-4   # float32 against float64 dense attention


def run(rank: int, world: int, cfg: ExampleConfig, device: torch.device) -> float:
    """One rank: plan, dispatch, attention forward + backward; the largest error against dense attention."""
    cu_seqlens = torch.tensor([0, *itertools.accumulate(cfg.lengths)], dtype=torch.int32)  # the GLOBAL batch
    total = int(cu_seqlens[-1])
    flash = dict(causal=True, window_size=(cfg.window, 0))  # flash_attn_varlen_func's mask arguments
    config = dcp.PlannerConfig(block_size=cfg.block_size)

    # once per batch, on every rank (rank 0 plans and shares the plan; it is cached for the layers below)
    plan = dcp.varlen_plan(cu_seqlens, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, dtype=torch.float32, config=config, **flash)

    # the same random batch on every rank; each keeps its home rows (a model dispatches its token ids and
    # positions the same way, and computes q, k, v of its own rows)
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v = (torch.randn(total, h, cfg.head_dim, generator=g)
               for h in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
    q_local, k_local, v_local = (dcp.dispatch(plan, rank, x).to(device).requires_grad_() for x in (q, k, v))

    # in every attention layer: flash-attn's call on the home rows (finds the cached plan)
    o_local = dcp.varlen_attention(q_local, k_local, v_local, cu_seqlens, config=config, **flash)
    o_local.square().sum().backward()

    # dense float64 attention of the whole batch, and this rank's rows of it
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = dcp.reference_attention(*leaves, plan.spec)
    o_ref.square().sum().backward()
    pairs = [(o_local, o_ref), (q_local.grad, leaves[0].grad), (k_local.grad, leaves[1].grad),
             (v_local.grad, leaves[2].grad)]
    err = max(float((got.detach().double().cpu() - dcp.dispatch(plan, rank, want.detach())).abs().max())
              for got, want in pairs)
    worst = torch.tensor([err], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        stats = plan.stats()
        print(f"{world} ranks ran varlen_attention over {plan!r}: {stats.comm_bytes_total:,} bytes moved, "
              f"max |o, dq, dk, dv - dense| = {float(worst):.1e}")
    return float(worst)


def _main_rank(rank: int, world: int, cfg: ExampleConfig, device: torch.device) -> None:
    worst = run(rank, world, cfg, device)
    dist.destroy_process_group()
    if not worst <= cfg.tolerance:
        raise SystemExit(f"rank {rank}: varlen_attention differs from dense attention by {worst:.2e}")


def _spawned(rank: int, world: int, port: int, cfg: ExampleConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _main_rank(rank, world, cfg, torch.device("cpu"))


def parse(argv=None) -> ExampleConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = ExampleConfig()
    for f in fields(ExampleConfig):
        value = getattr(defaults, f.name)
        if isinstance(value, tuple):
            parser.add_argument(f"--{f.name}", type=int, nargs="+", default=list(value))
        else:
            parser.add_argument(f"--{f.name}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    return ExampleConfig(**{**args, "lengths": tuple(args["lengths"])})


def main(argv=None) -> None:
    cfg = parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        _main_rank(dist.get_rank(), dist.get_world_size(), cfg, device)
        return
    with socket.socket() as s:  # a free local port for the spawned gloo ranks
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(cfg.nproc, port, cfg), nprocs=cfg.nproc)


if __name__ == "__main__":
    main()
