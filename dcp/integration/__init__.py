"""Trainer integration: planned per-rank batches, one batch ahead, and a drop-in attention module.

- ``DCPLoader(samples, cluster, planner_config, token_budget, num_heads, ...)``: token-budget batches of
  variable-length ``Sample``s, planned in a background process and shared by every rank (``DCPBatch``);
  ``layer_kinds={name: LayerKind(count, window)}`` plans models whose layers differ (``dcp.LayeredPlan``);
- ``DCPAttention``: ``o = attn(q_local, k_local, v_local, plan)``, GQA, differentiable; ``sum_gradients(model)``;
- ``PlanCache`` (LRU of plans), ``PlanWorker`` (the background planner), ``share_plan`` (broadcast + sha256);
- errors: ``SampleRejectedError``, ``PlanningError`` (``PlannerWorkerDiedError``, ``PlanningTimeoutError``),
  ``PlanMismatchError``; all are ``dcp.DcpError``.

See ``experiments/train_gpt.py`` for a complete training loop, and ``dcp.integration.hf`` (imported on its
own: it needs ``transformers``) for Hugging Face models.
"""
from dcp.integration.broadcast import PlanMismatchError, SharedPlan, share_plan
from dcp.integration.cache import CachedPlan, PlanCache, batch_digest, plan_key
from dcp.integration.loader import (IGNORE_INDEX, DCPBatch, DCPLoader, LayerKind, Sample, SampleRejectedError,
                                    pack_positions_labels, windowed_mask)
from dcp.integration.module import DCPAttention, sum_gradients
from dcp.integration.worker import (InlinePlanner, PlannerWorkerDiedError, PlanningError, PlanningTimeoutError,
                                    PlanWorker, WorkerConfig, make_planner, plan_description)

__all__ = ["DCPLoader", "DCPBatch", "Sample", "LayerKind", "windowed_mask", "DCPAttention", "sum_gradients",
           "PlanCache", "CachedPlan", "PlanWorker", "InlinePlanner", "WorkerConfig", "make_planner", "plan_description",
           "share_plan", "SharedPlan", "plan_key", "batch_digest", "pack_positions_labels", "IGNORE_INDEX",
           "SampleRejectedError", "PlanningError", "PlannerWorkerDiedError", "PlanningTimeoutError",
           "PlanMismatchError"]
