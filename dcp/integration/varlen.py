"""Drop-in varlen attention: ``flash_attn_varlen_func``'s call, run as a dcp plan over the process group.

    plan = dcp.varlen_plan(cu_seqlens, num_heads=8, num_kv_heads=2, head_dim=64, causal=True)  # every rank
    x_local = dcp.dispatch(plan, rank, x_thd)               # this rank's home rows of the packed batch
    ...                                                      # the model's other layers, on the home rows
    o_local = dcp.varlen_attention(q_local, k_local, v_local, cu_seqlens, causal=True)  # in each layer

Layouts. ``cu_seqlens`` describes the GLOBAL packed batch and every rank passes the same one: int32/int64
``[B + 1]`` (tensor, array or list), ``cu_seqlens[0] == 0``, non-decreasing; sequence ``i`` is rows
``cu_seqlens[i]:cu_seqlens[i+1]`` of a global ``[total, heads, dim]`` tensor (empty sequences are allowed
and dropped). ``q``/``k``/``v`` are NOT the global tensors but this rank's home rows of the plan,
``x_thd[plan.local_token_index(rank)]`` (what ``dcp.dispatch(plan, rank, x_thd)`` gives; a sequence may be
split over ranks, rows stay in increasing global order); the output has the same rows. One process:
the home rows are the whole batch, so ``varlen_attention(q, k, v, cu_seqlens, causal=True)`` computes what
``flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)`` does.

Masks, as flash-attn names them: ``causal`` and ``window_size=(left, right)`` (-1: unbounded) give a
query ``i`` the keys ``j`` with ``i - left <= j <= i + right`` (``right`` is 0 with ``causal``), mapped
onto dcp's masks by ``mask_from_flash``; or ``masks=``: any ``dcp.masks.Mask`` for every sequence, or one
per sequence (then ``causal``/``window_size`` must stay at their defaults).

Plans. The plan of a batch is cached (``dcp.integration.cache.PlanCache``, LRU, module default
``PLAN_CACHE``) under (lengths, masks, head geometry, cluster, planner config) -- not dtype, which only
weighs the cost model, so a plan made by ``varlen_plan`` for bf16 is found again by a float32 call. With
a process group of several ranks, group rank 0 plans (on a cache miss) and ``share_plan`` gives every
rank its plan (sha256-checked), as ``DCPLoader`` does: every rank calls ``varlen_plan`` /
``varlen_attention`` in the same order with the same ``cu_seqlens`` (a rank whose batch differs raises
``PlanMismatchError`` on every rank). A cache hit costs one 96-byte broadcast and one 16-byte all-reduce
per call; ``varlen_attention(..., plan=plan)`` skips even that (the executor still proves once per plan
that the ranks agree). The rows a rank holds follow the plan it dispatched with, so ``varlen_attention``
without ``plan=`` never plans a batch anew under another config or cluster than the one it was planned
with (``InvalidConfigError``): give it the ``config=``/``cluster=`` given to ``varlen_plan``.
"""
from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import (DcpError, InvalidBatchError, InvalidClusterError, InvalidConfigError, InvalidMaskError,
                        PlanMismatchError)
from dcp.integration.broadcast import share_plan
from dcp.integration.cache import CachedPlan, PlanCache, batch_digest, config_fingerprint, digest_bytes
from dcp.integration.worker import PlanningError
from dcp.ir.plan import Plan
from dcp.masks import CausalMask, Mask
from dcp.spec import BatchSpec

