"""Tiny transformers models built from configs (nothing downloaded) and one dcp training step of each, for
``tests/test_hf_layers.py``: gpt-oss (alternating sliding/full layers, sinks, MoE), Gemma 3 (sliding/full by
``sliding_window_pattern``) and StableLM (decoder layers that drop ``**kwargs``: ``plan_context``).

Plans come from zigzag ring attention (``zigzag_plan_bytes``, the planner worker's ``plan_fn``): a placement
that does not depend on the masks, so one placement serves every layer kind (``LayeredPlan``), and one that
splits every sequence over every rank, so each step moves data."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import dcp
from dcp.baselines import ZigzagPlanner
from dcp.integration import DCPLoader, Sample, WorkerConfig
from dcp.integration import hf as dcp_hf
from dcp.ir.layered import LayeredPlan
from dcp.masks import CausalMask, LambdaMask

WINDOW = 8
FAST = dcp.PlannerConfig(block_size=16, partitioner=dcp.GreedyPartitioner(), time_budget_s=None)
COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attention_dropout=0.0)


def model_config(family: str):
    """A tiny config of ``family``: "gptoss", "gemma3" or "stablelm"."""
    from transformers import Gemma3TextConfig, GptOssConfig, StableLmConfig

    if family == "gptoss":  # layer_types: sliding, full, sliding, full
        return GptOssConfig(**COMMON, intermediate_size=32, num_hidden_layers=4, head_dim=8, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=WINDOW,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 64,
                                             "rope_theta": 10000.0})
    if family == "gemma3":  # sliding_window_pattern 2: sliding, full, sliding, full
        return Gemma3TextConfig(**COMMON, intermediate_size=48, num_hidden_layers=4, head_dim=8,
                                sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=8)
    if family == "stablelm":
        return StableLmConfig(**COMMON, intermediate_size=48, num_hidden_layers=2)
    raise ValueError(family)


def build_model(family: str, attn: str, seed: int = 0):
    """The model with random weights from ``seed`` (gpt-oss's sinks drawn N(0, 1), so that they matter)."""
    from transformers import AutoModelForCausalLM

    if attn.startswith("dcp"):
        dcp_hf.register()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family), attn_implementation=attn).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return model


def zigzag_plan_bytes(description: dict, cluster: dcp.Cluster, config: dcp.PlannerConfig) -> bytes:
    """Planner worker ``plan_fn``: zigzag over all devices, one plan per layer kind of a layered batch."""
    spec = dcp.BatchSpec.from_description(description)
    planner = ZigzagPlanner()
    if spec.layered:
        plans = tuple(planner.plan(spec.for_kind(k), cluster) for k in spec.kinds)
        return LayeredPlan(spec, plans, "zigzag").to_bytes()
    return planner.plan(spec, cluster).to_bytes()


@dataclass(frozen=True)
class Case:
    family: str
    lengths: tuple = (37, 9, 50)
    sparse: bool = False  # sample masks: LambdaMask / causal in turn (else all causal)
    context: bool = False  # run the step inside dcp_hf.plan_context
    planner: str = "zigzag"  # or "dcp": dcp's own planner (the worker's default plan_fn)
    seed: int = 0

    @property
    def dense(self) -> bool:
        """Whether the reference needs dcp's masks densely: sparse samples, or gpt-oss, whose model builds
        its masks without the position ids (transformers 5.23), so packed sequences would see each other."""
        return self.sparse or self.family == "gptoss"

    def masks(self):
        if not self.sparse:
            return [CausalMask()] * len(self.lengths)
        return [LambdaMask(2, 12) if i % 2 == 0 else CausalMask() for i in range(len(self.lengths))]

    def samples(self):
        rng = np.random.default_rng(self.seed)
        return [Sample(rng.integers(0, COMMON["vocab_size"], n), m) for n, m in zip(self.lengths, self.masks())]


