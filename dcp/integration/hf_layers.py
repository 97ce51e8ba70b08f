"""Layer kinds, sliding windows and the plan context of ``dcp.integration.hf`` (imported by it; no transformers
import here).

- ``layer_kinds(model_or_config)``: the attention layer kinds of a transformers config, from its
  ``layer_types`` ("full_attention", "sliding_attention") and ``sliding_window``, as ``DCPLoader``'s
  ``layer_kinds`` (``None`` for a model of one kind);
- ``layer_kind(module, plan, kwargs)``: which kind an attention call is (``module.layer_idx`` into the config's
  ``layer_types``, cross-checked with the ``sliding_window`` the layer passes), and its window;
- ``check_window``: the plan's masks for a window layer are that window (``LayerKindError`` /
  ``UnsupportedAttentionError`` otherwise);
- ``plan_context(plan)``: the plan of the step for models whose layers do not hand keyword arguments down to
  the attention function (``resolve_plan`` reads it).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

from dcp.errors import DcpError
from dcp.integration.layer_kinds import LayerKind, windowed_mask
from dcp.ir.layered import LayeredPlan
from dcp.ir.plan import Plan
from dcp.masks import CausalMask, SlidingWindowMask

FULL, SLIDING = "full_attention", "sliding_attention"
PLAN_KWARG = "dcp_plan"


class PackedInputError(DcpError, ValueError):
    """The model was not fed this rank's share of the plan's packed batch (see ``model_inputs``)."""


class UnsupportedAttentionError(DcpError, ValueError):
    """The model's attention asks for something dcp does not compute (dropout, soft-capping, a window or a
    layer kind that dcp cannot express)."""


class LayerKindError(DcpError, ValueError):
    """An attention layer's kind (full / sliding window) disagrees with the plan or with the model's config."""


class PlanContextError(PackedInputError):
    """``plan_context`` misused: nested with another plan, or a ``dcp_plan`` argument that is not its plan."""


# ------------------------------------------------------------------------------------------------ config
def layer_kinds(model_or_config) -> dict[str, LayerKind] | None:
    """``{"full_attention": LayerKind(n_full), "sliding_attention": LayerKind(n_sliding, window)}`` of a
    transformers model or config whose ``layer_types`` mix the two kinds (full first: a layered batch's
    ``spec.masks`` are then the samples' own); ``None`` for a model of one kind (no ``layer_types``, or all
    the same: its batches stay plain, and a window layer checks the plan's masks, ``check_window``).

    ``UnsupportedAttentionError`` for what a layered batch cannot express: other layer types (chunked,
    linear attention, ...), sliding layers without a positive int ``sliding_window``, bidirectional
    attention (Gemma 3's ``use_bidirectional_attention``)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    types = getattr(cfg, "layer_types", None)
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedAttentionError("use_bidirectional_attention=True (bidirectional windows) is not expressed "
                                        "by dcp's layer kinds: train with use_bidirectional_attention=False")
    if types is None:
        return None
    types = list(types)
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedAttentionError(f"layer_types {unknown} are not supported by dcp (only {FULL!r} and "
                                        f"{SLIDING!r} layers)")
    window = getattr(cfg, "sliding_window", None)
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise UnsupportedAttentionError(f"the config has {SLIDING!r} layers but sliding_window={window!r}: dcp "
                                        "needs one positive int window for them")
    if len(set(types)) < 2:
        return None
    return {FULL: LayerKind(types.count(FULL)), SLIDING: LayerKind(types.count(SLIDING), int(window))}


# ------------------------------------------------------------------------------------------------ layer kind
def layer_kind(module, plan, kwargs: dict) -> tuple[str | None, int | None]:
    """``(kind, window)`` of one attention call: ``kind`` is the layer's kind for a ``LayeredPlan`` (None for
    a ``Plan``), ``window`` the sliding window the layer attends through (None: none).

    The kind is ``module.config.layer_types[module.layer_idx]``; without them, the ``sliding_window`` the layer
    passes (a window: "sliding_attention", None: "full_attention"), or the plan's only kind.
    ``LayerKindError`` when the layer's ``sliding_window`` argument contradicts its configured kind, when the
    kind cannot be told, or when the plan has no such kind."""
    config = getattr(module, "config", None)
    types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    passed = "sliding_window" in kwargs
    window = kwargs.get("sliding_window")
    kind = None
    if types is not None and isinstance(idx, int) and 0 <= idx < len(types):
        kind = types[idx]
        if passed and (window is not None) != (kind == SLIDING):
            raise LayerKindError(f"layer {idx} is {kind!r} in the config's layer_types but its attention passes "
                                 f"sliding_window={window!r}: the model and its config disagree")
        if kind == SLIDING and window is None:
            window = getattr(config, "sliding_window", None)
    elif passed:
        kind = SLIDING if window is not None else FULL
    if not isinstance(plan, LayeredPlan):
        return None, None if window is None else int(window)
    if kind is None:
        if len(plan.kinds) != 1:
            raise LayerKindError(f"the plan has layer kinds {list(plan.kinds)}; {type(module).__name__} has no "
                                 "layer_idx into its config's layer_types and passes no sliding_window, so its kind "
                                 "is unknown")
        kind = plan.kinds[0]
    if kind not in plan.kinds:
        raise LayerKindError(f"layer {idx} is {kind!r}, the plan has layer kinds {list(plan.kinds)}: plan the model's "
                             "kinds (DCPLoader(..., **dcp.integration.hf.batch_geometry(model)))")
    return kind, None if window is None else int(window)


def _within_window(spec, seq: int, window: int) -> bool:
    """Whether sequence ``seq``'s mask never reaches further back than ``window`` keys (the query included)."""
    mask, length = spec.masks[seq], spec.seqlens[seq]
    if isinstance(mask, SlidingWindowMask):
        return mask.window <= window
    if isinstance(mask, CausalMask):
        return length <= window
    ranges_tr2 = spec.kv_ranges(seq)
    used_tr = ranges_tr2[:, :, 1] > ranges_tr2[:, :, 0]
    lo_t = np.arange(length) - window + 1
    return not (used_tr & (ranges_tr2[:, :, 0] < lo_t[:, None])).any()


def check_window(plan, kind: str | None, window: int) -> None:
    """The plan computes what a layer of ``kind`` with a sliding window of ``window`` keys (itself included)
    computes: each sequence's mask restricted to that window.

    A layered plan with a "full_attention" kind: the window kind's masks must be the full kind's masks
    restricted to the window (``windowed_mask``), else ``LayerKindError`` (planned for another window). A plain
    plan (or a layered one without a full kind): every mask must stay within the window (the layer's own
    restriction then changes nothing), else ``UnsupportedAttentionError``."""
    spec = plan.kind(kind).spec if kind is not None else plan.spec
    if isinstance(plan, LayeredPlan) and FULL in plan.kinds and kind != FULL:
        full = plan.kind(FULL).spec
        for i, (mask, length) in enumerate(zip(spec.masks, spec.seqlens)):
            if mask != windowed_mask(full.masks[i], length, window, spec.num_heads):
                raise LayerKindError(f"the layer attends through a sliding window of {window} keys; the plan's "
                                     f"{kind!r} mask of sequence {i} (length {length}) is {mask!r}, not its "
                                     f"{FULL!r} mask within that window: plan with the model's own window "
                                     "(dcp.integration.hf.batch_geometry(model))")
        return
    for i, (mask, length) in enumerate(zip(spec.masks, spec.seqlens)):
        if not _within_window(spec, i, window):
            raise UnsupportedAttentionError(
                f"the layer attends through a sliding window of {window} tokens, the plan's sequence {i} (length "
                f"{length}) has {mask!r}: give the loader samples with dcp.masks.SlidingWindowMask({window}), or "
                "plan the model's layer kinds (DCPLoader(..., **dcp.integration.hf.batch_geometry(model)))")


# ------------------------------------------------------------------------------------------------ plan context
_ACTIVE: list = []  # the plans of the plan_context blocks entered in this process, innermost last
_LOCK = threading.Lock()


@contextmanager
def plan_context(plan_or_batch):
    """``with plan_context(batch.plan): loss = model(**inputs).loss; loss.backward()``: the 'dcp' attention
    uses this plan where a call brings no ``dcp_plan`` argument (models whose decoder layers do not hand
    keyword arguments down to attention, e.g. transformers' StableLM). Takes a ``Plan``, ``LayeredPlan`` or
    ``DCPBatch``; yields the plan.

    Process-wide (autograd's backward threads see it too), cleared on exit, so a later step cannot run a
    stale plan; put the backward inside the block when layers are recomputed there (gradient
    checkpointing). ``PlanContextError`` when entered inside a block of another plan, and, inside the block,
    when a call's ``dcp_plan`` is another plan than the block's."""
    plan = getattr(plan_or_batch, "plan", plan_or_batch)
    if not isinstance(plan, (Plan, LayeredPlan)):
        raise PlanContextError(f"plan_context takes a dcp Plan, LayeredPlan or DCPBatch, got "
                               f"{type(plan_or_batch).__name__}")
    with _LOCK:
        if _ACTIVE and _ACTIVE[-1] is not plan:
            raise PlanContextError("plan_context entered inside the plan_context of another plan: leave the "
                                   "previous step's block first")
        _ACTIVE.append(plan)
    try:
        yield plan
    finally:
        with _LOCK:
            _ACTIVE.pop()


def active_plan():
    """The plan of the innermost ``plan_context`` block, or None outside any."""
    return _ACTIVE[-1] if _ACTIVE else None


def resolve_plan(module, kwargs: dict):
    """The plan an attention call runs: its ``dcp_plan`` argument, else the ``plan_context``'s; both present
    must be the same plan (``PlanContextError``); neither: ``PackedInputError`` saying what to do."""
    given, ctx = kwargs.get(PLAN_KWARG), active_plan()
    if given is not None and not isinstance(given, (Plan, LayeredPlan)):
        raise PackedInputError(f"{PLAN_KWARG} must be the batch's dcp Plan or LayeredPlan (batch.plan), got "
                               f"{type(given).__name__}")
    if given is not None and ctx is not None and given is not ctx:
        raise PlanContextError(f"the model was called with {PLAN_KWARG}= a plan other than the enclosing "
                               "plan_context's: pass this step's batch.plan to both (or only one)")
    plan = given if given is not None else ctx
    if plan is None:
        raise PackedInputError(
            f"the 'dcp' attention needs the batch's plan and {type(module).__name__} got none: call the model with "
            f"{PLAN_KWARG}=batch.plan (dcp.integration.hf.model_inputs(batch) does); if you did, this model's layers "
            "do not hand keyword arguments down to attention: run the step inside "
            "`with dcp.integration.hf.plan_context(batch.plan):`")
    return plan


__all__ = ["layer_kinds", "layer_kind", "check_window", "plan_context", "active_plan", "resolve_plan", "FULL",
           "SLIDING", "PackedInputError", "UnsupportedAttentionError", "LayerKindError", "PlanContextError"]