#: the plans ``varlen_plan`` / ``varlen_attention`` reuse when no ``cache=`` is given
PLAN_CACHE = PlanCache(64)
_RECENT: "weakref.WeakKeyDictionary[PlanCache, OrderedDict]" = weakref.WeakKeyDictionary()
_DEFAULT_CONFIG: PlannerConfig | None = None

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------- batch
def seqlens_from_cu(cu_seqlens) -> np.ndarray:
    """int64 ``[B]`` lengths of ``cu_seqlens`` (tensor, ndarray or list ``[B + 1]``), zeros included.

    Raises ``InvalidBatchError`` unless it is 1-D with at least two integer entries, starts at 0, never
    decreases and holds at least one token.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise InvalidBatchError(f"cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
        arr = cu_seqlens.detach().cpu().numpy()  # a device sync for a CUDA tensor: pass it on the CPU
    elif isinstance(cu_seqlens, (np.ndarray, list, tuple)):
        arr = np.asarray(cu_seqlens)
        if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise InvalidBatchError(f"cu_seqlens must hold integers, got dtype {arr.dtype}")
    else:
        raise InvalidBatchError(f"cu_seqlens must be an int tensor, numpy array or list, got "
                                f"{type(cu_seqlens).__name__}")
    if arr.ndim != 1 or arr.size < 2:
        raise InvalidBatchError(f"cu_seqlens must be 1-D [num_seqs + 1] with at least 2 entries, got shape "
                                f"{list(arr.shape)}")
    arr = arr.astype(np.int64)
    if arr[0] != 0:
        raise InvalidBatchError(f"cu_seqlens must start at 0, got {int(arr[0])}")
    lens = np.diff(arr)
    if (lens < 0).any():
        i = int(np.argmax(lens < 0))
        raise InvalidBatchError(f"cu_seqlens decreases at entry {i + 1} ({int(arr[i])} -> {int(arr[i + 1])}); "
                                f"it must be non-decreasing")
    if arr[-1] == 0:
        raise InvalidBatchError("cu_seqlens describes an empty batch (cu_seqlens[-1] == 0)")
    return lens


def _window(window_size) -> tuple[int, int]:
    bad = InvalidMaskError(f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), got "
                           f"{window_size!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise bad
    for w in window_size:
        if not isinstance(w, (int, np.integer)) or isinstance(w, bool) or w < -1:
            raise bad
    return int(window_size[0]), int(window_size[1])


def mask_from_flash(causal: bool = False, window_size: Sequence[int] = (-1, -1)) -> Mask:
    """The dcp mask of flash-attn's ``causal`` / ``window_size=(left, right)``: query ``i`` attends keys
    ``j`` with ``i - left <= j <= i + right`` (-1: that side unbounded; ``causal`` makes ``right`` 0).

    ``(-1, -1)`` → ``FullMask``; right 0 with left -1 → ``CausalMask``; right 0 with left ``w >= 0`` →
    ``SlidingWindowMask(w + 1)`` (keys ``[i - w, i]``, ``w + 1`` of them). A window reaching right of the
    query (right > 0 without ``causal``, or left >= 0 with right -1) has no dcp mask family:
    ``InvalidMaskError`` (give ``masks=`` per sequence, e.g. ``dcp.masks.RangesMask``, instead).
    """
    if not isinstance(causal, bool):
        raise InvalidMaskError(f"causal must be True or False, got {causal!r}")
    left, right = _window(window_size)
    if causal:
        right = 0  # flash-attn ignores the right window under causal
    if right < 0 and left < 0:
        from dcp.masks import FullMask

        return FullMask()
    if right == 0:
        if left < 0:
            return CausalMask()
        from dcp.masks import SlidingWindowMask

        return SlidingWindowMask(left + 1)
    raise InvalidMaskError(f"window_size={tuple(window_size)!r} (causal={causal}) lets a query attend keys "
                           f"after it; dcp maps only causal windows (right = 0) and full attention (-1, -1): "
                           f"give masks= (one dcp.masks.Mask per sequence, e.g. RangesMask) instead")


def _masks(lens: np.ndarray, masks, causal: bool, window_size) -> tuple[Mask, ...]:
    """One mask per NON-EMPTY sequence, from ``masks`` or from flash's ``causal``/``window_size``."""
    keep = lens > 0
    if masks is None:
        return (mask_from_flash(causal, window_size),) * int(keep.sum())
    if causal is not False or _window(window_size) != (-1, -1):
        raise InvalidMaskError("give either masks= or flash's causal=/window_size=, not both (masks= already "
                               "says which keys each query attends)")
    if isinstance(masks, (Mask, str)):
        return (masks,) * int(keep.sum())  # BatchSpec resolves mask names and checks the masks
    if isinstance(masks, (int, np.integer)):
        raise InvalidMaskError(f"masks is the int {masks!r}: pass flash-attn's max_seqlen as max_seqlen=, not "
                               f"positionally")
    try:
        given = list(masks)
    except TypeError:
        raise InvalidMaskError(f"masks must be a dcp.masks.Mask or one per sequence, got "
                               f"{type(masks).__name__}") from None
    if len(given) != lens.size:
        raise InvalidMaskError(f"got {len(given)} masks for {lens.size} sequences (cu_seqlens has {lens.size + 1} "
                               f"entries); give one mask or one per sequence")
    return tuple(m for m, k in zip(given, keep) if k)