def loader(model, case: Case, rank: int = 0, world: int = 1) -> DCPLoader:
    plan_fn = zigzag_plan_bytes if case.planner == "zigzag" else None
    return DCPLoader(case.samples(), dcp.Cluster(1, world), FAST, sum(case.lengths), **dcp_hf.batch_geometry(model),
                     rank=rank, world_size=world, lookahead=0, worker=WorkerConfig(mode="inline", plan_fn=plan_fn))


def crossing(plan) -> dict:
    """``{kind: (split sequences, bytes moved)}`` of a plan (kind "" for a plain ``Plan``)."""
    stats = plan.stats()
    stats = stats if isinstance(stats, dict) else {"": stats}
    return {k: (s.split_sequences, s.comm_bytes_total) for k, s in stats.items()}


def dcp_step(case: Case, rank: int = 0, world: int = 1) -> dict:
    """One training step of ``case`` with dcp attention on this rank: the loss summed over ranks, every
    parameter's summed gradient, the plan's crossing and this rank's token count."""
    model = build_model(case.family, "dcp", case.seed)
    with contextlib.closing(loader(model, case, rank, world)) as batches:
        batch = next(iter(batches))
    with dcp_hf.plan_context(batch.plan) if case.context else contextlib.nullcontext():
        loss = model(**dcp_hf.model_inputs(batch)).loss
        loss.backward()
    dcp_hf.sum_gradients(model)
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return {"loss": float(total), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "crossing": crossing(batch.plan), "n_local": batch.n_local, "kinds": getattr(batch.plan, "kinds", ())}


def reference_step(case: Case, attn: str = "eager", dense: bool | None = None) -> dict:
    """The same step on one process with transformers' own attention on the whole packed batch: masks from the
    packed position ids and the layers' config, or (``dense``; default: ``case.dense``) the batch's dcp masks
    as dense additive masks, one per layer kind."""
    model = build_model(case.family, attn, case.seed)
    with contextlib.closing(loader(model, case)) as batches:
        batch = next(iter(batches))
    inputs = {k: v for k, v in dcp_hf.model_inputs(batch).items() if k != dcp_hf.PLAN_KWARG}
    if dense if dense is not None else case.dense:
        inputs["attention_mask"] = dcp_hf.dense_attention_mask(batch.plan.spec)
    out = model(**inputs)
    out.loss.backward()
    return {"loss": float(out.loss.detach()), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "logits": out.logits.detach()}


def assert_same(got: dict, want: dict, what: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Losses within 1e-5 relative, every gradient within ``rtol``/``atol`` (and present, and not all zero)."""
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (what, got["loss"], want["loss"])
    assert set(got["grads"]) == set(want["grads"]), what
    for name, g in want["grads"].items():
        assert g.abs().max() > 0, f"{what}: the reference gradient of {name} is zero"
        torch.testing.assert_close(got["grads"][name], g, rtol=rtol, atol=atol, msg=lambda m: f"{what}, {name}: {m}")


def repeated_batches(rank: int, world: int) -> list[dict]:
    """Three layered batches, the second the same as the first (a cache hit on every rank): per batch, the
    plan's type and digest, whether it was a cache hit and whether plan bytes moved between ranks."""
    case = Case("gemma3")
    stream = case.samples() + case.samples() + Case("gemma3", lengths=(40, 56), seed=1).samples()
    batches = DCPLoader(stream, dcp.Cluster(1, world), FAST, sum(case.lengths), **dcp_hf.batch_geometry(
        model_config("gemma3")), rank=rank, world_size=world, lookahead=1,
        worker=WorkerConfig(mode="inline", plan_fn=zigzag_plan_bytes))
    out = [{"type": type(b.plan).__name__, "digest": b.plan_digest, "hit": b.cache_hit, "plan": id(b.plan)}
           for b in batches]
    for rec, h in zip(out, batches.history):
        rec["transferred"] = h["transferred"]
    return out


def rank_main(rank: int, world: int, cases: dict) -> dict:
    """``_spawn.run_ranks`` entry: every case's ``dcp_step`` on this rank (one process group for all), and
    ``repeated_batches`` under "_repeated"."""
    steps = {name: dcp_step(case, rank, world) for name, case in cases.items()}
    return {"_repeated": repeated_batches(rank, world), **steps}
