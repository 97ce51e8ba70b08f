"""Fine-tune a Hugging Face transformers causal LM, built from a config, on synthetic packed data with dcp.

    python experiments/train_hf.py --family llama --steps 20                     # 1 process, dcp attention
    python experiments/train_hf.py --family qwen2 --attn sdpa --steps 20         # 1 process, transformers' own
    torchrun --nproc-per-node 4 experiments/train_hf.py --family qwen2 --mask lambda --mask-param sink=4 \\
        --mask-param window=64

The model is ``AutoModelForCausalLM.from_config`` of a small Llama- or Qwen2-style config written below
(random init, nothing downloaded); its code is transformers' own, unmodified. With ``--attn dcp`` each
process is one plan device (gloo on CPU, NCCL on GPU): ``DCPLoader`` forms and plans token-budget batches,
the model runs on the rank's home tokens through ``dcp.integration.hf``, and the ranks' gradients are
summed. With ``--attn sdpa|eager`` (one process) the same batches
go through transformers' own padding-free path instead: ``DataCollatorWithFlattening`` packs the batch's
sequences, and a batch with non-causal masks gets them as a dense additive 4-D mask. That is the
reference the parity tests compare dcp against.

Masks: ``--mask NAME`` with ``--mask-param KEY=VALUE`` after it (the syntax of ``dcp plan``), ``--mask``
repeatable: samples take the masks in turn (one mask per sequence). ``NAME:key=value,...`` still parses,
with a deprecation warning, for one release.
Data: ``experiments.train_gpt.synthetic_samples`` (phrase chains, half with a repeated n-gram).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make ``dcp`` and ``experiments`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcp  # noqa: E402
from dcp.bench.args import MaskArg, add_mask_args, masks_from_args  # noqa: E402
from dcp.integration import DCPBatch, DCPLoader, Sample, WorkerConfig  # noqa: E402
from dcp.integration import hf as dcp_hf  # noqa: E402
from experiments.train_gpt import (SMALL_MASK_DEFAULTS, Progress, TrainConfig, TrainResult,  # noqa: E402
                                   broadcast_parameters, finish, plan_crossing, run_torchrun, share_cores, synthetic_samples)

FAMILIES = ("llama", "qwen2", "gpt_oss", "gemma3", "stablelm")
#: families whose layers alternate sliding-window and full attention (dcp plans them with layer kinds)
LAYERED = {"gpt_oss": 16, "gemma3": 16}  # family -> sliding window
ATTENTIONS = ("dcp", "sdpa", "eager")


@dataclass(frozen=True)
class HFTrainConfig:
    """One run (the command-line flags; see ``parse_args``)."""

    family: str = "llama"
    attn: str = "dcp"  # dcp | sdpa | eager (the last two: one process, transformers' own attention)
    steps: int = 20
    seed: int = 0
    tokens_per_batch: int = 1024
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 256
    block_size: int = 64
    epsilon_memory: float = 0.1  # dcp's memory budget (resident tokens per rank <= (1 + this) x mean)
    masks: tuple = ("causal",)  # a name or a MaskArg per sample, in turn
    distribution: str = "megatron_mock"
    length_scale: float = 0.25
    min_len: int = 8
    lr: float = 1e-3
    dtype: str = "float32"
    planner: str = "process"  # process | inline
    lookahead: int = 1
    kernels: str | None = None
    peer_timeout_s: float | None = 120.0
    threads: int | None = None
    grad_steps: tuple = ()  # steps whose (summed) gradients are returned in TrainResult.grads
    log_json: str | None = None
    quiet: bool = False


# --------------------------------------------------------------------------------------------- model, data
def model_config(cfg: HFTrainConfig):
    """A small transformers config of ``cfg.family``: Llama (untied head, no biases) or Qwen2 (q/k/v biases,
    tied embeddings), both RoPE + GQA + SwiGLU + RMSNorm; gpt-oss (alternating sliding-window and full layers,
    sinks, mixture of experts) and Gemma 3 (sliding and full layers), planned with layer kinds; StableLM,
    whose decoder layers do not hand the plan down (``dcp_hf.plan_context`` gives it)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                  max_position_embeddings=max(2048, cfg.tokens_per_batch), attention_dropout=0.0)
    if cfg.family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if cfg.family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    from transformers import Gemma3TextConfig, GptOssConfig, StableLmConfig

    types = ["sliding_attention", "full_attention"] * (cfg.layers // 2) + ["sliding_attention"] * (cfg.layers % 2)
    head_dim = cfg.hidden // cfg.heads
    if cfg.family == "gpt_oss":  # alternating 16-token window and full layers, attention sinks, 4 experts
        common.pop("intermediate_size")
        return GptOssConfig(**common, intermediate_size=cfg.intermediate // 4, head_dim=head_dim, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=LAYERED["gpt_oss"], layer_types=types,
                            tie_word_embeddings=False,
                            rope_parameters={"rope_type": "yarn", "factor": common["max_position_embeddings"] / 512,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 512, "rope_theta": 10000.0})
    if cfg.family == "gemma3":
        return Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=LAYERED["gemma3"], layer_types=types,
                                query_pre_attn_scalar=head_dim)
    if cfg.family == "stablelm":  # its decoder layers drop **kwargs: the plan arrives by dcp_hf.plan_context
        return StableLmConfig(**common)
    raise SystemExit(f"--family must be one of {FAMILIES}, got {cfg.family!r}")


