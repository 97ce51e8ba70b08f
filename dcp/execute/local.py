"""The per-device interpreter shared by every executor.

A ``DeviceRunner`` executes one device's program (``plan.forward`` or ``plan.backward``) against that
device's home rows, as the compiled steps of ``dcp.execute.compile`` (one per Launch, Wait and Compute,
one per run of Reduces after a Wait), in which every index, view, copy and merge was resolved once per
plan. Transfers go through a ``Comm`` (in-memory for the reference executor, ``torch.distributed`` for
the distributed one):

    handle = comm.launch(round, sends=[(peer, uint8 tensor), ...], recvs=[(peer, uint8 tensor), ...])
    tensors = comm.wait(handle)          # the receive tensors, filled, in the order of ``recvs``

Everything a device sends to one peer in one round is packed into ONE contiguous uint8 buffer of typed
regions (``dcp.execute.compile.message_layout``; the messages of a round are slices of one allocation),
so a round is one grouped operation with at most one message per peer and direction. Send and receive
buffers are views of one *message arena* per workspace, planned once per plan (``dcp.execute.arena``).

Data held by a device (layout derived once per plan, direction and device: ``dcp.execute.buffers``):
- home rows: q/k/v (forward), plus dO, lse, delta (backward), local layout = home token blocks stacked in
  block-id order (``plan.local_token_index(d)``): the caller's tensors, read in place and never written;
- per side (q side: Q / QG, kv side: KV) one buffer with a slot per received token block at a fixed
  offset (and, kv side, home blocks that some stage reads next to received ones, copied once per step);
  these slot buffers are allocated once per plan (a *workspace*, cached in ``dcp.execute.tables``) and
  reused by every step of every layer, their views made once. Received inputs are unpacked into their
  slots at ``CommWait`` (a unit that is the only one of its side in every stage that reads it, or that
  is only relayed, stays in its message: no copy);
- partial outputs: O = (o, lse) merged by log-sum-exp, DQ = dq, DKV = (dk, dv) summed. A unit's first
  contribution (rows of a kernel's output, or of the message it came in) is its accumulator, no clone; a
  later one merges into it in place (``merge_into``; sums as one grouped ``add_into`` per step and layer,
  by default ``torch._foreach_add_``), after widening the tensor it lives in to fp32 (fp64 for fp64 runs)
  if needed. Partials of other homes are packed into the message to their home; the home ones are copied
  into the local results at the end, or are the result itself when one kernel call covered every home
  row and head.

Each ``Compute`` runs one kernel call per (q row space, group of head blocks) — one call for most stages —
on views of those tensors (no gather): the tile table, derived once per plan and cached, has segments
and key offsets that address their rows directly. The copies of one step (packing, unpacking, results)
are one ``torch._foreach_copy_``; nothing in a step reads data on the host, so a step runs on ``meta``
tensors too (``dcp.execute.noop``; ``dcp bench overhead`` times it).

Unit payloads (one unit = one token block × one head block, L tokens):
    Q: q [L, hq, D]                 KV: k, v [L, hkv, D]
    O: o [L, hq, D], lse [hq, L]    QG: q, dO [L, hq, D], lse, delta [hq, L]
    DQ: dq [L, hq, D]               DKV: dk, dv [L, hkv, D]
with q/k/v/dO and partials (o, dq, dk, dv) in the element dtype (as ``dcp.layout.units.bytes_per_token`` counts
them; ``partial_dtype`` may raise partials to fp32) and lse/delta in fp32 (fp64 for fp64 runs).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from dcp.errors import ExecutionError
from dcp.execute.arena import bind_arena, plan_arena
from dcp.execute.buffers import new_like_rows
from dcp.execute.compile import Dtypes, Spec
from dcp.execute.fallback import FallbackKernels
from dcp.execute.tables import plan_tables
from dcp.ir.plan import Plan
from dcp.kernels import get_kernels
from dcp.kernels.tiles import TileTable
from dcp.kernels.varlen_ops import gpu_varlen_available


# --------------------------------------------------------------------------------------------- comm
class Comm(Protocol):
    """Point-to-point transfers of one device, grouped per round."""

    def launch(self, round: int, sends: list[tuple[int, torch.Tensor]],
               recvs: list[tuple[int, torch.Tensor]]) -> Any:
        """Post this round's sends and receives (non-blocking); return a handle for ``wait``. A send tensor
        may be a view of the device's inputs, accumulators or message arena: read it, never write it, and
        be done with it when ``wait`` returns. A receive fills the given contiguous uint8 tensor (a view of
        the arena) with exactly its bytes."""

    def wait(self, handle: Any) -> list[torch.Tensor]:
        """Block until the round's transfers (sends included) are done; the receive tensors of ``recvs``,
        filled, in their order."""


# ------------------------------------------------------------------------------------------ kernels
def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse / delta / accumulator dtype: fp64 for fp64 runs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class KernelAdapter:
    """The kernels an executor calls: ``dcp.kernels`` for fp32/bf16/fp16 and, for fp64 inputs, the same
    kernels only if they keep the row statistics (lse, delta) in fp64 — fp32 statistics cap the accuracy
    of an fp64 run near 1e-7 — else the dense fallback here (probed once per kernels object)."""

    def __init__(self, kernels, auto: bool = False):
        self.kernels = kernels
        self.name = getattr(kernels, "name", type(kernels).__name__)
        self.auto = auto  # chosen by "auto": free to pick per device
        self._fp64 = None

    def _fp64_capable(self) -> bool:
        if self._fp64 is None:
            ok = False
            try:
                i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
                table = TileTable(seg_cu=i32([0, 1]), seg_tile_ptr=i32([0, 1]), tile_k_start=i32([0]),
                                  tile_k_len=i32([1]), tile_mask_row=i32([-1]),
                                  mask_ranges=torch.zeros((0, 1, 2), dtype=torch.int32))
                x = torch.ones((1, 1, 1), dtype=torch.float64)
                _, lse = self.kernels.forward(x, x, x, table, 1.0)
                if lse.dtype == torch.float64:
                    st = torch.zeros((1, 1), dtype=torch.float64)
                    self.kernels.backward(x, x, x, x, st, st, table, 1.0, out_dtype=torch.float64)
                    ok = True
            except Exception:  # noqa: BLE001 - any refusal means: not fp64-capable
                ok = False
            self._fp64 = ok
        return self._fp64

    def for_input(self, dtype: torch.dtype, device: torch.device, head_dim: int | None = None):
        """The kernels to run inputs of this dtype and head dim on this device with.

        The C++ attention kernels take CPU tensors only: on a GPU, 'auto' and 'native' become the fused
        varlen (flash) kernels where they can run the inputs (fp16/bf16), else the reference kernels."""
        if dtype == torch.float64 and not isinstance(self.kernels, FallbackKernels) and not self._fp64_capable():
            return _FALLBACK
        if device.type != "cpu" and (self.auto or getattr(self.kernels, "name", "") == "native"):
            if head_dim is not None and gpu_varlen_available(dtype, device, head_dim):
                return get_kernels("varlen")
            return get_kernels("reference")
        return self.kernels


_FALLBACK = FallbackKernels()


_ADAPTERS: dict = {}


def resolve_kernels(kernels=None) -> KernelAdapter:
    """``None``/"auto"/"reference"/"native"/"varlen" → ``dcp.kernels.get_kernels(name)`` ("fallback": the
    small dense kernels here); objects with ``forward``,
    ``backward`` and ``merge_into`` pass through. Returns a ``KernelAdapter`` (cached per name / object,
    so the fp64 probe runs once)."""
    if isinstance(kernels, KernelAdapter):
        return kernels
    if kernels is not None and not isinstance(kernels, str):
        key = ("object", id(kernels))
        got = _ADAPTERS.get(key)
        if got is None or got.kernels is not kernels:
            got = _ADAPTERS[key] = KernelAdapter(kernels)
        return got
    name = kernels or "auto"
    got = _ADAPTERS.get(name)
    if got is None:
        if name == "fallback":
            got = KernelAdapter(_FALLBACK)
        else:
            got = KernelAdapter(get_kernels(name), auto=name == "auto")
        _ADAPTERS[name] = got
    return got


# ------------------------------------------------------------------------------------ the runner
def _view(S: list, s):
    """The tensor a ``Spec`` names in the step's spaces ``S`` (a bound view passes through)."""
    if s.__class__ is not Spec:
        return s
    t = S[s[0]]
    a = s[1]
    if a is None:
        return t
    h = s[3]
    if s[4] == 3:
        return t[a:s[2]] if h is None else t[a:s[2], h]
    return t[:, a:s[2]] if h is None else t[h, a:s[2]]


