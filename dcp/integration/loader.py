"""``DCPLoader``: token-budget batches of variable-length samples, each planned one batch ahead.

    loader = DCPLoader(samples, dcp.Cluster(1, 4), dcp.PlannerConfig(block_size=256), token_budget=16384,
                       num_heads=16, num_kv_heads=4, head_dim=64, dtype="bfloat16", rank=rank, world_size=4)
    for batch in loader:              # DCPBatch: this rank's home tokens, positions, labels and the plan
        logits = model(batch.tokens, batch.positions, batch.plan)
        loss = cross_entropy(logits, batch.labels, ignore_index=-100, reduction="sum") / batch.num_label_tokens

Batches are formed greedily in arrival order: samples are appended while the total stays within
``token_budget``; a sample that does not fit starts the next batch. Every rank must iterate the same
samples in the same order (each rank forms every batch; only its home rows are kept).

Planning: group rank 0 hands each batch, as soon as it is formed, to a background planner process
(``dcp.integration.worker``); ``lookahead`` batches are in flight while the current one trains. Plans are
cached (``dcp.integration.cache``) and shared by broadcast with a sha256 check on every rank
(``dcp.integration.broadcast``). ``DCPBatch.waited_s`` is how long the step waited for its plan.

Samples that cannot be planned (empty, longer than the budget, a mask that is not a ``dcp.masks.Mask``,
cannot be described for the worker, or fails on the sample's length) raise ``SampleRejectedError``:
with ``on_reject="skip"`` (default) it is logged (a warning on rank 0 only: every rank rejects the same
samples), appended to ``loader.rejected``, and the loader goes on with the next sample; with
``on_reject="raise"`` it propagates. A planner failure raises ``PlanningError`` on every rank.

The planner worker is started with multiprocessing "spawn", which imports the training script in the
worker: guard the script's entry point with ``if __name__ == "__main__":`` (as for any spawn-based
multiprocessing), or use ``WorkerConfig(mode="inline")``.

Models whose layers differ (sliding-window and full attention, ``layer_kinds={"full_attention":
LayerKind(count=12), "sliding_attention": LayerKind(count=12, window=128)}``; ``dcp.integration.hf.batch_geometry``
reads them from a transformers config) get layered batches: kind ``k`` attends through each sample's mask,
restricted to the last ``window`` keys where the kind has a window (``windowed_mask``), and every batch is
planned into a ``dcp.LayeredPlan`` (one placement, one program per kind), shared between ranks as one plan.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import DcpError, InvalidConfigError
from dcp.integration.broadcast import share_plan
from dcp.integration.cache import CachedPlan, PlanCache, batch_digest, config_fingerprint, plan_key
from dcp.integration.layer_kinds import LayerKind, check_layer_kinds, windowed_mask
from dcp.integration.worker import PlanningError, WorkerConfig, make_planner
from dcp.ir.layered import LayeredPlan
from dcp.ir.plan import Plan
from dcp.masks import CausalMask, Mask
from dcp.spec import BatchSpec

log = logging.getLogger("dcp.integration")
IGNORE_INDEX = -100


class SampleRejectedError(DcpError, ValueError):
    """A sample that cannot be planned. Attributes: ``sample_id``, ``length``, ``reason``."""

    def __init__(self, sample_id: Any, length: int, reason: str):
        super().__init__(f"sample {sample_id!r} (length {length}) rejected: {reason}")
        self.sample_id, self.length, self.reason = sample_id, length, reason


@dataclass(frozen=True, eq=False)
class Sample:
    """One variable-length sample: token ids (1-D ints), its attention mask and an identifier.

    ``sample_id`` None: the loader uses the sample's arrival index.
    """

    tokens: Any
    mask: Mask = field(default_factory=CausalMask)
    sample_id: Any = None


@dataclass(frozen=True, eq=False)
class DCPBatch:
    """One rank's share of a planned batch. Local rows follow ``plan.local_token_index(rank)``.

    Fields:
        tokens: int64 ``[n_local]`` token ids of this rank's home tokens.
        positions: int64 ``[n_local]`` position of each token within its sequence (for RoPE).
        labels: int64 ``[n_local]`` next token within the sequence; the last token of each sequence gets
            ``ignore_index`` (-100).
        plan: the plan (identical on every rank; ``plan_digest`` is sha256 of its bytes): a ``Plan``, or a
            ``LayeredPlan`` when the loader has ``layer_kinds``.
        step: batch index; rank: this rank; sample_ids: ids of the batch's samples, in packing order.
        num_tokens: tokens of the whole batch; num_label_tokens: labels != ignore_index in the whole
            batch (normalize summed per-rank losses by it to get the global mean).
        waited_s: seconds this step waited for its plan (on the planning rank; broadcast to all).
        planning_time_s: the planner's own time for this plan (0 for a cache hit).
        cache_hit: no planning was needed (cache, or a batch identical to one already being planned).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    plan: Plan | LayeredPlan
    step: int
    rank: int
    sample_ids: tuple
    num_tokens: int
    num_label_tokens: int
    waited_s: float
    planning_time_s: float
    cache_hit: bool
    plan_digest: str

    @property
    def n_local(self) -> int:
        return int(self.tokens.numel())

    @property
    def seqlens(self) -> tuple[int, ...]:
        return self.plan.spec.seqlens


