"""Train a transformers model with dcp attention: torchrun --nproc-per-node 2 experiments/hf_example.py

A complete packed-sequence training loop: a small Llama built from a transformers config (random init,
nothing downloaded), random token sequences of varied lengths, one process per plan device (gloo on CPU,
NCCL with CUDA). The lines marked "# dcp" are what dcp changes in a plain transformers loop.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcp  # noqa: E402  # dcp
from dcp.integration import DCPLoader, hf as dcp_hf  # noqa: E402  # dcp


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # share the cores, do not oversubscribe

    dcp_hf.register()                                                                   # dcp
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dcp").to(device)  # dcp: was "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # the data: the same stream of token-id sequences on every rank (here counting up from a random
    # start, 16..400 tokens: learnable, so the loss falls)
    rng = np.random.default_rng(0)
    token_id_arrays = [(rng.integers(cfg.vocab_size) + np.arange(n)) % cfg.vocab_size
                       for n in rng.integers(16, 400, 40)]
    loader = DCPLoader(token_id_arrays, dcp.Cluster(1, world_size),                     # dcp: was a DataLoader
                       dcp.PlannerConfig(block_size=64), 1024, **dcp_hf.batch_geometry(model), device=device)
    for step, batch in enumerate(loader):                      # each rank gets its home tokens and the plan
        loss = model(**dcp_hf.model_inputs(batch)).loss                                 # dcp: was model(**batch)
        loss.backward()
        dcp_hf.sum_gradients(model)                                                     # dcp: instead of DDP
        opt.step()
        opt.zero_grad()
        total = loss.detach()
        dist.all_reduce(total)  # each rank's loss is its share of the batch mean
        if rank == 0:
            print(f"step {step}: loss {float(total):.3f} ({batch.num_tokens} tokens, {batch.n_local} on rank 0)")
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":  # the loader's planner is a spawned process: guard the entry point
    main()