def varlen_spec(cu_seqlens, masks=None, *, num_heads: int, num_kv_heads: int | None = None, head_dim: int,
                causal: bool = False, window_size: Sequence[int] = (-1, -1), dtype="bfloat16",
                max_seqlen: int | None = None) -> BatchSpec:
    """The ``dcp.BatchSpec`` of a flash-style varlen batch (empty sequences dropped); see the module docs."""
    lens = seqlens_from_cu(cu_seqlens)
    if max_seqlen is not None:
        if not isinstance(max_seqlen, (int, np.integer)) or isinstance(max_seqlen, bool) or max_seqlen < lens.max():
            raise InvalidBatchError(f"max_seqlen={max_seqlen!r} is not an int >= the longest sequence "
                                    f"({int(lens.max())} tokens)")
    mask_tuple = _masks(lens, masks, causal, window_size)
    return BatchSpec(lens[lens > 0], mask_tuple, num_heads, num_kv_heads, head_dim, dtype)


# ------------------------------------------------------------------------------------------- world
def _world(group, world_size: int | None, cluster: Cluster | None, share: bool | None) -> tuple[int, int, Cluster, bool]:
    """(rank, world, cluster, share): this rank in ``group`` and whether planning is shared over it."""
    dist_on = dist.is_available() and dist.is_initialized()
    if group is not None and not dist_on:
        raise InvalidConfigError("a process group was given but torch.distributed is not initialized")
    group_world = dist.get_world_size(group) if dist_on else 1
    rank = dist.get_rank(group) if dist_on else 0
    if rank < 0:
        raise InvalidConfigError("this process is not a member of the given process group")
    share = group_world > 1 if share is None else bool(share)
    if share and group_world == 1:
        share = False  # one rank: nothing to share
    if cluster is not None and not isinstance(cluster, Cluster):
        raise InvalidClusterError(f"cluster must be a dcp.Cluster, got {cluster!r}")
    world = cluster.n_devices if cluster is not None else group_world if world_size is None else world_size
    if not isinstance(world, (int, np.integer)) or isinstance(world, bool) or world < 1:
        raise InvalidClusterError(f"world_size must be a positive int, got {world!r}")
    if world_size is not None and world != world_size:
        raise InvalidClusterError(f"world_size={world_size} but the cluster has {world} devices")
    if share and world != group_world:
        raise InvalidClusterError(f"the plan is for {world} devices but the process group has {group_world} ranks; "
                                  f"pass share=False to plan for another world without the group")
    return rank, int(world), cluster if cluster is not None else Cluster(1, int(world)), share


# ------------------------------------------------------------------------------------------ plans
def varlen_digests(spec: BatchSpec, cluster: Cluster, config: PlannerConfig) -> tuple[bytes, bytes]:
    """(batch digest, cache key), 32 bytes each. The batch digest is sha256 over the lengths, masks and
    head geometry (NOT the dtype): equal on every rank that formed the same batch, which ``share_plan``
    checks. The key adds the cluster and the planner config (their ``repr``, which a custom partitioner
    may make process-specific, so it is never compared across ranks)."""
    batch = batch_digest(spec, with_dtype=False)
    return batch, digest_bytes(batch + config_fingerprint(cluster, config).encode())


def _plan_batch(spec: BatchSpec, cluster: Cluster, config: PlannerConfig) -> CachedPlan:
    """Plan one batch here (the only place this module calls the planner)."""
    from dcp.planner import plan

    p = plan(spec, cluster, config)
    data = p.to_bytes()
    return CachedPlan(data, digest_bytes(data), p)


def _recent(cache: PlanCache) -> OrderedDict:
    """``cache``'s map (batch digest + world) -> key of the plan last handed out for that batch."""
    recent = _RECENT.get(cache)
    if recent is None:
        recent = _RECENT[cache] = OrderedDict()
    return recent


