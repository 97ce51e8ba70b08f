"""Train a small GPT on synthetic variable-length data with dcp attention, planned one batch ahead.

    python experiments/train_gpt.py --steps 50                               # 1 process: the baseline
    torchrun --nproc-per-node 4 experiments/train_gpt.py --steps 50 --mask lambda --mask-param window=128 \\
        --log-json run.json

Each process is one device of the plan (gloo on CPU, NCCL when CUDA is available). Every rank reads the
same synthetic sample stream; ``DCPLoader`` forms token-budget batches, plans the next batch in a
background process on rank 0 and broadcasts the plan; each rank runs the model on its home tokens.
The loss of a step is the sum over ranks of each rank's summed token losses divided by the GLOBAL
number of label tokens, and replicated parameters' gradients are summed over ranks, so the loss and the
update equal those of single-process training on the same batch (up to floating-point reordering).

Synthetic data: lengths from a ``dcp.data`` distribution (``--distribution``, scaled by
``--length-scale``); each sample is a chain of short "phrases" from a fixed random vocabulary of
phrases (learnable by next-token statistics), half of the samples additionally repeating one random
n-gram (learnable only through attention), so the loss falls quickly.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make ``dcp`` and ``experiments`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dcp  # noqa: E402
from dcp.bench.args import MaskArg, add_mask_args, masks_from_args  # noqa: E402
from dcp.integration import DCPAttention, DCPLoader, Sample, WorkerConfig, sum_gradients  # noqa: E402
from experiments.gpt import GPT, GPTConfig  # noqa: E402

SMALL_MASK_DEFAULTS = {  # mask parameters that suit the short synthetic sequences
    "lambda": {"sink": 4, "window": 64},
    "sliding_window": {"window": 64},
    "causal_blockwise": {"block": 32, "num_prev": 2},
    "modality": {"text_len": 64, "image_len": 64},
}


@dataclass(frozen=True)
class TrainConfig:
    """One training run (the command-line flags; see ``parse_args``)."""

    steps: int = 50
    seed: int = 0
    tokens_per_batch: int = 2048
    layers: int = 2
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    mlp: str = "swiglu"
    block_size: int = 64
    mask: str = "causal"
    mask_params: tuple = ()  # (("key", "value"), ...): --mask-param KEY=VALUE
    distribution: str = "megatron_mock"
    length_scale: float = 0.25
    min_len: int = 8
    phrases: int = 32
    phrase_len: int = 6
    lr: float = 3e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    dtype: str = "float32"
    partitioner: str = "greedy"  # greedy | mtkahypar | kahypar
    planner: str = "process"  # process | inline
    lookahead: int = 1
    validate_plans: bool = False
    kernels: str | None = None
    peer_timeout_s: float | None = 120.0
    threads: int | None = None
    log_every: int = 10
    log_json: str | None = None
    quiet: bool = False
    grad_steps: tuple = ()  # steps whose (summed) gradients are returned in TrainResult.grads


@dataclass
class TrainResult:
    """Per-step records (loss, tokens, tokens/s, waited_s, ...), gradients of ``grad_steps``, loader stats."""

    records: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)  # step -> {param name: tensor}
    loader_stats: dict = field(default_factory=dict)
    rejected: list = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


# --------------------------------------------------------------------------------------------- data
def plan_crossing(plan: dcp.Plan) -> dict:
    """What a step's plan moves between ranks: ``split_sequences`` (sequences whose tokens live on several
    ranks) and ``moved_bytes`` (forward + backward); distributed tests assert both are non-zero somewhere,
    so that a parity check is not one whose plans kept every sequence whole on one rank. A ``LayeredPlan``
    (a model with layer kinds): the most split sequences of any kind, and the bytes of all kinds."""
    stats = plan.stats()
    kinds = list(stats.values()) if isinstance(stats, dict) else [stats]
    return {"split_sequences": max(s.split_sequences for s in kinds),
            "moved_bytes": sum(s.comm_bytes_total for s in kinds)}


def build_mask(cfg: TrainConfig):
    return MaskArg(cfg.mask, tuple(cfg.mask_params)).build(SMALL_MASK_DEFAULTS)


def synthetic_samples(cfg: TrainConfig) -> Iterator[Sample]:
    """An endless, seed-determined stream of ``Sample``s (ids 0, 1, 2, ...), identical on every rank."""
    from dcp.data import get_distribution

    rng = np.random.default_rng(cfg.seed)
    lengths = get_distribution(cfg.distribution)
    phrases = rng.integers(0, cfg.vocab, (cfg.phrases, cfg.phrase_len))
    mask = build_mask(cfg)
    sid = 0
    while True:
        for n in lengths.sample(256, rng):
            n = max(cfg.min_len, int(round(n * cfg.length_scale)))
            toks = phrases[rng.integers(0, cfg.phrases, n // cfg.phrase_len + 1)].reshape(-1)[:n]
            if rng.random() < 0.5:  # a repeated random n-gram: predictable only by looking back
                k = int(rng.integers(3, 9))
                gram = rng.integers(0, cfg.vocab, k)
                start = int(rng.integers(0, max(1, n // 2)))
                rep = np.tile(gram, (n - start) // k + 1)[: n - start]
                toks = np.concatenate([toks[:start], rep])
            yield Sample(toks.astype(np.int64), mask, sid)
            sid += 1


def planner_config(cfg: TrainConfig) -> dcp.PlannerConfig:
    part = {"greedy": dcp.GreedyPartitioner, "mtkahypar": dcp.MtKaHyParPartitioner,
            "kahypar": dcp.KaHyParPartitioner}[cfg.partitioner]()
    return dcp.PlannerConfig(block_size=cfg.block_size, partitioner=part, seed=cfg.seed,
                             time_budget_s=None if cfg.partitioner == "greedy" else 30.0)


# --------------------------------------------------------------------------------------------- training
def share_cores(threads: int | None, world_size: int) -> None:
    """``threads`` intra-op threads; by default, when distributed, the cores shared among the processes."""
    if threads:
        torch.set_num_threads(threads)
    elif world_size > 1:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def broadcast_parameters(params, group) -> None:
    """Group rank 0's values into every rank's ``params`` (the seed already makes them equal; this makes it
    certain)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        dist.broadcast(p.data, src=src, group=group)


