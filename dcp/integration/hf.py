"""Hugging Face ``transformers``: dcp as an attention implementation of unmodified causal LMs.

    from dcp.integration import hf as dcp_hf
    dcp_hf.register()                                                       # once per process: "dcp" exists
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dcp")  # or model.set_attn_implementation("dcp")
    loader = DCPLoader(samples, dcp.Cluster(1, world), planner_config, token_budget, **dcp_hf.batch_geometry(model))
    for batch in loader:
        with dcp_hf.plan_context(batch.plan):   # needed only by models whose layers drop **kwargs (StableLM)
            loss = model(**dcp_hf.model_inputs(batch)).loss  # this rank's summed token loss / GLOBAL label count
            loss.backward()
        dcp_hf.sum_gradients(model)                         # replicated parameters: sum over ranks
        opt.step(); opt.zero_grad()

Each rank feeds the model its home tokens in transformers' padding-free layout: ``input_ids`` and
``position_ids`` ``[1, n_local]`` (positions restart at 0 per sequence, so RoPE sees each token's position in
its own sequence), plus the batch's plan as the extra model argument ``dcp_plan``; transformers hands
unknown keyword arguments down to the attention function. Where a model's decoder layers do not (in 5.23:
StableLM, Nemotron), ``plan_context(batch.plan)`` gives the attention function the plan for the block
(a call's ``dcp_plan``, when it has one, must be the same plan). Embeddings, norms, MLPs and the LM head run
per rank on the home tokens; only attention moves data, as the plan says. The masks are the plan's (one per
sequence, from the loader's ``Sample.mask``; causal by default), so no dense mask is ever built.

Models whose layers differ (``config.layer_types`` mixing "full_attention" and "sliding_attention" layers
with one ``sliding_window``: gpt-oss, Gemma 3, Qwen2 with ``max_window_layers``, ...): ``batch_geometry``
gives the loader their layer kinds, so every batch is planned into a ``dcp.LayeredPlan`` (one placement;
full layers attend through each sample's mask, window layers through it restricted to the window, see
``dcp.integration.layer_kinds.windowed_mask``), and each attention call runs its layer's kind
(``module.layer_idx`` into ``layer_types``, cross-checked with the ``sliding_window`` the layer passes:
``LayerKindError``). A model of one kind keeps plain batches and plans; a window layer then needs masks
within its window (``SlidingWindowMask(w)``). gpt-oss's attention sinks (``s_aux``, the layer's ``sinks``
parameter) run as dcp's sinks, gradients included.

The registered function checks what it is given against the plan, per call, with a named error each:
``PackedInputError`` for a batch dimension other than 1, a row count or ``position_ids`` that are not this
rank's share of the plan (e.g. positions left to transformers' default ``arange``), ``cu_seq_lens_q``/``_k``
that do not describe the plan's sequences, an ``attention_mask`` tensor (the plan carries the masks), or no
plan at all (``PlanContextError``: a ``dcp_plan`` other than the ``plan_context``'s); ``LayerKindError`` for a
layer whose kind or window the plan does not have; ``UnsupportedAttentionError`` for what dcp does not
compute (attention dropout, logit soft-capping, layer types other than full and sliding, bidirectional
windows, a window that a plain plan's masks do not respect).

The tested ``transformers`` versions are ``SUPPORTED_TRANSFORMERS``; ``register`` raises
``UnsupportedTransformersError`` for any other (``check_transformers_version``).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dcp.errors import DcpError
from dcp.integration.hf_layers import (PLAN_KWARG, LayerKindError, PackedInputError, PlanContextError,
                                       UnsupportedAttentionError, active_plan, check_window, layer_kind, layer_kinds,
                                       plan_context, resolve_plan)
from dcp.integration.loader import IGNORE_INDEX, DCPBatch
from dcp.integration.module import DCPAttention, sum_gradients
from dcp.masks import ranges_to_dense
from dcp.spec import BatchSpec

# setup.py's "hf" and "test" extras pin the same range. The tests passed on 4.56.2, 4.57.6, 5.0.0 and 5.23.0
# (4.53.3 lacks ``set_attn_implementation``); a later minor version joins once they pass on it.
SUPPORTED_TRANSFORMERS = (">=4.56.2", "<5.24")
# attention-function arguments of features dcp does not compute: a value other than None is refused
_UNSUPPORTED_KWARGS = {"softcap": "logit soft-capping"}


class UnsupportedTransformersError(DcpError, ImportError):
    """``transformers`` is missing or outside ``SUPPORTED_TRANSFORMERS``."""


def check_transformers_version(version: str | None = None) -> str:
    """The installed (or given) ``transformers`` version if ``SUPPORTED_TRANSFORMERS`` admits it, else raise."""
    if version is None:
        try:
            import transformers
        except ImportError as err:
            raise UnsupportedTransformersError("dcp.integration.hf needs transformers: pip install 'dcp[hf]'") from err
        version = transformers.__version__
    from packaging.version import InvalidVersion, Version

    low, high = (Version(s.lstrip("<>=")) for s in SUPPORTED_TRANSFORMERS)
    try:
        parsed = Version(version)
    except InvalidVersion as err:
        raise UnsupportedTransformersError(f"cannot parse the transformers version {version!r}") from err
    if not low <= Version(parsed.base_version) < high:  # base_version: 5.24.0.dev0 counts as 5.24
        raise UnsupportedTransformersError(
            f"transformers {version} is not supported by dcp.integration.hf (tested range "
            f"{','.join(SUPPORTED_TRANSFORMERS)}): pip install 'transformers{','.join(SUPPORTED_TRANSFORMERS)}'")
    return version


def packed_positions(spec: BatchSpec) -> np.ndarray:
    """int64 ``[T]``: each packed token's position within its own sequence (0, 1, ..., L-1 per sequence)."""
    cu = spec.cu_seqlens
    return np.arange(spec.total_tokens, dtype=np.int64) - np.repeat(cu[:-1], spec.seqlens)