def _share(spec: BatchSpec, cluster: Cluster, config: PlannerConfig, cache: PlanCache, group, batch: bytes,
           key: bytes) -> CachedPlan:
    """Group rank 0's plan of the batch (its cache's, or planned there) on every rank (``share_plan``)."""
    try:
        if dist.get_rank(group) == 0:
            entry, error, planning_s = cache.get(key), None, 0.0
            if entry is None:
                started = time.perf_counter()
                try:
                    entry = _plan_batch(spec, cluster, config)
                except Exception as err:  # noqa: BLE001 - share_plan raises it here, PlanningError elsewhere
                    error = err if isinstance(err, DcpError) else PlanningError(f"{type(err).__name__}: {err}",
                                                                                type(err).__name__)
                    error.__cause__ = err
                planning_s = time.perf_counter() - started
            # a rank whose lengths, masks or heads differ from rank 0's: PlanMismatchError on every rank
            shared = share_plan(entry, error, 0.0, batch_digest=batch, group=group, planning_s=planning_s)
        else:
            shared = share_plan(None, None, 0.0, batch_digest=batch, local=cache.get(key), group=group)
    except PlanMismatchError as err:
        raise PlanMismatchError(f"varlen: the ranks passed different batches (cu_seqlens, masks or heads); every "
                                f"rank must pass the same GLOBAL batch, in the same order of calls ({err})") from err
    return shared.entry


def _get_plan(spec: BatchSpec, cluster: Cluster, config: PlannerConfig, cache: PlanCache, group, share: bool,
              strict: bool = False) -> Plan:
    """The plan of ``spec``: from ``cache``, else planned (here, or on group rank 0 and shared).

    ``strict`` (``varlen_attention``): refuse to plan a batch anew when it was planned for this world
    under another key (another config or cluster): the caller's home rows follow THAT plan, and a new
    plan with the same row counts would silently pair the wrong rows.
    """
    batch, key = varlen_digests(spec, cluster, config)
    recent, batch_world = _recent(cache), batch + int(cluster.n_devices).to_bytes(4, "little")
    if strict and cache.peek(key) is None and recent.get(batch_world, key) != key:
        raise InvalidConfigError("this batch was planned (by varlen_plan) with another config= or cluster= than "
                                 "this varlen_attention call has: pass the same ones, or plan=plan")
    entry = cache.get(key) if not share else _share(spec, cluster, config, cache, group, batch, key)
    if entry is None:
        entry = _plan_batch(spec, cluster, config)
    cache.put(key, entry)
    recent[batch_world] = key
    recent.move_to_end(batch_world)
    while len(recent) > max(cache.capacity, 1):
        recent.popitem(last=False)
    return entry.plan


def _config(config: PlannerConfig | None) -> PlannerConfig:
    global _DEFAULT_CONFIG
    if config is None:
        if _DEFAULT_CONFIG is None:  # frozen, and building one (cost model, warm starts) is not free
            _DEFAULT_CONFIG = PlannerConfig()
        return _DEFAULT_CONFIG
    if not isinstance(config, PlannerConfig):
        raise InvalidConfigError(f"config must be a dcp.PlannerConfig, got {config!r}")
    return config


def _cache(cache: PlanCache | None) -> PlanCache:
    if cache is None:
        return PLAN_CACHE
    if not isinstance(cache, PlanCache):
        raise InvalidConfigError(f"cache must be a dcp.integration.PlanCache, got {cache!r}")
    return cache


