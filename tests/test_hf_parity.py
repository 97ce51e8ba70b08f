"""transformers models trained with dcp attention on 4 gloo processes == transformers' own attention on 1.

Model families nobody here wrote (transformers' Llama, Qwen2, StableLM, whose decoder layers do not hand the
plan down, and Gemma 3, alternating sliding-window and full layers, planned with layer kinds; built from
small configs, random init) train for 5 steps on the same packed batches, twice each:
- dcp: 4 processes, each running the unmodified model on its home tokens with ``attn_implementation="dcp"``
  and the plan broadcast by ``DCPLoader``; losses and gradients summed over ranks;
- reference: 1 process, the batch packed by transformers' ``DataCollatorWithFlattening`` and run through
  transformers' SDPA (causal masks, from the packed position ids) or eager attention with a dense additive
  mask (sparse masks: lambda and causal-blockwise, alternating per sequence).
fp32 losses agree within 1e-5 relative at every step and every parameter's first-step gradient within
rtol 1e-5 (atol 1e-7 for entries near zero). A fifth case packs one 40-token sequence per batch (two token
blocks at most on four devices) under a loose memory budget (``epsilon_memory=10``: dcp may keep it
whole), so ranks are idle at every step and run a placeholder token.
"""
from __future__ import annotations

import pytest
import torch
from _spawn import run_ranks

from dcp.bench.args import MaskArg
from experiments.train_hf import HFTrainConfig, train

STEPS = 5
BASE = HFTrainConfig(steps=STEPS, seed=3, tokens_per_batch=512, layers=2, hidden=32, heads=4, kv_heads=2,
                     intermediate=64, vocab=64, block_size=32, length_scale=0.1, min_len=8, lr=3e-3, planner="inline",
                     lookahead=0, threads=1, grad_steps=(0,), peer_timeout_s=30.0, quiet=True)
SPARSE = (MaskArg.of("lambda", sink=2, window=12), MaskArg.of("causal_blockwise", block=8, num_prev=1))
CASES = {  # name -> (dcp config, the reference's attention)
    "llama-causal": (HFTrainConfig(**{**BASE.__dict__, "family": "llama"}), "sdpa"),
    "qwen2-causal": (HFTrainConfig(**{**BASE.__dict__, "family": "qwen2"}), "sdpa"),
    "llama-sparse": (HFTrainConfig(**{**BASE.__dict__, "family": "llama", "masks": SPARSE}), "eager"),
    "qwen2-sparse": (HFTrainConfig(**{**BASE.__dict__, "family": "qwen2", "masks": SPARSE}), "eager"),
    # its decoder layers do not hand the plan down: train_hf passes it by dcp_hf.plan_context
    "stablelm-causal": (HFTrainConfig(**{**BASE.__dict__, "family": "stablelm"}), "sdpa"),
    # alternating 16-token-window and full layers: a LayeredPlan per batch
    "gemma3-layered": (HFTrainConfig(**{**BASE.__dict__, "family": "gemma3"}), "sdpa"),
    "qwen2-idle-ranks": (HFTrainConfig(**{**BASE.__dict__, "family": "qwen2", "tokens_per_batch": 40, "min_len": 40,
                                          "length_scale": 0.001, "epsilon_memory": 10.0}), "sdpa"),
}


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    out = {}
    for name, (cfg, _) in cases.items():  # one process group for every case: one spawn
        res = train(cfg, rank, world)
        out[name] = {"losses": res.losses, "grads": res.grads[0], "tokens": [r["tokens"] for r in res.records],
                     "local_tokens": [r["local_tokens"] for r in res.records],
                     "split": [r["split_sequences"] for r in res.records], "moved": [r["moved_bytes"] for r in res.records]}
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(_rank_main, 4, tmp_path_factory.mktemp("hf"), CASES, deadline_s=150.0, group_timeout_s=60.0)


@pytest.mark.parametrize("case", list(CASES))
def test_four_processes_match_transformers_on_one(case, four_ranks, one_intra_op_thread):
    cfg, reference_attn = CASES[case]
    ref = train(HFTrainConfig(**{**cfg.__dict__, "attn": reference_attn}))
    base = ref.losses
    assert len(base) == STEPS and (base[-1] < base[0] or case.endswith("idle-ranks"))  # 40-token batches: noisy
    outs = [r[case] for r in four_ranks]
    for r, out in enumerate(outs):
        assert out["tokens"] == [rec["tokens"] for rec in ref.records]  # the same batches
        torch.testing.assert_close(torch.tensor(out["losses"], dtype=torch.float64),
                                   torch.tensor(base, dtype=torch.float64), rtol=1e-5, atol=0.0,
                                   msg=lambda m: f"{case}, rank {r}: losses {out['losses']} vs 1 process {base}: {m}")
    # the ranks' home tokens make up every batch; every rank trained on some (the split is real), or, in the
    # idle case, some rank had none at every step
    local = torch.tensor([o["local_tokens"] for o in outs])  # [rank, step]
    assert local.sum(0).tolist() == outs[0]["tokens"]
    if case.endswith("idle-ranks"):
        assert ((local == 0).sum(0) >= 1).all(), f"{case}: no rank was idle: {local.tolist()}"
    else:
        assert (local.sum(1) > 0).all(), f"{case}: a rank never had tokens: {local.tolist()}"
        # the plans of most steps cut a sequence over ranks and moved data (not plans that kept each whole)
        crossing = [s > 0 and m > 0 for s, m in zip(outs[0]["split"], outs[0]["moved"])]
        assert sum(crossing) >= STEPS // 2 + 1, (case, outs[0]["split"], outs[0]["moved"])
    g1 = ref.grads[0]
    assert set(outs[0]["grads"]) == set(g1) and len(g1) > 10
    for name, g in g1.items():
        assert g.abs().max() > 0, f"{case}: the reference gradient of {name} is zero"
        for r, out in enumerate(outs):
            torch.testing.assert_close(out["grads"][name], g, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{case}, rank {r}, gradient of {name}: {m}")