def parse_mask(entry: "str | MaskArg") -> dcp.masks.Mask:
    """A name or ``MaskArg`` -> a dcp mask (defaults sized for short sequences fill parameters not given)."""
    return MaskArg.parse(entry).build(SMALL_MASK_DEFAULTS)


def samples(cfg: HFTrainConfig) -> Iterator[Sample]:
    """The seed-determined synthetic stream, identical on every rank, each sample with the next mask in turn."""
    masks = [parse_mask(m) for m in cfg.masks]
    data = TrainConfig(seed=cfg.seed, vocab=cfg.vocab, distribution=cfg.distribution, length_scale=cfg.length_scale,
                       min_len=cfg.min_len)
    for i, s in enumerate(synthetic_samples(data)):
        yield Sample(s.tokens, masks[i % len(masks)], s.sample_id)


def reference_inputs(batch: DCPBatch, dtype: torch.dtype) -> dict:
    """The whole batch of a one-process loader as transformers packs it without dcp: its sequences through
    ``DataCollatorWithFlattening`` (input_ids/position_ids/labels ``[1, T]``, labels shifted inside the model),
    plus a dense additive ``[1, 1, T, T]`` mask when a sequence's mask is not causal."""
    from transformers import DataCollatorWithFlattening

    plan = batch.plan
    if plan.n_devices != 1 or not np.array_equal(plan.local_token_index(0), np.arange(batch.num_tokens)):
        raise ValueError("reference inputs need the whole batch in packing order (a one-process loader)")
    sequences = np.split(batch.tokens.cpu().numpy(), plan.spec.cu_seqlens[1:-1])
    inputs = DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in sequences], return_tensors="pt")
    if not all(isinstance(m, dcp.masks.CausalMask) for m in plan.spec.masks):
        inputs["attention_mask"] = dcp_hf.dense_attention_mask(plan.spec, dtype)
    # use_cache=False: with a cache transformers skips its packed-sequence detection (sequences would see
    # each other); training wants no cache anyway
    return {"use_cache": False, **{k: v.to(batch.tokens.device) for k, v in inputs.items()}}


