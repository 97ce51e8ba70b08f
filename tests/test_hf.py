"""``dcp.integration.hf`` on one process: registration, the version gate, packed inputs checked against the
plan (a named error for each way to get them wrong), sliding-window layers, and the small helpers.

The multi-process training parity against transformers' own attention is ``tests/test_hf_parity.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import dcp
from dcp.errors import DcpError
from dcp.integration import DCPLoader, Sample, WorkerConfig
from dcp.integration import hf as dcp_hf
from dcp.masks import CausalMask, LambdaMask, SlidingWindowMask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
FAST = dcp.PlannerConfig(block_size=16, partitioner=dcp.GreedyPartitioner(), time_budget_s=None)
SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _model(config, attn="dcp", seed=0):
    dcp_hf.register()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()


def _batch(model, lengths=(21, 5, 30), masks=CausalMask(), seed=0, cluster=dcp.Cluster(1, 1)):
    rng = np.random.default_rng(seed)
    masks = masks if isinstance(masks, (list, tuple)) else [masks] * len(lengths)
    samples = [Sample(rng.integers(0, 50, n), m) for n, m in zip(lengths, masks)]
    loader = DCPLoader(samples, cluster, FAST, sum(lengths), **dcp_hf.batch_geometry(model),
                       worker=WorkerConfig(mode="inline"), rank=0, world_size=1)
    return next(iter(loader))


def _reference(model, batch, attn="sdpa", dense: bool | None = None):
    """Logits, loss and gradients of the same model with transformers' own attention on the whole batch: with
    the plan's masks as a dense mask (``dense``; default: when a mask is not causal), else transformers'
    masks from the packed position ids and the layers' config."""
    model.set_attn_implementation(attn)
    model.zero_grad()
    inputs = {k: v for k, v in dcp_hf.model_inputs(batch).items() if k != dcp_hf.PLAN_KWARG}
    if dense is None:
        dense = not all(isinstance(m, CausalMask) for m in batch.plan.spec.masks)
    if dense:
        inputs["attention_mask"] = dcp_hf.dense_attention_mask(batch.plan.spec)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _dcp(model, batch, **override):
    model.set_attn_implementation("dcp")
    model.zero_grad()
    out = model(**{**dcp_hf.model_inputs(batch), **override})
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a.logits, out_b.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-6, atol=0.0)
    for name, g in grads_b.items():
        torch.testing.assert_close(grads_a[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------- registration
def test_version_gate():
    assert dcp_hf.check_transformers_version() == transformers.__version__
    for ok in ("4.56.2", "4.57.6", "5.0.0", "5.23.0", "5.23.1"):
        assert dcp_hf.check_transformers_version(ok) == ok
    for bad in ("4.56.1", "4.40.0", "5.24.0", "5.24.0.dev0", "6.0.0", "not a version"):
        with pytest.raises(dcp_hf.UnsupportedTransformersError) as info:
            dcp_hf.check_transformers_version(bad)
        assert isinstance(info.value, DcpError) and isinstance(info.value, ImportError)
    assert "tested range" in str(pytest.raises(dcp_hf.UnsupportedTransformersError,
                                               dcp_hf.check_transformers_version, "4.40.0").value)


def test_register_makes_dcp_an_attention_implementation():
    fn = dcp_hf.register()
    from transformers import AttentionInterface

    assert AttentionInterface()["dcp"] is fn
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="dcp")
    assert model.config._attn_implementation == "dcp"
    other = AutoModelForCausalLM.from_config(Qwen2Config(**SMALL), attn_implementation="sdpa")
    other.set_attn_implementation("dcp")
    assert other.config._attn_implementation == "dcp"
    assert dcp_hf.register("dcp_other") is not fn and AttentionInterface()["dcp_other"] is not fn


# ---------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("config", [LlamaConfig(**SMALL), Qwen2Config(**SMALL, tie_word_embeddings=True)],
                         ids=["llama", "qwen2"])
def test_one_device_plan_matches_transformers(config):
    model = _model(config)
    batch = _batch(model)
    _assert_same(_dcp(model, batch), _reference(model, batch, "sdpa"))
    sparse = _batch(model, masks=[LambdaMask(2, 6), CausalMask(), LambdaMask(1, 9)])
    _assert_same(_dcp(model, sparse), _reference(model, sparse, "eager"))


def test_multi_device_plan_on_one_process():
    """mode="single_process": one process runs every device of a 3-device plan on the whole batch."""
    model = _model(LlamaConfig(**SMALL))
    batch = _batch(model)
    plan3 = dcp.plan(batch.plan.spec, dcp.Cluster(1, 3), FAST)
    reference = _reference(model, batch)
    dcp_hf.register("dcp_debug", mode="single_process")
    model.set_attn_implementation("dcp_debug")
    model.zero_grad()
    out = model(**{**dcp_hf.model_inputs(batch), dcp_hf.PLAN_KWARG: plan3})
    out.loss.backward()
    _assert_same((out, {n: p.grad.clone() for n, p in model.named_parameters()}), reference)