def varlen_plan(cu_seqlens, masks=None, *, num_heads: int, num_kv_heads: int | None = None, head_dim: int,
                causal: bool = False, window_size: Sequence[int] = (-1, -1), dtype="bfloat16",
                max_seqlen: int | None = None, world_size: int | None = None, cluster: Cluster | None = None,
                config: PlannerConfig | None = None, group=None, share: bool | None = None,
                cache: PlanCache | None = None) -> Plan:
    """The plan ``varlen_attention`` runs for this batch (cached; see the module docstring).

    Args:
        cu_seqlens: int ``[B + 1]``, the GLOBAL batch; masks, causal, window_size: as ``varlen_attention``.
        num_heads, num_kv_heads (default num_heads), head_dim: q has ``[*, num_heads, head_dim]``, k and v
            ``[*, num_kv_heads, head_dim]``.
        dtype: element type the cost model assumes (not part of the cache key).
        world_size / cluster: the plan's devices (default: the process group's ranks on one node;
            ``dcp.Cluster(nodes, gpus_per_node)`` tells the planner which links cross nodes).
        config: ``dcp.PlannerConfig`` (default ``PlannerConfig()``).
        group: the process group (None: the default one).
        share: None (default): with a group of several ranks, COLLECTIVE -- every rank calls it, rank 0
            plans and shares the plan; False: plan in this process (e.g. in a data-loader worker: the
            default planner is deterministic, so every rank gets the same plan, and the executor checks
            that they agree before any transfer).
        cache: the ``PlanCache`` to use (default ``PLAN_CACHE``, shared with ``varlen_attention``).
    Returns the ``dcp.Plan``: give its home rows with ``dcp.dispatch(plan, rank, x_thd)``, gather outputs
    with ``dcp.undispatch(plan, xs_local)``, and pass it on as ``varlen_attention(..., plan=plan)``.
    """
    _, _, cluster, share = _world(group, world_size, cluster, share)
    spec = varlen_spec(cu_seqlens, masks, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       causal=causal, window_size=window_size, dtype=dtype, max_seqlen=max_seqlen)
    return _get_plan(spec, cluster, _config(config), _cache(cache), group, share)


# -------------------------------------------------------------------------------------- attention
def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise InvalidBatchError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise InvalidBatchError(f"{name} must be [tokens, heads, head_dim], got shape {list(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise InvalidBatchError(f"q, k, v must share one dtype and device, got {q.dtype}/{q.device} and "
                                    f"{x.dtype}/{x.device} for {name}")
    if q.dtype not in _FLOAT_DTYPES:
        raise InvalidBatchError(f"q, k, v must be float64, float32, bfloat16 or float16, got {q.dtype}")
    if k.shape != v.shape:
        raise InvalidBatchError(f"k {list(k.shape)} and v {list(v.shape)} must have one shape")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise InvalidBatchError(f"q {list(q.shape)} and k {list(k.shape)} must have the same tokens and head_dim")
    if q.shape[1] % k.shape[1]:
        raise InvalidBatchError(f"q has {q.shape[1]} heads, not a multiple of k's {k.shape[1]} (GQA needs it)")


def _unsupported(dropout_p, softcap, alibi_slopes, softmax_scale) -> None:
    if dropout_p != 0:
        raise InvalidConfigError(f"dropout_p={dropout_p!r}: dcp attention has no dropout (use 0.0)")
    if softcap != 0:
        raise InvalidConfigError(f"softcap={softcap!r}: dcp attention has no score soft-capping (use 0.0)")
    if alibi_slopes is not None:
        raise InvalidConfigError("alibi_slopes: dcp attention has no ALiBi bias (use None)")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
                                      or not math.isfinite(softmax_scale)):
        raise InvalidConfigError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")