def _cut(t: torch.Tensor, a: int, b: int, h, dim: int) -> torch.Tensor:
    if dim == 3:
        return t[a:b] if h is None else t[a:b, h]
    return t[:, a:b] if h is None else t[h, a:b]


class ViewBatch(NamedTuple):
    """Views that one step makes together: per (space, layout) with several disjoint row ranges, ONE
    ``tensor_split`` of the space's tensor (one dispatch for all its views); the rest one by one."""
    groups: tuple    # ((space, split dim, cut rows), ...)
    picks: tuple     # per view: (group, part) | (-1, Spec or bound tensor)


def batch_views(specs) -> ViewBatch:
    """The ``ViewBatch`` of ``specs`` (``Spec`` or bound tensors), in their order."""
    ranges: dict = {}
    for s in specs:
        if s.__class__ is Spec:
            space, a, b, heads, dim, _ = s
            if a is not None and heads is None and b > a:
                rr = ranges.get((space, dim))
                if rr is None:
                    ranges[space, dim] = {(a, b)}
                else:
                    rr.add((a, b))
    groups, where = [], {}
    for (space, dim), rr in ranges.items():
        if len(rr) < 2:
            continue  # one view (as cheap alone)
        rr = sorted(rr)
        if any(b > a2 for (_, b), (a2, _) in zip(rr, rr[1:])):
            continue  # overlapping ranges (no partition has both)
        cuts = sorted({x for r in rr for x in r})
        part = {x: i + 1 for i, x in enumerate(cuts)}
        g = len(groups)
        groups.append((space, 0 if dim == 3 else 1, tuple(cuts)))
        for a, b in rr:
            where[space, dim, a, b] = (g, part[a])
    if not where:
        return ViewBatch((), tuple([(-1, s) for s in specs]))
    picks = tuple([where.get((s[0], s[4], s[1], s[2]), (-1, s)) if s.__class__ is Spec and s[3] is None
                   and s[1] is not None else (-1, s) for s in specs])
    return ViewBatch(tuple(groups), picks)