def test_sliding_window_layers():
    """Qwen2 with every layer sliding: dcp's SlidingWindowMask(w) is transformers' window w; a causal plan on a
    sequence longer than the window is refused, and accepted on sequences that fit in it."""
    config = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    model = _model(config)
    assert all(layer.self_attn.sliding_window == 8 for layer in model.model.layers)
    batch = _batch(model, masks=SlidingWindowMask(8))
    reference = _reference(model, batch, dense=False)  # transformers' own window, from the layers' config
    _assert_same(_reference(model, batch, dense=True), reference)  # dcp's SlidingWindowMask(8), densely
    plain = _reference(model, _batch(model), dense=True)  # the same tokens, causal without a window
    assert not torch.allclose(reference[0].logits, plain[0].logits, atol=1e-3)
    _assert_same(_dcp(model, batch), reference)
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="SlidingWindowMask\\(8\\)"):
        _dcp(model, _batch(model))
    short = _batch(model, lengths=(8, 3, 7))
    _assert_same(_dcp(model, short), _reference(model, short))


# ---------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_named_errors():
    model = _model(LlamaConfig(**SMALL))
    batch = _batch(model)
    inputs = dcp_hf.model_inputs(batch)
    model.set_attn_implementation("dcp")

    def fails(error, match, **change):
        call = {k: v for k, v in {**inputs, **change}.items() if v is not None}
        with pytest.raises(error, match=match):
            model(**call)

    fails(dcp_hf.PackedInputError, "needs the batch's plan", dcp_plan=None)
    fails(dcp_hf.PackedInputError, "position_ids are not", position_ids=None)  # transformers' default arange
    fails(dcp_hf.PackedInputError, "position_ids are not", position_ids=torch.flip(batch.positions, (0,))[None])
    fails(dcp_hf.PackedInputError, "batch size 1", input_ids=batch.tokens.repeat(2, 1),
          position_ids=batch.positions.repeat(2, 1), labels=None, shift_labels=None)
    half = batch.n_local // 2
    fails(dcp_hf.PackedInputError, "this process runs", input_ids=batch.tokens[None, :half],
          position_ids=batch.positions[None, :half], labels=None, shift_labels=None)
    fails(dcp_hf.PackedInputError, "masks from the plan",
          attention_mask=dcp_hf.dense_attention_mask(batch.plan.spec))
    fails(dcp_hf.PackedInputError, "cu_seq_lens_q", cu_seq_lens_q=torch.tensor([0, 26, batch.num_tokens]))
    model(**inputs, cu_seq_lens_q=torch.from_numpy(batch.plan.spec.cu_seqlens))  # the right ones pass
    fn = dcp_hf.register()
    q, kv = torch.zeros(1, 4, batch.n_local, 8), torch.zeros(1, 2, batch.n_local, 8)
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="soft-capping"):
        fn(model.model.layers[0].self_attn, q, kv, kv, None, softcap=30.0, dcp_plan=batch.plan)
    with pytest.raises(dcp_hf.PackedInputError, match="KV cache"):
        fn(model.model.layers[0].self_attn, q, torch.zeros(1, 2, 3, 8), kv, None, dcp_plan=batch.plan)
    dropout = _model(LlamaConfig(**SMALL, attention_dropout=0.1))
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="dropout"):
        dropout(**inputs)
    dropout.eval()(**inputs)  # no dropout at evaluation


# ---------------------------------------------------------------------------------------- helpers
def test_dense_mask_positions_inputs_geometry():
    spec = dcp.BatchSpec([3, 2], [CausalMask(), LambdaMask(1, 1)], 4, 2, 8, "float32")
    allowed = dcp_hf.dense_attention_mask(spec)[0, 0] == 0
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                      [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert dcp_hf.dense_attention_mask(spec, torch.float64).dtype == torch.float64
    assert dcp_hf.packed_positions(spec).tolist() == [0, 1, 2, 0, 1]
    model = _model(LlamaConfig(**SMALL, head_dim=16))
    assert dcp_hf.batch_geometry(model) == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    assert dcp_hf.batch_geometry(Qwen2Config(**SMALL))["head_dim"] == 8
    batch = _batch(model, lengths=(4, 3))
    inputs = dcp_hf.model_inputs(batch)
    assert inputs["input_ids"].tolist() == [batch.tokens.tolist()] and inputs["use_cache"] is False
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert inputs["shift_labels"].tolist() == [batch.labels.tolist()] and inputs["num_items_in_batch"] == 5
    assert inputs[dcp_hf.PLAN_KWARG] is batch.plan