class HFDCPAttention:
    """The function registered in transformers' ``AttentionInterface`` (see ``register``).

    Called by every attention layer as ``fn(module, query, key, value, attention_mask, scaling=,
    dropout=, **kwargs)`` with ``query [1, Hq, n, D]``, ``key``/``value [1, Hkv, n, D]`` (RoPE applied, GQA
    not repeated) and returns ``(attn_output [1, n, Hq, D], None)``. The plan is ``kwargs[PLAN_KWARG]``, else
    the ``plan_context``'s; a ``LayeredPlan`` runs the layer's kind (``hf_layers.layer_kind``); ``s_aux``
    (gpt-oss sink logits ``[Hq]``) goes to dcp as ``sinks``. Runs ``DCPAttention(group, mode=...,
    kernels=..., timeout=..., validate=...)`` at the layer's scale.
    """

    def __init__(self, group=None, *, mode: str = "auto", kernels=None, timeout: float | None = None,
                 validate: bool = False):
        self._settings = dict(group=group, mode=mode, kernels=kernels, timeout=timeout, validate=validate)
        self._by_scale: dict[float | None, DCPAttention] = {}
        self._rows: tuple = None  # the last plan and its rows' positions
        self._windows: tuple = (None, set())  # the last plan and its (kind, window) pairs already checked

    def attention(self, scale: float | None) -> DCPAttention:
        """The ``DCPAttention`` for softmax scale ``scale`` (layers of one model share it)."""
        if scale not in self._by_scale:
            self._by_scale[scale] = DCPAttention(scale=scale, **self._settings)
        return self._by_scale[scale]

    def _home_positions(self, attn: DCPAttention, plan, device: torch.device) -> torch.Tensor:
        """int64 ``[n]`` positions of the rows this process runs: its home tokens, or the whole batch when
        one process runs a multi-device plan (``DCPAttention`` mode "single_process")."""
        cached = self._rows
        if cached is not None and cached[0] is plan and cached[1].device == device:
            return cached[1]
        positions = packed_positions(plan.spec)
        if attn.resolved_mode() == "distributed":
            positions = positions[plan.local_token_index(dist.get_rank(attn.group))]
        elif plan.n_devices == 1:
            positions = positions[plan.local_token_index(0)]
        home = torch.from_numpy(positions).to(device)
        self._rows = (plan, home)
        return home

    def _check_window(self, plan, kind: str | None, window: int) -> None:
        seen_plan, seen = self._windows
        if seen_plan is not plan:
            seen = set()
            self._windows = (plan, seen)
        if (kind, window) not in seen:
            check_window(plan, kind, window)
            seen.add((kind, window))

    def _check(self, attn: DCPAttention, module, query: torch.Tensor, key: torch.Tensor, attention_mask,
               dropout: float, kwargs: dict) -> tuple:
        """``(plan, kind, rows)``: the plan, the layer's kind (None for a ``Plan``) and how many of the plan's
        rows this process runs, once the inputs passed every check."""
        plan = resolve_plan(module, kwargs)
        if query.dim() != 4 or query.shape[0] != 1:
            raise PackedInputError(f"the 'dcp' attention takes one packed row per rank (batch size 1, "
                                   f"input_ids [1, n]); got query {list(query.shape)}")
        if key.shape[2] != query.shape[2]:
            raise PackedInputError(f"the 'dcp' attention runs training steps: keys ({key.shape[2]}) and queries "
                                   f"({query.shape[2]}) must be the same tokens (no KV cache; pass use_cache=False)")
        if attention_mask is not None:
            raise PackedInputError("the 'dcp' attention takes its masks from the plan: pass no attention_mask "
                                   f"(got a tensor of shape {list(getattr(attention_mask, 'shape', []))})")
        if dropout:
            raise UnsupportedAttentionError(f"attention dropout {dropout} is not computed by dcp: set the config's "
                                            "attention_dropout to 0")
        for name, what in _UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise UnsupportedAttentionError(f"{what} ({name}={kwargs[name]!r}) is not computed by dcp")
        kind, window = layer_kind(module, plan, kwargs)
        if window is not None:
            self._check_window(plan, kind, window)
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            cu = kwargs.get(name)
            if cu is not None and not np.array_equal(cu.detach().cpu().numpy().reshape(-1), plan.spec.cu_seqlens):
                raise PackedInputError(f"{name} does not describe the plan's sequences (lengths "
                                       f"{plan.spec.seqlens[:8]}...): give the whole packed batch's cu_seqlens or none")
        home = self._home_positions(attn, plan, query.device)
        if home.numel() == 0 and query.shape[2] == 1:  # an idle rank's placeholder token (see model_inputs)
            return plan, kind, 0
        if query.shape[2] != home.numel():
            raise PackedInputError(f"the model got {query.shape[2]} tokens; this process runs {home.numel()} rows "
                                   f"of the plan: feed the batch's tokens (input_ids=batch.tokens[None])")
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and not torch.equal(position_ids.reshape(-1).to(home.device), home):
            raise PackedInputError("position_ids are not the batch's per-sequence positions of this rank's tokens: "
                                   "pass position_ids=batch.positions[None] (without them transformers numbers the "
                                   "rank's tokens 0..n-1 and RoPE rotates them wrongly)")
        return plan, kind, home.numel()

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs) -> tuple[torch.Tensor, None]:
        attn = self.attention(None if scaling is None else float(scaling))
        plan, kind, rows = self._check(attn, module, query, key, attention_mask, dropout, kwargs)
        extra = {} if kind is None else {"kind": kind}
        if kwargs.get("s_aux") is not None:
            extra["sinks"] = kwargs["s_aux"]
        q_thd, k_thd, v_thd = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [n, H, D]
        if rows == 0:
            # an idle rank still runs the plan's (empty) attention, forward and backward, with the others; its
            # placeholder row gets a zero output that stays in the graph through the empty one
            o_thd = attn(q_thd[:0], k_thd[:0], v_thd[:0], plan, **extra)
            o_thd = torch.cat([o_thd, torch.zeros_like(q_thd)])
        else:
            o_thd = attn(q_thd, k_thd, v_thd, plan, **extra)
        return o_thd.unsqueeze(0), None  # [1, n, Hq, D]: transformers flattens the heads itself