def finish(result: TrainResult, loader: DCPLoader, cfg, rank: int, world_size: int) -> TrainResult:
    """Add the loader's statistics and rejected samples to ``result``; rank 0 writes ``cfg.log_json``."""
    result.loader_stats = loader.stats()
    result.rejected = [(e.sample_id, e.length, e.reason) for e in loader.rejected]
    if rank == 0 and cfg.log_json:
        with open(cfg.log_json, "w") as f:
            json.dump({"config": asdict(cfg), "world_size": world_size, "records": result.records,
                       "loader": result.loader_stats, "rejected": result.rejected}, f, indent=1, default=str)
    return result


class Progress:
    """tqdm when installed, else one printed line every ``every`` steps (rank 0 only)."""

    def __init__(self, total: int, every: int, enabled: bool):
        self.every, self.enabled, self.bar = max(1, every), enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, total: int, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif (step + 1) % self.every == 0 or step == 0 or step + 1 == total:
            print(f"step {step + 1:>5}/{total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(cfg: TrainConfig, rank: int = 0, world_size: int = 1, group=None,
          device: torch.device | None = None) -> TrainResult:
    """Run ``cfg.steps`` steps on this rank (torch.distributed must be initialized when ``world_size > 1``)."""
    device = device or torch.device("cpu")
    cluster = dcp.Cluster(1, world_size)
    loader = DCPLoader(synthetic_samples(cfg), cluster, planner_config(cfg), cfg.tokens_per_batch, cfg.heads,
                       cfg.kv_heads, cfg.dim // cfg.heads, cfg.dtype, rank=rank, world_size=world_size, group=group,
                       lookahead=cfg.lookahead, worker=WorkerConfig(mode=cfg.planner), device=device)
    loader.start()  # the planner process boots while the model is built
    share_cores(cfg.threads, world_size)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    mcfg = GPTConfig(vocab_size=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads,
                     mlp=cfg.mlp)
    attention = DCPAttention(group, kernels=cfg.kernels, timeout=cfg.peer_timeout_s, validate=cfg.validate_plans)
    model = GPT(mcfg, attention).to(device=device, dtype=dtype)
    params = [p for p in model.parameters()]
    if world_size > 1:
        broadcast_parameters(params, group)
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr)
    result = TrainResult()
    progress = Progress(cfg.steps, cfg.log_every, enabled=rank == 0 and not cfg.quiet)
    waited_steps = 0
    t_prev = time.perf_counter()
    batches = iter(loader)
    try:
        for step in range(cfg.steps):
            batch = next(batches)
            logits = model(batch.tokens, batch.positions, batch.plan)
            loss = F.cross_entropy(logits.float(), batch.labels, ignore_index=-100,
                                   reduction="sum") / batch.num_label_tokens
            opt.zero_grad(set_to_none=True)
            loss.backward()
            total = loss.detach().clone()
            if world_size > 1:
                sum_gradients(model, group)
                dist.all_reduce(total, group=group)
            if step in cfg.grad_steps:
                result.grads[step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            now = time.perf_counter()
            step_s, t_prev = now - t_prev, now
            waited = batch.waited_s > 1e-3
            waited_steps += waited
            rec = {"step": step, "loss": float(total), "tokens": batch.num_tokens, "step_s": step_s,
                   "tokens_per_s": batch.num_tokens / step_s, "waited_s": batch.waited_s, "waited": bool(waited),
                   "planning_time_s": batch.planning_time_s, "cache_hit": batch.cache_hit,
                   "sequences": len(batch.sample_ids), "local_tokens": batch.n_local, **plan_crossing(batch.plan)}
            result.records.append(rec)
            share = 100 * waited_steps / (step + 1)
            progress.update(step, cfg.steps, f"loss {rec['loss']:.4f}  tok/s {rec['tokens_per_s']:,.0f}  "
                                             f"waited {waited_steps}/{step + 1} ({share:.0f}%)")
    finally:
        progress.close()
        batches.close()
        loader.close()
    return finish(result, loader, cfg, rank, world_size)


# --------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch, help="token budget of a batch")
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--mlp", choices=("swiglu", "gelu"), default=d.mlp)
    ap.add_argument("--block-size", type=int, default=d.block_size, help="planner token block size")
    add_mask_args(ap, default=d.mask, old_param_flags=("--mask-arg",))  # --mask-arg: deprecated spelling
    ap.add_argument("--distribution", default=d.distribution, help="dcp.data length distribution")
    ap.add_argument("--length-scale", type=float, default=d.length_scale)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default=d.optimizer)
    ap.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=d.dtype)
    ap.add_argument("--partitioner", choices=("greedy", "mtkahypar", "kahypar"), default=d.partitioner)
    ap.add_argument("--planner", choices=("process", "inline"), default=d.planner,
                    help="plan in a background process (default) or inline")
    ap.add_argument("--lookahead", type=int, default=d.lookahead)
    ap.add_argument("--validate-plans", action="store_true")
    ap.add_argument("--kernels", default=d.kernels, help="dcp.kernels backend (auto, native, reference)")
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="torch threads per process (default: cores / processes when distributed)")
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--log-json", default=d.log_json, help="write per-step loss/tokens/s/waited here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        mask = masks_from_args(a)[0]
    except dcp.DcpError as err:
        ap.error(str(err))
    return replace(d, steps=a.steps, seed=a.seed, tokens_per_batch=a.tokens_per_batch, layers=a.layers, dim=a.dim,
                   heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab, mlp=a.mlp, block_size=a.block_size,
                   mask=mask.name, mask_params=mask.params, distribution=a.distribution,
                   length_scale=a.length_scale, lr=a.lr, optimizer=a.optimizer, dtype=a.dtype,
                   partitioner=a.partitioner, planner=a.planner, lookahead=a.lookahead,
                   validate_plans=a.validate_plans, kernels=a.kernels, threads=a.threads, log_every=a.log_every,
                   log_json=a.log_json, quiet=a.quiet)


def run_torchrun(run: Callable[[int, int, torch.device], TrainResult]) -> tuple[int, int, TrainResult]:
    """``(rank, world, run(rank, world, device))`` in a process that torchrun started (or a lone process):
    joins the default process group (NCCL on CUDA, else gloo) when there are several, and leaves it."""
    # torchrun's launch protocol: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR are set by the launcher
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if world > 1:
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    try:
        result = run(rank, world, device)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return rank, world, result


def main(argv=None) -> int:
    cfg = parse_args(argv)
    rank, world, result = run_torchrun(lambda rank, world, device: train(cfg, rank, world, None, device))
    if rank == 0 and not cfg.quiet:
        s = result.loader_stats
        print(f"done: {len(result.records)} steps on {world} process(es); final loss {result.losses[-1]:.4f}; "
              f"steps that waited for a plan: {s['waited_steps']}/{s['steps']} "
              f"(after the first: {100 * s['waited_share_after_first']:.0f}%); mean planning "
              f"{1e3 * s['planning_s_mean']:.1f} ms/batch; rejected samples: {s['rejected']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
