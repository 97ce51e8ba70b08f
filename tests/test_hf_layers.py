"""transformers models whose layers differ (sliding-window and full layers), with attention sinks, and models
whose layers drop ``**kwargs``, under ``attn_implementation="dcp"``.

- layer kinds read from configs (gpt-oss, Gemma 3, Qwen2's ``max_window_layers``), and what is refused;
- ``windowed_mask``: a sample's mask restricted to a window, against its dense definition;
- one process: a layered plan (1 device, and 2 devices run by one process) == transformers' eager attention,
  whose own window masks are checked to be dcp's; wrong kinds, windows and plans raise named errors;
- ``plan_context`` for StableLM (its decoder layers call attention without ``**kwargs`` in 5.23);
- 2 gloo ranks (and 4 for two families) == one process: loss and every parameter gradient, sinks included,
  on plans that split sequences over ranks and move bytes in every layer kind.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from _hf_models import (FAST, WINDOW, Case, assert_same, build_model, crossing, dcp_step, loader, model_config,
                        rank_main, reference_step, zigzag_plan_bytes)
from _spawn import run_ranks
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

import dcp
from dcp.errors import InvalidMaskError
from dcp.integration import DCPLoader, LayerKind, Sample, SampleRejectedError, WorkerConfig
from dcp.integration import hf as dcp_hf
from dcp.integration import windowed_mask
from dcp.ir.layered import LayeredPlan
from dcp.masks import CausalBlockwiseMask, CausalMask, FullMask, LambdaMask, RangesMask, SlidingWindowMask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
FULL, SLIDING = "full_attention", "sliding_attention"
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def _batch(model, case: Case):
    with loader(model, case) as batches:
        return next(iter(batches))


# ---------------------------------------------------------------------------------------- configs
def test_layer_kinds_from_configs():
    for family in ("gptoss", "gemma3"):
        kinds = dcp_hf.batch_geometry(model_config(family))["layer_kinds"]
        assert kinds == {FULL: LayerKind(2), SLIDING: LayerKind(2, WINDOW)} and list(kinds) == [FULL, SLIDING]
    qwen = Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert dcp_hf.layer_kinds(qwen) == {FULL: LayerKind(1), SLIDING: LayerKind(2, 8)}
    # one kind: today's plain batches (all-window Qwen2, Llama without layer_types, StableLM)
    for one in (Qwen2Config(**SMALL, num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                            max_window_layers=0), LlamaConfig(**SMALL, num_hidden_layers=2), model_config("stablelm")):
        assert "layer_kinds" not in dcp_hf.batch_geometry(one) and dcp_hf.layer_kinds(one) is None
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="bidirectional"):
        dcp_hf.batch_geometry(Gemma3TextConfig(**SMALL, num_hidden_layers=2, use_bidirectional_attention=True))
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="chunked_attention"):
        dcp_hf.layer_kinds(types.SimpleNamespace(layer_types=[FULL, "chunked_attention"], sliding_window=8))
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="sliding_window=None"):
        dcp_hf.layer_kinds(types.SimpleNamespace(layer_types=[FULL, SLIDING], sliding_window=None))
    with pytest.raises(dcp.InvalidConfigError, match="LayerKind.window"):
        LayerKind(2, 0)


def test_windowed_mask_is_the_mask_within_the_window():
    assert windowed_mask(CausalMask(), 30, 8) == SlidingWindowMask(8)
    assert windowed_mask(SlidingWindowMask(4), 30, 8) == SlidingWindowMask(4)
    assert windowed_mask(SlidingWindowMask(12), 30, 8) == SlidingWindowMask(8)
    inside = LambdaMask(0, 3)
    assert windowed_mask(inside, 30, 8) is inside  # never reaches further back: unchanged
    q, kv = np.arange(30)[:, None], np.arange(30)[None]
    for mask in (LambdaMask(2, 12), CausalBlockwiseMask(5, 1), FullMask(), LambdaMask(4, 3)):
        got = windowed_mask(mask, 30, 8)
        assert isinstance(got, RangesMask)
        assert np.array_equal(got.dense(30), mask.dense(30) & (q - kv < 8)), mask  # transformers' window overlay
    with pytest.raises(InvalidMaskError, match="query token 8 attends to no key"):
        windowed_mask(RangesMask(np.tile([[[0, 1]]], (30, 1, 1))), 30, 8)


def test_loader_plans_layered_batches():
    model = build_model("gemma3", "dcp")
    batch = _batch(model, Case("gemma3", sparse=True))
    spec = batch.plan.spec
    assert isinstance(batch.plan, LayeredPlan) and spec.kinds == (FULL, SLIDING) and spec.layers == (2, 2)
    assert spec.for_kind(FULL).masks == (LambdaMask(2, 12), CausalMask(), LambdaMask(2, 12))
    assert spec.for_kind(SLIDING).masks == tuple(windowed_mask(m, n, WINDOW) for m, n in zip(spec.masks, spec.seqlens))
    assert spec.for_kind(SLIDING).masks[1] == SlidingWindowMask(WINDOW)
    lost = [Sample(np.arange(20) % 60, RangesMask(np.tile([[[0, 1]]], (20, 1, 1))))]
    with pytest.raises(SampleRejectedError, match="sliding-window layer kind"):
        next(iter(DCPLoader(lost, dcp.Cluster(1, 1), FAST, 64,
                            **dcp_hf.batch_geometry(model), on_reject="raise", worker=WorkerConfig(mode="inline"))))
    with pytest.raises(dcp.InvalidConfigError, match="layer_kinds"):
        DCPLoader([], dcp.Cluster(1, 1), dcp.PlannerConfig(), 64, 4, 2, 8, layer_kinds={FULL: 2})


# ---------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("family", ["gptoss", "gemma3"])
def test_transformers_windows_are_dcps(family):
    """transformers' own masks (from the config's windows) == the layered batch's dcp masks, densely, and
    both differ from the same model without windows. gpt-oss builds its masks without the position ids, so it
    is checked on one sequence (packed sequences would see each other in its eager reference)."""
    case = Case(family, lengths=(50,) if family == "gptoss" else Case.lengths)
    own, dense = reference_step(case, dense=False), reference_step(case, dense=True)
    assert_same(own, dense, family, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(own["logits"], dense["logits"], rtol=1e-5, atol=1e-6)
    model = build_model(family, "eager")
    batch = _batch(model, case)
    inputs = {k: v for k, v in dcp_hf.model_inputs(batch).items() if k != dcp_hf.PLAN_KWARG}
    full = dcp_hf.dense_attention_mask(batch.plan.spec.for_kind(FULL))
    no_window = model(**inputs, attention_mask={FULL: full, SLIDING: full}).logits.detach()
    assert not torch.allclose(no_window, own["logits"], atol=1e-3)


@pytest.mark.parametrize("case", [Case("gptoss"), Case("gemma3"), Case("gemma3", sparse=True),
                                  Case("gptoss", lengths=(60, 4), planner="dcp")],
                         ids=["gptoss", "gemma3", "gemma3-sparse", "gptoss-dcp-planner"])
def test_one_device_layered_plan_matches_transformers(case):
    got = dcp_step(case)
    assert got["kinds"] == (FULL, SLIDING)
    assert_same(got, reference_step(case), case.family)


def test_multi_device_layered_plan_on_one_process():
    """mode="single_process": one process runs both devices of a 2-device layered zigzag plan (sinks on)."""
    case = Case("gptoss")
    reference = reference_step(case)
    model = build_model("gptoss", "eager")
    batch = _batch(model, case)
    plan2 = LayeredPlan.from_bytes(zigzag_plan_bytes(batch.plan.spec.describe(), dcp.Cluster(1, 2), None))
    assert all(split > 0 and moved > 0 for split, moved in crossing(plan2).values()), crossing(plan2)
    dcp_hf.register("dcp_debug", mode="single_process")
    model.set_attn_implementation("dcp_debug")
    out = model(**{**dcp_hf.model_inputs(batch), dcp_hf.PLAN_KWARG: plan2})
    out.loss.backward()
    got = {"loss": float(out.loss.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}
    assert_same(got, reference, "gptoss, 2 devices on one process")


def test_layer_kind_errors():
    model = build_model("gptoss", "dcp")
    batch = _batch(model, Case("gptoss"))
    fn = dcp_hf.register()
    sliding, full = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    n = batch.n_local
    q, kv = torch.zeros(1, 4, n, 8), torch.zeros(1, 2, n, 8)
    pos = batch.positions[None]
    with pytest.raises(dcp_hf.LayerKindError, match="layer 1 is 'full_attention'.*sliding_window=8"):
        fn(full, q, kv, kv, None, sliding_window=8, dcp_plan=batch.plan, position_ids=pos)
    with pytest.raises(dcp_hf.LayerKindError, match="layer 0 is 'sliding_attention'.*sliding_window=None"):
        fn(sliding, q, kv, kv, None, sliding_window=None, dcp_plan=batch.plan, position_ids=pos)
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="soft-capping"):
        fn(full, q, kv, kv, None, softcap=30.0, dcp_plan=batch.plan)
    # a plan of the full kind only
    spec = batch.plan.spec
    only_full = dcp.BatchSpec(spec.seqlens, {FULL: list(spec.masks)}, 4, 2, 8, "float32", layers={FULL: 4})
    plan = LayeredPlan.from_bytes(zigzag_plan_bytes(only_full.describe(), dcp.Cluster(1, 1), None))
    with pytest.raises(dcp_hf.LayerKindError, match="the plan has layer kinds \\['full_attention'\\]"):
        model(**{**dcp_hf.model_inputs(batch), dcp_hf.PLAN_KWARG: plan})
    # a plan for another window than the model's
    other = dcp.BatchSpec(spec.seqlens, {FULL: list(spec.masks), SLIDING: SlidingWindowMask(4)}, 4, 2, 8, "float32",
                          layers={FULL: 2, SLIDING: 2})
    plan = LayeredPlan.from_bytes(zigzag_plan_bytes(other.describe(), dcp.Cluster(1, 1), None))
    with pytest.raises(dcp_hf.LayerKindError, match="sliding window of 8 keys.*SlidingWindowMask\\(window=4\\)"):
        model(**{**dcp_hf.model_inputs(batch), dcp_hf.PLAN_KWARG: plan})
    # a plain plan (the loader not told the layer kinds): the window layers refuse causal masks longer than it
    geometry = {k: v for k, v in dcp_hf.batch_geometry(model).items() if k != "layer_kinds"}
    plain = next(iter(DCPLoader(Case("gptoss").samples(), dcp.Cluster(1, 1), FAST, 96,
                                **geometry, worker=WorkerConfig(mode="inline"))))
    with pytest.raises(dcp_hf.UnsupportedAttentionError, match="SlidingWindowMask\\(8\\).*batch_geometry"):
        model(**dcp_hf.model_inputs(plain))


# ---------------------------------------------------------------------------------------- plan context
def test_kwargs_dropping_model_runs_in_a_plan_context():
    """StableLM's decoder layer calls its attention without ``**kwargs`` (transformers 5.23), so ``dcp_plan``
    never reaches the attention function: the error says so and what to do; ``plan_context`` runs it."""
    case = Case("stablelm", context=True)
    model = build_model("stablelm", "dcp")
    batch = _batch(model, case)
    inputs = dcp_hf.model_inputs(batch)
    with pytest.raises(dcp_hf.PackedInputError, match="StableLmAttention got none.*if you did.*plan_context"):
        model(**inputs)
    assert dcp_hf.active_plan() is None
    assert_same(dcp_step(case), reference_step(case), "stablelm in a plan_context")
    assert dcp_hf.active_plan() is None  # cleared on exit: a later step cannot run a stale plan
    with pytest.raises(dcp_hf.PackedInputError, match="plan_context"):
        model(**inputs)
    # a stale plan: the block's plan is another batch's (the rows tell), nested blocks of two plans
    other = _batch(model, Case("stablelm", lengths=(40, 50)))
    with dcp_hf.plan_context(other):
        with pytest.raises(dcp_hf.PackedInputError, match="got 96 tokens; this process runs 90 rows"):
            model(**inputs)
        with pytest.raises(dcp_hf.PlanContextError, match="inside the plan_context of another plan"):
            with dcp_hf.plan_context(batch.plan):
                pass
        with dcp_hf.plan_context(other.plan) as inner:  # the same plan again: fine
            assert inner is other.plan and dcp_hf.active_plan() is other.plan
    assert dcp_hf.active_plan() is None
    with pytest.raises(dcp_hf.PlanContextError, match="takes a dcp Plan"):
        with dcp_hf.plan_context("plan"):
            pass
    # a model that hands kwargs down: the call's dcp_plan must be the block's plan
    gptoss = build_model("gptoss", "dcp")
    layered = _batch(gptoss, Case("gptoss"))
    with dcp_hf.plan_context(_batch(gptoss, Case("gptoss", lengths=(30, 66)))):
        with pytest.raises(dcp_hf.PlanContextError, match="other than the enclosing plan_context"):
            gptoss(**dcp_hf.model_inputs(layered))
    with dcp_hf.plan_context(layered):
        gptoss(**dcp_hf.model_inputs(layered)).loss.backward()


# ---------------------------------------------------------------------------------------- several processes
CASES = {
    "gptoss": Case("gptoss"),
    "gemma3": Case("gemma3"),
    "gemma3-sparse": Case("gemma3", sparse=True),
    "gptoss-dcp-planner": Case("gptoss", lengths=(90, 6), planner="dcp"),
    "stablelm-context": Case("stablelm", context=True),
}
FOUR = {name: CASES[name] for name in ("gptoss", "stablelm-context")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(rank_main, 2, tmp_path_factory.mktemp("hf2"), CASES, deadline_s=150.0, group_timeout_s=60.0)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(rank_main, 4, tmp_path_factory.mktemp("hf4"), FOUR, deadline_s=150.0, group_timeout_s=60.0)


def _check_ranks(name: str, outs: list) -> None:
    case = CASES[name]
    reference = reference_step(case)
    for r, out in enumerate(outs):
        assert_same(out, reference, f"{name}, rank {r} of {len(outs)}")
    local = [o["n_local"] for o in outs]
    assert sum(local) == sum(case.lengths) and min(local) > 0, local
    layered = case.family != "stablelm"
    assert outs[0]["kinds"] == ((FULL, SLIDING) if layered else ())
    # the plan crosses ranks in every layer kind: a sequence split over ranks, bytes moved
    assert all(split > 0 and moved > 0 for split, moved in outs[0]["crossing"].values()), outs[0]["crossing"]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_process(name, two_ranks):
    _check_ranks(name, [r[name] for r in two_ranks])


def test_layered_plans_travel_per_kind_and_are_cached(two_ranks):
    """A layered plan reaches every rank (one share per kind), identical by digest; a repeated batch is a
    cache hit everywhere and moves no plan bytes."""
    runs = [r["_repeated"] for r in two_ranks]
    for steps in runs:
        assert [s["type"] for s in steps] == ["LayeredPlan"] * 3
        assert [s["hit"] for s in steps] == [False, True, False]
        assert steps[0]["plan"] == steps[1]["plan"] and steps[0]["digest"] == steps[1]["digest"] != steps[2]["digest"]
    assert [s["digest"] for s in runs[0]] == [s["digest"] for s in runs[1]]
    assert [s["transferred"] for s in runs[1]] == [True, False, True]


@pytest.mark.parametrize("name", list(FOUR))
def test_four_ranks_match_one_process(name, four_ranks):
    _check_ranks(name, [r[name] for r in four_ranks])