def register(name: str = "dcp", group=None, *, mode: str = "auto", kernels=None, timeout: float | None = None,
             validate: bool = False) -> HFDCPAttention:
    """Register dcp in transformers' ``AttentionInterface`` under ``name`` and return the registered function.

    Afterwards ``from_pretrained``/``from_config(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` select it. ``group``, ``mode``, ``kernels``, ``timeout`` and
    ``validate`` go to ``DCPAttention``. Registering a name again replaces its function. No mask function is
    registered on purpose: transformers then builds no mask for this implementation (the plan holds them).
    """
    check_transformers_version()
    from transformers import AttentionInterface

    fn = HFDCPAttention(group, mode=mode, kernels=kernels, timeout=timeout, validate=validate)
    AttentionInterface.register(name, fn)
    return fn


def model_inputs(batch: DCPBatch) -> dict:
    """Keyword arguments of a transformers causal LM for one rank's share of a ``DCPBatch``.

    ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` are ``[1, n_local]``. The loader's labels
    are already next-token labels (each sequence's last token ignored), so they go in as ``shift_labels``
    (transformers' loss then does not shift); ``labels`` is the same tensor, as the models compute a loss
    only when it is given. ``num_items_in_batch`` is the whole batch's label count, so ``.loss`` is this
    rank's summed token loss over the GLOBAL count and the ranks' losses sum to the batch mean.
    ``use_cache`` is False: a training step needs no KV cache. ``dcp_plan`` is the batch's plan (a
    ``LayeredPlan`` for a model of several layer kinds); a model whose layers drop it needs ``plan_context``.

    A rank that the plan leaves idle (no home tokens, ``plan.stats().idle_devices``) gets one placeholder
    token (id 0, position 0, label ignored), as transformers' layers cannot run on zero tokens: its
    attention output is zero, and it adds nothing to the loss or to any gradient.
    """
    tokens, positions, labels = batch.tokens[None], batch.positions[None], batch.labels[None]
    if batch.n_local == 0:
        tokens, positions = tokens.new_zeros(1, 1), positions.new_zeros(1, 1)
        labels = labels.new_full((1, 1), IGNORE_INDEX)
    return {"input_ids": tokens, "position_ids": positions, "labels": labels,
            "shift_labels": labels, "num_items_in_batch": batch.num_label_tokens, "use_cache": False,
            PLAN_KWARG: batch.plan}