def _batch_merges(merges) -> tuple:
    """A step's merges with their views batched: (widen, (the O merges' views, 4 each), ((n dsts, views of
    dsts + srcs), ...) per sum layer)."""
    widen, o_merges, layers = merges
    return (widen, batch_views([s for p in o_merges for s in p]) if o_merges else None,
            tuple((len(dsts), batch_views(dsts + srcs)) for dsts, srcs in layers))


def _bind(st, fn):
    """Compute step ``st`` with the ``Spec`` of every view that may name a slot buffer replaced by ``fn(spec)``
    (Launch and Wait steps are bound by ``dcp.execute.arena.bind_arena``)."""
    if st.code == "compute":
        return st._replace(calls=tuple((tuple([fn(s) for s in qs]), tuple([fn(s) for s in kvs]), table, outs)
                                       for qs, kvs, table, outs in st.calls), merges=_batch_merges(st.merges))
    if st.code == "reduce":
        return st._replace(merges=_batch_merges(st.merges))
    if st.code == "launch":
        return st._replace(srcs=batch_views([s for m in st.msgs for s in m[3]]))
    return st


class Workspace:
    """What one (plan, direction, device, home tensors' dtypes and shapes, torch device) keeps between steps:
    the slot buffers, the message arena (``dcp.execute.arena``: every send and receive buffer at a fixed
    offset), the compiled steps with every view of them made (bound), the rows zeroed and staged per step.
    ``busy`` while a runner uses it (a second runner at the same time gets its own)."""

    def __init__(self, comp, side_q: tuple, side_kv: tuple):
        self.busy = False
        S0: list = [None] * comp.n_spaces
        ns = {comp.buf_q: comp.buf_rows[0], comp.buf_kv: comp.buf_rows[1]}
        for spaces, homes in ((comp.buf_q, side_q), (comp.buf_kv, side_kv)):
            if ns[spaces]:
                for s, t in zip(spaces, homes):
                    S0[s] = new_like_rows(t, ns[spaces])
        persistent = {s for s in comp.buf_q + comp.buf_kv if S0[s] is not None}
        self.S0 = S0
        made: dict = {}

        def bind(spec):
            if spec[0] not in persistent:
                return spec
            got = made.get(spec.vid)
            if got is None:
                got = made[spec.vid] = _view(S0, spec)
            return got

        self.arena = plan_arena(comp)
        self.arena_buf, steps = bind_arena(comp, self.arena, side_q[0].device, bind)
        self.steps = [_bind(st, bind) for st in steps]
        self.zero = [_view(S0, s) for s in comp.zero]
        self.staged_dst = [_view(S0, d) for d, _ in comp.staged]
        self.staged_src = [s for _, s in comp.staged]


