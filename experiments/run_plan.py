"""Run one dcp plan on every rank: torchrun --nproc-per-node 4 experiments/run_plan.py [--plan-on every]

Each process is one device of the plan (gloo on CPU, NCCL with CUDA). By default rank 0 plans and
dcp.broadcast_plan ships its plan to the others; --plan-on every plans on every rank instead, which is
fine when planning is deterministic (the ranks prove they agree before any transfer, and raise
dcp.PlanMismatchError, naming the ranks that differ, when they do not).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcp  # noqa: E402
from dcp.masks import CausalMask, LambdaMask  # noqa: E402


def main(argv=None) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--plan-on", choices=("rank0", "every"), default="rank0")
    plan_on = args.parse_args(argv).plan_on
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")

    # the batch: 4 sequences, each with its own mask; one plan device per rank
    spec = dcp.BatchSpec([3000, 1200, 700, 96], [CausalMask(), LambdaMask(sink=16, window=256), CausalMask(),
                         CausalMask()], num_heads=4, num_kv_heads=2, head_dim=64, dtype="float32")
    cluster = dcp.Cluster(nodes=1, gpus_per_node=world)
    config = dcp.PlannerConfig(block_size=256)
    if plan_on == "every":
        plan = dcp.plan(spec, cluster, config)
    else:
        plan = dcp.broadcast_plan(dcp.plan(spec, cluster, config) if rank == 0 else None, src=0)

    # every rank holds the rows of its home token blocks (a model computes them from its own tokens;
    # here the same random batch is drawn on every rank and dispatched)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(spec.total_tokens, h, spec.head_dim, generator=g).to(device) for h in (4, 2, 2))
    q_local, k_local, v_local = (dcp.dispatch(plan, rank, x).requires_grad_() for x in (q, k, v))
    o_local = dcp.attention(q_local, k_local, v_local, plan)  # differentiable, transfers under it
    o_local.square().sum().backward()                          # gradients of this rank's rows

    # check against dense attention of the whole batch, gathered on rank 0
    outs = [None] * world
    dist.all_gather_object(outs, o_local.detach().cpu())
    if rank == 0:
        err = (dcp.undispatch(plan, outs) - dcp.reference_attention(q.cpu(), k.cpu(), v.cpu(), spec)).abs().max()
        print(f"{world} ranks ran {plan!r} (planned on {plan_on}): max |o - dense| = {float(err):.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