def _check_plan(plan: Plan, spec: BatchSpec, world: int) -> None:
    """``plan=`` must be the plan of this call's batch, masks and heads, for this world."""
    if not isinstance(plan, Plan):
        raise InvalidConfigError(f"plan must be a dcp.Plan (from dcp.varlen_plan), got {type(plan).__name__}")
    ps = plan.spec
    if ps.seqlens != spec.seqlens:
        raise InvalidBatchError(f"plan= is for sequence lengths {ps.seqlens[:8]}..., cu_seqlens gives "
                                f"{spec.seqlens[:8]}...")
    if (ps.num_heads, ps.num_kv_heads, ps.head_dim) != (spec.num_heads, spec.num_kv_heads, spec.head_dim):
        raise InvalidBatchError(f"plan= is for {ps.num_heads}/{ps.num_kv_heads} heads of size {ps.head_dim}, q/k "
                                f"have {spec.num_heads}/{spec.num_kv_heads} of size {spec.head_dim}")
    for i, (a, b) in enumerate(zip(ps.masks, spec.masks)):
        if a is not b and a != b and a.describe() != b.describe():
            raise InvalidMaskError(f"plan= was planned with {a!r} for sequence {i}, this call asks for {b!r}: "
                                   f"pass varlen_attention the causal=/window_size=/masks= given to varlen_plan")
    if plan.n_devices != world:
        raise InvalidClusterError(f"plan= is for {plan.n_devices} devices, the process group has {world} ranks")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, masks=None, *,
                     causal: bool = False, window_size: Sequence[int] = (-1, -1), softmax_scale: float | None = None,
                     return_lse: bool = False, max_seqlen: int | None = None, dropout_p: float = 0.0,
                     softcap: float = 0.0, alibi_slopes=None, plan: Plan | None = None, group=None,
                     cluster: Cluster | None = None, config: PlannerConfig | None = None,
                     cache: PlanCache | None = None, kernels=None, timeout: float | None = None,
                     sinks: torch.Tensor | None = None):
    """Attention of a packed variable-length batch, distributed by a dcp plan; flash-attn's varlen call.

    Args:
        q: ``[n_local, Hq, D]``; k, v: ``[n_local, Hkv, D]`` (``Hq`` a multiple of ``Hkv``): this rank's home
            rows of the plan (``dcp.dispatch(plan, rank, x_thd)``; the whole batch on one process).
        cu_seqlens: int32/int64 ``[B + 1]`` of the GLOBAL packed batch, the same on every rank.
        masks: a ``dcp.masks.Mask`` (or mask name) for every sequence, or one per sequence; None: from
            ``causal``/``window_size``.
        causal, window_size, softmax_scale (default ``1/sqrt(D)``): as ``flash_attn_varlen_func``
            (``mask_from_flash``); max_seqlen: optional, checked; dropout_p, softcap, alibi_slopes: only
            their defaults (``InvalidConfigError`` otherwise).
        return_lse: also return ``lse [Hq, n_local]``, the natural-log softmax normalizer in flash's varlen
            layout (float32; float64 for float64 inputs; -inf for a query with no key; not differentiable).
        plan: the plan to run (from ``varlen_plan``); None: the cached plan of this batch, planned on a miss
            (COLLECTIVE with several ranks: every rank calls it in the same order).
        group: process group (None: the default one; without torch.distributed: one process).
        cluster, config, cache: as ``varlen_plan`` (when ``plan`` is None): the same as there.
        kernels, timeout: ``dcp.attention``'s (kernel backend; seconds to wait for a peer's transfer).
        sinks: ``[Hq]`` attention-sink logits (gpt-oss style: a zero-value key in every row's softmax),
            differentiable; the returned lse includes them; each rank's gradient covers its own rows (sum it
            over the ranks, as for any replicated parameter). See ``dcp.execute.autograd``.
    Returns ``o [n_local, Hq, D]`` in q's dtype (and ``lse`` with ``return_lse``); differentiable in q, k, v
    (the backward runs the plan's backward program). Bad arguments raise ``InvalidBatchError``,
    ``InvalidMaskError``, ``InvalidClusterError`` or ``InvalidConfigError``: those of ``cu_seqlens``,
    masks and shapes on every rank before any communication; a rank's wrong row count after the plan is
    shared, before the attention's transfers (the other ranks then time out in the executor).
    """
    _check_qkv(q, k, v)
    _unsupported(dropout_p, softcap, alibi_slopes, softmax_scale)
    rank, world, cluster, share = _world(group, None, cluster, None)
    group_world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world != group_world:
        raise InvalidClusterError(f"cluster= has {world} devices, but {group_world} rank(s) run the attention: "
                                  f"one process per device")
    spec = varlen_spec(cu_seqlens, masks, num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                       causal=causal, window_size=window_size, dtype=q.dtype, max_seqlen=max_seqlen)
    if plan is None:
        plan = _get_plan(spec, cluster, _config(config), _cache(cache), group, share, strict=True)
    else:
        _check_plan(plan, spec, world)
    from dcp.execute import attention
    from dcp.execute.tables import plan_tables

    n_local = int(plan_tables(plan).n_local[rank])
    if q.shape[0] != n_local:
        # a rank-local mistake: the other ranks wait in the executor until their timeout
        raise InvalidBatchError(f"rank {rank}: q has {q.shape[0]} rows, this rank holds {n_local} of the "
                                f"{spec.total_tokens}-token batch: pass its home rows, dcp.dispatch(plan, {rank}, "
                                f"x_thd) (the whole batch when there is one rank)")
    return attention(q, k, v, plan, group, kernels=kernels, timeout=timeout, scale=softmax_scale,
                     return_lse=return_lse, sinks=sinks)


__all__ = ["varlen_attention", "varlen_plan", "varlen_spec", "varlen_digests", "mask_from_flash", "seqlens_from_cu",
           "PLAN_CACHE"]