class DeviceRunner:
    """Interpreter of one device's program for one direction.

    Args:
        plan, device, direction: what to run.
        home: forward: ``(q, k, v)`` local tensors; backward: ``(q, k, v, do, lse, delta)`` with
            ``lse``/``delta`` ``[Hq, n_local]`` in the stat dtype. They are read in place, never written.
        comm: the device's ``Comm``.
        kernels: object with ``forward``/``backward``/``merge_into`` (see ``dcp.kernels``; an optional
            ``add_into(accs, parts)`` does the in-place sums, else ``torch._foreach_add_``).
        scale: softmax scale.
        partial_dtype: dtype of partial outputs on the wire (None: the element dtype).

    Constructing a runner prepares the step: the plan's compiled steps and a workspace (both cached per
    plan, built the first time), the home tensors in place, staged rows copied. ``run`` (or
    ``run_segment`` per round, for lockstep execution) runs the steps, ``finish_forward`` /
    ``finish_backward`` return the local results. A plan the device cannot run raises ``ExecutionError``
    here, before any step.
    """

    def __init__(self, plan: Plan, device: int, direction: str, home: Sequence[torch.Tensor], comm: Comm,
                 kernels, scale: float, partial_dtype: torch.dtype | None = None):
        self.plan, self.rank, self.direction = plan, device, direction
        self.fwd = direction == "forward"
        self.home = home
        self.comm, self.scale = comm, float(scale)
        self.dev = home[0].device
        self.dt = Dtypes.of(home[0].dtype, partial_dtype)
        self.kernels = resolve_kernels(kernels).for_input(self.dt.el, self.dev, int(home[0].shape[-1]))
        self.add_into = getattr(self.kernels, "add_into", None) or torch._foreach_add_
        self.tab = tab = plan_tables(plan)
        self.comp = comp = tab.compiled(direction, device, self.dt)
        side_q = tuple(home[:1]) if self.fwd else (home[0], home[3], home[4], home[5])
        side_kv = (home[1], home[2])
        key = (direction, device, self.dt, self.dev, tuple((t.dtype, tuple(t.shape)) for t in side_q + side_kv))
        self.ws = ws = tab.workspace(key, lambda: Workspace(comp, side_q, side_kv))
        S = self.S = list(ws.S0)
        for s, t in zip(comp.home_q + comp.home_kv, side_q + side_kv):
            S[s] = t
        self.V: list = [None] * comp.n_views  # the step's views, made at first use
        if ws.zero:
            torch._foreach_zero_(ws.zero)
        if ws.staged_dst:
            torch._foreach_copy_(ws.staged_dst, [_view(S, s) for s in ws.staged_src])
        self.steps, self.seg_starts = ws.steps, comp.seg_starts
        self.pending: dict = {}

    # -- segments for lockstep execution
    @property
    def n_rounds(self) -> int:
        return len(self.seg_starts) - 1

    def run_segment(self, r: int, part: str = "all") -> None:
        """Run segment r: ``part`` "launch" (its first step, a launch when r >= 1), "rest", or "all"."""
        steps, starts = self.steps, self.seg_starts
        a = starts[r] if r < len(starts) else len(steps)
        b = starts[r + 1] if r + 1 < len(starts) else len(steps)
        if r >= 1:
            if part in ("launch", "all"):
                self.step(steps[a])
            if part == "launch":
                return
            a += 1
        for st in steps[a:b]:
            self.step(st)

    def step(self, st) -> None:
        """Run one compiled step (``self.steps``)."""
        _STEP_FNS[st.code](self, st)

    def run(self) -> None:
        fns = _STEP_FNS
        try:
            for st in self.steps:
                fns[st.code](self, st)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give the workspace back (``finish_*`` does; after a failed step, so that the next runner may
        reuse it)."""
        self.ws.busy = False

    # -- steps
    def _get(self, s):
        """The tensor a ``Spec`` names (made once per step; a bound view passes through)."""
        if s.__class__ is not Spec:
            return s
        space, a, b, h, dim, vid = s
        t = self.V[vid]
        if t is None:
            t = self.S[space]
            if a is not None:
                if dim == 3:
                    t = t[a:b] if h is None else t[a:b, h]
                else:
                    t = t[:, a:b] if h is None else t[h, a:b]
            self.V[vid] = t
        return t

    def _views(self, vb: ViewBatch) -> list:
        """The tensors of a ``ViewBatch``, now."""
        S, get = self.S, self._get
        parts = [S[space].tensor_split(cuts, dim) for space, dim, cuts in vb.groups]
        return [parts[g][i] if g >= 0 else get(i) for g, i in vb.picks]

    def _err(self, msg: str) -> ExecutionError:
        return ExecutionError(f"{self.direction} device {self.rank}: {msg}")

    def _launch(self, st) -> None:
        get = self._get
        sends, dsts, srcs, at = [], [], [], 0
        views = self._views(st.srcs) if st.srcs.picks else ()
        for peer, send, piece_dsts, piece_srcs, alias in st.msgs:  # (views of the arena, made once)
            a, at = at, at + len(piece_srcs)
            if alias is not None:  # one tensor nobody writes any more: its bytes are the message
                v = get(alias[0])
                if v.dtype == alias[1] and v.is_contiguous():
                    sends.append((peer, v.view(-1).view(torch.uint8)))
                    continue
            dsts += piece_dsts
            srcs += views[a:at]
            sends.append((peer, send))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        self.pending[st.round] = self.comm.launch(st.round, sends, st.recvs)

    def _wait(self, st) -> None:
        got = self.comm.wait(self.pending.pop(st.round))
        if len(got) != st.n_msgs:
            raise self._err(f"round {st.round}: {len(got)} messages arrived, expected {st.n_msgs}")
        S = self.S
        for space, v in st.regions:  # received regions kept as they are (relayed inputs, partials)
            S[space] = v
        if st.dsts:
            torch._foreach_copy_(st.dsts, st.srcs)

    def _compute(self, st) -> None:
        S, get, kern, scale, stat = self.S, self._get, self.kernels, self.scale, self.dt.stat
        if self.fwd:
            for qs, kvs, table, outs in st.calls:
                o, lse = kern.forward(get(qs[0]), get(kvs[0]), get(kvs[1]), table, scale)
                S[outs[0]] = o
                S[outs[1]] = lse if lse.dtype == stat else lse.to(stat)
        else:
            for qs, kvs, table, outs in st.calls:
                q, do, lse, delta = [get(s) for s in qs]
                dq, dk, dv = kern.backward(do, q, get(kvs[0]), get(kvs[1]), lse, delta, table, scale,
                                           out_dtype=stat)
                S[outs[0]], S[outs[1]], S[outs[2]] = dq, dk, dv
        if st.merges[0]:
            self._merge(st.merges)

    def _reduce(self, st) -> None:
        self._merge(st.merges)

    def _merge(self, merges) -> None:
        widen, o_views, layers = merges
        S, stat = self.S, self.dt.stat
        for s in widen:
            t = S[s]
            if t.dtype != stat:
                S[s] = t.to(stat)
        if o_views is not None:
            v = self._views(o_views)
            for i in range(0, len(v), 4):
                self.kernels.merge_into(v[i], v[i + 1], v[i + 2], v[i + 3])
        for n, vb in layers:
            v = self._views(vb)
            self.add_into(v[:n], v[n:])

    # -- results
    def _results(self) -> list[torch.Tensor]:
        S, get, dev, out = self.S, self._get, self.dev, []
        for recipe in self.comp.results:
            for r in recipe:
                if r[0] == "whole":  # a kernel output, never a region of the arena (``plan_arena`` checks)
                    out.append(S[r[1]].to(r[2]))
                    continue
                _, shape, dtype, dim, pieces, fills, empty = r
                res = torch.empty(shape, dtype=dtype, device=dev)
                if pieces:
                    torch._foreach_copy_([_cut(res, a, b, h, dim) for (a, b, h), _ in pieces],
                                         [get(s) for _, s in pieces])
                for a, b, h in fills:
                    _cut(res, a, b, h, dim).fill_(empty)
                out.append(res)
        self.release()
        return out

    def _blocks(self, out: list, blocks: dict) -> None:
        for tb, a, m in self.comp.home_rows:
            blocks.setdefault(tb, []).extend(_cut(t, a, a + m, None, t.dim()) for t in out)

    def finish_forward(self, blocks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(o_local [n_local, Hq, D] in the element dtype, lse_local [Hq, n_local] in the stat dtype). With
        ``blocks`` (a dict) instead: ``blocks[tb]`` gets home block tb's (o, lse) rows, for assembling the
        packed result."""
        out = self._results()
        if blocks is not None:
            return self._blocks(out, blocks)
        return own_storages(*out)

    def finish_backward(self, blocks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(dq, dk, dv) local, in the element dtype; with ``blocks``: like ``finish_forward``."""
        out = self._results()
        if blocks is not None:
            return self._blocks(out, blocks)
        return own_storages(*out)

    @property
    def can_hand_blocks(self) -> bool:
        """Whether ``finish_*`` can hand each home token block's result rows (always)."""
        return True


# step code -> the runner's method running it: a class-level table, not a dict of bound methods on the runner
# (that would be a reference cycle, leaving every finished runner and its views to the garbage collector)
_STEP_FNS = {"launch": DeviceRunner._launch, "wait": DeviceRunner._wait, "compute": DeviceRunner._compute,
             "reduce": DeviceRunner._reduce}


def own_storages(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors``, each on a storage of its own: results adopted from one received message are views of
    one uint8 buffer (o in the element dtype, lse in fp32), and ``torch.save`` refuses tensors that share
    a storage with different dtypes. A tensor sharing an earlier one's storage is copied."""
    seen, out = set(), []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr() if t.numel() and t.device.type != "meta" else None
        out.append(t.clone() if ptr is not None and ptr in seen else t)
        seen.add(ptr)
    return tuple(out)


def backward_home(q, k, v, o, lse, do) -> tuple:
    """Home inputs of the backward program: (q, k, v, do, lse, delta) with delta = rowsum(dO * O)."""
    stat = _stat_dtype(q.dtype)
    delta = (do.to(stat) * o.to(stat)).sum(-1).t().contiguous()
    return q, k, v, do.contiguous(), lse.to(stat).contiguous(), delta


def default_scale(plan: Plan, scale: float | None) -> float:
    return 1.0 / math.sqrt(plan.spec.head_dim) if scale is None else float(scale)