# --------------------------------------------------------------------------------------------- training
def train(cfg: HFTrainConfig, rank: int = 0, world_size: int = 1, group=None,
          device: torch.device | None = None) -> TrainResult:
    """Run ``cfg.steps`` steps on this rank (torch.distributed must be initialized when ``world_size > 1``)."""
    from transformers import AutoModelForCausalLM

    if cfg.attn not in ATTENTIONS or (cfg.attn != "dcp" and world_size > 1):
        raise SystemExit(f"--attn must be one of {ATTENTIONS}; sdpa/eager (the reference) run on one process")
    if cfg.attn != "dcp" and cfg.family == "gpt_oss":
        # transformers' gpt-oss builds its masks without position_ids: packed sequences would see each other
        raise SystemExit("--family gpt_oss runs with --attn dcp only (transformers' own gpt-oss attention does not "
                         "separate packed sequences; tests/test_hf_layers.py checks it against dense dcp masks)")
    device = device or torch.device("cpu")
    share_cores(cfg.threads, world_size)
    dtype = getattr(torch, cfg.dtype)
    if cfg.attn == "dcp":
        dcp_hf.register(group=group, kernels=cfg.kernels, timeout=cfg.peer_timeout_s)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(model_config(cfg), attn_implementation=cfg.attn)
    model.to(device=device, dtype=dtype).train()
    if world_size > 1:
        broadcast_parameters(model.parameters(), group)
    planner_config = dcp.PlannerConfig(block_size=cfg.block_size, partitioner=dcp.GreedyPartitioner(), seed=cfg.seed,
                                       time_budget_s=None, epsilon_memory=cfg.epsilon_memory)
    loader = DCPLoader(samples(cfg), dcp.Cluster(1, world_size), planner_config, cfg.tokens_per_batch,
                       **dcp_hf.batch_geometry(model), rank=rank, world_size=world_size, group=group,
                       lookahead=cfg.lookahead, worker=WorkerConfig(mode=cfg.planner), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    result = TrainResult()
    progress = Progress(cfg.steps, 1, enabled=rank == 0 and not cfg.quiet)
    t_prev = time.perf_counter()
    batches = iter(loader)
    try:
        for step in range(cfg.steps):
            batch = next(batches)
            inputs = dcp_hf.model_inputs(batch) if cfg.attn == "dcp" else reference_inputs(batch, dtype)
            opt.zero_grad(set_to_none=True)
            with dcp_hf.plan_context(batch.plan) if cfg.attn == "dcp" else contextlib.nullcontext():
                loss = model(**inputs).loss
                loss.backward()
            dcp_hf.sum_gradients(model, group)
            total = loss.detach().clone()
            if world_size > 1:
                dist.all_reduce(total, group=group)
            if step in cfg.grad_steps:
                result.grads[step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            now = time.perf_counter()
            step_s, t_prev = now - t_prev, now
            result.records.append({"step": step, "loss": float(total), "tokens": batch.num_tokens, "step_s": step_s,
                                   "tokens_per_s": batch.num_tokens / step_s, "waited_s": batch.waited_s,
                                   "sequences": len(batch.sample_ids), "local_tokens": batch.n_local,
                                   **plan_crossing(batch.plan)})
            progress.update(step, cfg.steps, f"loss {float(total):.4f}  tok/s {batch.num_tokens / step_s:,.0f}")
    finally:
        progress.close()
        batches.close()
        loader.close()
    return finish(result, loader, cfg, rank, world_size)


# --------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> HFTrainConfig:
    d = HFTrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--family", choices=FAMILIES, default=d.family)
    ap.add_argument("--attn", choices=ATTENTIONS, default=d.attn,
                    help="dcp, or transformers' own sdpa/eager on one process (the reference)")
    for name in ("steps", "seed", "tokens_per_batch", "layers", "hidden", "heads", "kv_heads", "intermediate",
                 "vocab", "block_size", "min_len", "lookahead"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("length_scale", "lr", "epsilon_memory"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    add_mask_args(ap, default=d.masks[0], several=True)
    ap.add_argument("--distribution", default=d.distribution, help="dcp.data length distribution")
    ap.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=d.dtype)
    ap.add_argument("--planner", choices=("process", "inline"), default=d.planner)
    ap.add_argument("--kernels", default=d.kernels, help="dcp.kernels backend (auto, native, reference)")
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--log-json", default=d.log_json, help="write per-step loss and tokens/s here")
    ap.add_argument("--quiet", action="store_true")
    ns = ap.parse_args(argv)
    try:
        masks = tuple(masks_from_args(ns, several=True))
    except dcp.DcpError as err:
        ap.error(str(err))
    a = {k: v for k, v in vars(ns).items() if k not in ("mask", "mask_param", "mask_list", "mask_pending")}
    return replace(d, masks=masks, **a)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    rank, world, result = run_torchrun(lambda rank, world, device: train(cfg, rank, world, None, device))
    if rank == 0 and not cfg.quiet:
        print(f"done: {cfg.family} with {cfg.attn} attention, {len(result.records)} steps on {world} process(es); "
              f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; rejected samples: {len(result.rejected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