def pack_positions_labels(token_arrays: list[np.ndarray], ignore_index: int = IGNORE_INDEX):
    """Packed ``(tokens, positions, labels)``, int64 ``[T]`` each, of sequences given as 1-D arrays."""
    tokens = np.concatenate(token_arrays).astype(np.int64, copy=False)
    positions = np.concatenate([np.arange(len(t), dtype=np.int64) for t in token_arrays])
    labels = np.full_like(tokens, ignore_index)
    labels[:-1] = tokens[1:]
    ends = np.cumsum([len(t) for t in token_arrays]) - 1
    labels[ends] = ignore_index
    return tokens, positions, labels


@dataclass
class _Pending:
    index: int
    samples: list  # list of (sample_id, tokens ndarray, mask or {layer kind: mask})
    spec: BatchSpec
    key: bytes
    bdigest: bytes
    job: int | None = None
    entry: CachedPlan | None = None
    error: BaseException | None = None  # a failed hand-over to the planner, reported when the batch is due


class DCPLoader:
    """Wrap an iterable of samples into planned per-rank batches (see the module docstring).

    Args:
        samples: iterable of ``Sample`` (or ``(tokens, mask)`` pairs, or bare token arrays: causal).
        cluster: the devices; ``cluster.n_devices`` must equal ``world_size``.
        planner_config: ``dcp.PlannerConfig`` for every batch.
        token_budget: maximum tokens per batch.
        num_heads, num_kv_heads, head_dim, dtype: attention geometry of the model (``BatchSpec``).
        rank, world_size, group: this process in the process group (None: from torch.distributed, or 0/1).
        lookahead: batches planned ahead of the one training (0: plan on demand).
        cache_size: plans kept in the LRU cache (0: none).
        on_reject: "skip" (record in ``rejected`` and go on) or "raise".
        drop_last: drop a final batch that the stream left partly filled.
        ignore_index: label of the last token of each sequence.
        check_masks: evaluate each sample's mask on its length up front (rejects bad masks early).
        worker: ``WorkerConfig`` of the planner (process / inline, start method, timeouts).
        device: where the batch tensors go (None: CPU).
        layer_kinds: ``{kind name: LayerKind}`` of a model whose layers differ (None: one kind, plain
            ``BatchSpec`` and ``Plan``); batches are then layered and planned into ``LayeredPlan``s.
    """

    def __init__(self, samples: Iterable, cluster: Cluster, planner_config: PlannerConfig, token_budget: int,
                 num_heads: int, num_kv_heads: int | None = None, head_dim: int = 128, dtype="bfloat16", *,
                 rank: int | None = None, world_size: int | None = None, group=None, lookahead: int = 1,
                 cache_size: int = 64, on_reject: str = "skip", drop_last: bool = False,
                 ignore_index: int = IGNORE_INDEX, check_masks: bool = True, worker: WorkerConfig | None = None,
                 device: torch.device | str | None = None, layer_kinds: dict | None = None):
        dist_on = dist.is_available() and dist.is_initialized()
        self.rank = int(rank if rank is not None else (dist.get_rank(group) if dist_on else 0))
        self.world_size = int(world_size if world_size is not None else (dist.get_world_size(group) if dist_on
                                                                          else 1))
        if not isinstance(cluster, Cluster) or cluster.n_devices != self.world_size:
            raise InvalidConfigError(f"the cluster ({cluster!r}) must have world_size={self.world_size} devices")
        if not 0 <= self.rank < self.world_size:
            raise InvalidConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.world_size > 1 and not dist_on:
            raise InvalidConfigError("world_size > 1 needs an initialized torch.distributed process group")
        if not isinstance(planner_config, PlannerConfig):
            raise InvalidConfigError(f"planner_config must be a dcp.PlannerConfig, got {planner_config!r}")
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget <= 0:
            raise InvalidConfigError(f"token_budget must be a positive int, got {token_budget!r}")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise InvalidConfigError(f"lookahead must be an int >= 0, got {lookahead!r}")
        if on_reject not in ("skip", "raise"):
            raise InvalidConfigError(f"on_reject must be 'skip' or 'raise', got {on_reject!r}")
        BatchSpec([1], CausalMask(), num_heads, num_kv_heads, head_dim, dtype)  # validates the geometry
        self.layer_kinds = check_layer_kinds(layer_kinds)
        self.samples, self.cluster, self.planner_config = samples, cluster, planner_config
        self.token_budget, self.lookahead, self.on_reject = token_budget, lookahead, on_reject
        self.heads = (num_heads, num_kv_heads, head_dim, dtype)
        self.group, self.drop_last, self.ignore_index, self.check_masks = group, drop_last, ignore_index, check_masks
        self.worker_config = worker or WorkerConfig()
        self.device = torch.device(device) if device is not None else None
        self.cache = PlanCache(cache_size)
        self.rejected: list[SampleRejectedError] = []
        self.history: list[dict] = []  # per step: waited_s, planning_time_s, cache_hit, tokens
        self._fingerprint = config_fingerprint(cluster, planner_config)
        self._planner = None
        self._describable: dict = {}

    # ------------------------------------------------------------------------------------- samples
    def _reject(self, sample_id, length: int, reason: str) -> None:
        err = SampleRejectedError(sample_id, length, reason)
        if self.on_reject == "raise":
            raise err
        self.rejected.append(err)
        # every rank reads the same stream and rejects the same samples: say it once, on rank 0
        log.log(logging.WARNING if self.rank == 0 else logging.DEBUG, "dcp loader: %s", err)

    def _mask_describable(self, mask: Mask) -> str | None:
        try:
            key = hash(mask)
        except TypeError:
            key = id(mask)
        if key not in self._describable:
            from dcp.masks import from_description

            try:
                from_description(mask.describe())
                self._describable[key] = None
            except Exception as err:  # noqa: BLE001
                self._describable[key] = f"its mask cannot be sent to the planner worker: {err}"
        return self._describable[key]

    def _check(self, index: int, item) -> tuple | None:
        """``(sample_id, tokens, mask)`` of an acceptable sample, else None (rejected)."""
        if isinstance(item, Sample):
            tokens, mask, sid = item.tokens, item.mask, item.sample_id
        elif isinstance(item, tuple) and len(item) == 2:
            (tokens, mask), sid = item, None
        else:
            tokens, mask, sid = item, CausalMask(), None
        sid = index if sid is None else sid
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        try:
            arr = np.asarray(tokens)
        except Exception:  # noqa: BLE001
            arr = np.zeros((0, 0))
        length = int(arr.shape[0]) if arr.ndim >= 1 else 0
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            return self._reject(sid, length, f"token ids must be a 1-D integer array, got shape {arr.shape} "
                                             f"dtype {arr.dtype}")
        if length == 0:
            return self._reject(sid, 0, "it has no tokens")
        if length > self.token_budget:
            return self._reject(sid, length, f"longer than the token budget ({self.token_budget})")
        if not isinstance(mask, Mask):
            return self._reject(sid, length, f"its mask is {type(mask).__name__}, not a dcp.masks.Mask")
        reason = self._mask_describable(mask)
        if reason:
            return self._reject(sid, length, reason)
        if self.check_masks:
            from dcp.masks import validate_ranges

            try:
                validate_ranges(mask.kv_ranges(length), length)
            except Exception as err:  # noqa: BLE001
                return self._reject(sid, length, f"its mask fails on this length: {type(err).__name__}: {err}")
        if self.layer_kinds:
            try:
                mask = {k: mask if lk.window is None else windowed_mask(mask, length, lk.window, self.heads[0])
                        for k, lk in self.layer_kinds.items()}
            except Exception as err:  # noqa: BLE001
                return self._reject(sid, length, f"its mask fails on a sliding-window layer kind: "
                                                 f"{type(err).__name__}: {err}")
        return sid, arr.astype(np.int64, copy=False), mask

    def _batches(self) -> Iterator[list]:
        """Greedy token-budget batches in arrival order (lists of ``(sample_id, tokens, mask)``)."""
        cur, total = [], 0
        for index, item in enumerate(self.samples):
            s = self._check(index, item)
            if s is None:
                continue
            if cur and total + len(s[1]) > self.token_budget:
                yield cur
                cur, total = [], 0
            cur.append(s)
            total += len(s[1])
        if cur and not (self.drop_last and total < self.token_budget):
            yield cur

    # ------------------------------------------------------------------------------------ planning
    def _is_src(self) -> bool:
        return self.rank == 0

    def _new_pending(self, index: int, samples: list, inflight: dict) -> _Pending:
        nh, nkv, hd, dt = self.heads
        lengths, masks = [len(t) for _, t, _ in samples], [m for _, _, m in samples]
        if self.layer_kinds:
            spec = BatchSpec(lengths, {k: [m[k] for m in masks] for k in self.layer_kinds}, nh, nkv, hd, dt,
                             layers={k: lk.count for k, lk in self.layer_kinds.items()})
        else:
            spec = BatchSpec(lengths, masks, nh, nkv, hd, dt)
        key = plan_key(spec, self.cluster, self.planner_config, self._fingerprint)
        p = _Pending(index, samples, spec, key, batch_digest(spec))
        if self._is_src():
            p.entry = self.cache.get(key)
            if p.entry is not None:
                pass
            elif key in inflight:  # identical to a batch already being planned: share its job
                p.job = inflight[key][0]
                inflight[key][1] += 1
            else:
                try:
                    p.job = self._planner_or_new().submit(spec)
                    inflight[key] = [p.job, 1]
                except Exception as err:  # noqa: BLE001 - raised on every rank when this batch is due
                    p.error = err
        return p

    def _resolve(self, p: _Pending, inflight: dict, job_results: dict):
        """On the source: ``(entry, error, waited_s, planning_s, cache_hit)``."""
        started = time.perf_counter()
        try:
            if p.entry is not None:
                return p.entry, None, 0.0, 0.0, True
            if p.error is not None:
                raise p.error
            hit, waited = False, 0.0
            if p.job in job_results:
                entry, secs = job_results[p.job]
                hit, secs = True, 0.0
            else:
                entry, secs = self._planner.result(p.job)  # decoded on the planner's receiver thread
                waited = time.perf_counter() - started
                self.cache.put(p.key, entry)
            users = inflight.get(p.key)
            if users is not None and users[0] == p.job:
                users[1] -= 1
                if users[1] <= 0:
                    del inflight[p.key]
                    job_results.pop(p.job, None)
                else:
                    job_results[p.job] = (entry, secs)
            return entry, None, waited, secs, hit
        except Exception as err:  # noqa: BLE001 - spread to every rank by share_plan
            if not isinstance(err, DcpError):
                wrapped = PlanningError(f"batch {p.index}: {type(err).__name__}: {err}", type(err).__name__)
                wrapped.__cause__ = err
                err = wrapped
            return None, err, time.perf_counter() - started, 0.0, False

    def _planner_or_new(self):
        if self._planner is None:
            self._planner = make_planner(self.cluster, self.planner_config, self.worker_config,
                                         decode=CachedPlan.from_bytes)
        return self._planner

    # ------------------------------------------------------------------------------------ batches
    def _make_batch(self, p: _Pending, entry: CachedPlan, waited: float, planning_s: float, hit: bool) -> DCPBatch:
        plan = entry.plan
        from dcp.integration.broadcast import PlanMismatchError

        if plan.spec.seqlens != p.spec.seqlens or plan.n_devices != self.world_size:
            raise PlanMismatchError(f"batch {p.index}: the plan is for lengths {plan.spec.seqlens[:8]}... on "
                                    f"{plan.n_devices} devices, the batch has {p.spec.seqlens[:8]}... on "
                                    f"{self.world_size}")
        if plan.spec.kinds != p.spec.kinds:
            raise PlanMismatchError(f"batch {p.index}: the plan has layer kinds {list(plan.spec.kinds)}, the batch "
                                    f"{list(p.spec.kinds)}")
        tokens, positions, labels = pack_positions_labels([t for _, t, _ in p.samples], self.ignore_index)
        idx = plan.local_token_index(self.rank)

        def local(x):
            t = torch.from_numpy(np.ascontiguousarray(x[idx]))
            return t.to(self.device) if self.device is not None else t

        return DCPBatch(local(tokens), local(positions), local(labels), plan, p.index, self.rank,
                        tuple(s for s, _, _ in p.samples), int(tokens.size),
                        int((labels != self.ignore_index).sum()), float(waited), float(planning_s), bool(hit),
                        entry.hexdigest)

    def __iter__(self) -> Iterator[DCPBatch]:
        batches = self._batches()
        pending: deque[_Pending] = deque()
        inflight: dict = {}
        job_results: dict = {}
        index = 0

        def refill(n: int):
            nonlocal index
            while len(pending) < n:
                try:
                    samples = next(batches)
                except StopIteration:
                    return
                pending.append(self._new_pending(index, samples, inflight))
                index += 1

        try:
            while True:
                refill(self.lookahead + 1)  # the current batch + ``lookahead`` batches being planned
                if not pending:
                    break
                p = pending.popleft()
                if self._is_src():
                    entry, error, waited, planning_s, hit = self._resolve(p, inflight, job_results)
                else:
                    entry, error, waited, planning_s, hit = None, None, 0.0, 0.0, False
                local = None if self._is_src() else self.cache.get(p.key)
                shared = share_plan(entry, error, waited, batch_digest=p.bdigest, local=local, group=self.group,
                                    planning_s=planning_s)
                if not self._is_src():
                    hit = local is not None and shared.entry is local
                    planning_s = 0.0 if hit else shared.planning_s
                    self.cache.put(p.key, shared.entry)
                batch = self._make_batch(p, shared.entry, shared.waited_s, planning_s, hit)
                self.history.append({"step": p.index, "waited_s": batch.waited_s, "planning_time_s": planning_s,
                                     "cache_hit": hit, "transferred": shared.transferred, "tokens": batch.num_tokens})
                yield batch
        finally:
            self.close()

    # ------------------------------------------------------------------------------------ misc
    def start(self) -> None:
        """Start the planner worker now (on the planning rank), e.g. while the model is being built; the
        first iteration otherwise starts it."""
        if self._is_src():
            self._planner_or_new().start()

    def close(self) -> None:
        """Stop the planner worker (a later iteration starts a new one)."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self, wait_threshold_s: float = 1e-3) -> dict:
        """Steps so far, steps that waited > ``wait_threshold_s`` for a plan (all / after the first), mean
        planner time of planned batches, cache counters, rejected samples."""
        h = self.history
        waited = [x["waited_s"] > wait_threshold_s for x in h]
        planned = [x["planning_time_s"] for x in h if not x["cache_hit"]]
        return {"steps": len(h), "waited_steps": int(sum(waited)),
                "waited_share": sum(waited) / len(h) if h else 0.0,
                "waited_share_after_first": sum(waited[1:]) / (len(h) - 1) if len(h) > 1 else 0.0,
                "waited_s_total": float(sum(x["waited_s"] for x in h)),
                "planning_s_mean": float(np.mean(planned)) if planned else 0.0,
                "planned": len(planned), "cache": self.cache.stats(), "rejected": len(self.rejected)}


__all__ = ["DCPLoader", "DCPBatch", "Sample", "SampleRejectedError", "LayerKind", "windowed_mask",
           "pack_positions_labels", "IGNORE_INDEX"]