def batch_geometry(model_or_config) -> dict:
    """``num_heads``, ``num_kv_heads``, ``head_dim``, ``dtype`` of a transformers model (its parameters' dtype)
    or config (its ``dtype``, else float32): the attention geometry ``DCPLoader`` plans for; plus
    ``layer_kinds`` (``hf_layers.layer_kinds``) for a model whose ``layer_types`` mix full and sliding-window
    layers. ``UnsupportedAttentionError`` for layer types dcp cannot express."""
    kinds = layer_kinds(model_or_config)
    cfg = getattr(model_or_config, "config", model_or_config)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if isinstance(model_or_config, nn.Module):
        dtype = next(model_or_config.parameters()).dtype
    else:
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    geometry = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                "dtype": str(dtype).replace("torch.", "")}
    return geometry if kinds is None else {**geometry, "layer_kinds": kinds}


def dense_attention_mask(spec: BatchSpec, dtype: torch.dtype = torch.float32, device=None):
    """Additive ``[1, 1, T, T]`` mask of the whole packed batch (0 allowed, dtype's min elsewhere), block
    diagonal by sequence, each block the sequence's dcp mask: for checking dcp against transformers'
    eager/SDPA attention on one process (pass it as ``attention_mask``). O(T^2) memory: tests only.
    A layered batch gives ``{kind: mask}``, which transformers' models with ``layer_types`` take as is."""
    if spec.layered:
        return {k: dense_attention_mask(spec.for_kind(k), dtype, device) for k in spec.kinds}
    allowed_tt = torch.zeros(spec.total_tokens, spec.total_tokens, dtype=torch.bool)
    cu = spec.cu_seqlens
    for s in range(spec.num_seqs):
        a, b = int(cu[s]), int(cu[s + 1])
        allowed_tt[a:b, a:b] = torch.from_numpy(ranges_to_dense(spec.kv_ranges(s), b - a))
    mask_tt = torch.zeros(allowed_tt.shape, dtype=dtype).masked_fill_(~allowed_tt, torch.finfo(dtype).min)
    return mask_tt[None, None].to(device) if device is not None else mask_tt[None, None]


__all__ = ["register", "model_inputs", "batch_geometry", "layer_kinds", "plan_context", "active_plan", "sum_gradients",
           "dense_attention_mask", "packed_positions", "check_transformers_version", "HFDCPAttention",
           "SUPPORTED_TRANSFORMERS", "PLAN_KWARG", "UnsupportedTransformersError", "PackedInputError",
           "PlanContextError", "UnsupportedAttentionError", "LayerKindError"]
