"""The per-device interpreter shared by every executor.

A ``DeviceRunner`` executes one device's stream of a program (``plan.forward`` or ``plan.backward``,
read through its per-device index ranges, ``dcp.ir.program``)
against that device's home rows. Transfers go through a ``Comm`` (in-memory for the reference executor,
``torch.distributed`` for the distributed one):

    handle = comm.launch(round, sends=[(peer, uint8 tensor), ...], recvs=[(peer, shape, dtype), ...])
    tensors = comm.wait(handle)          # in the order of ``recvs``

Everything a device sends to one peer in one round is packed into ONE contiguous uint8 buffer (the units
in sorted order, each of its tensors padded to 8 bytes so that the receiver can view them back in place),
so a round is one grouped operation with at most one message per peer and direction.

Data held by a device (layout derived once per plan, direction and device: ``dcp.execute.buffers``):
- home rows: q/k/v (forward), plus dO, lse, delta (backward), local layout = home token blocks stacked in
  block-id order (``plan.local_token_index(d)``): the caller's tensors, read in place and never written;
- per side (q side: Q / QG, kv side: KV) one buffer with a slot per received token block at a fixed
  offset (and, kv side, home blocks that some stage reads next to received ones, copied once per step);
  received inputs are unpacked into their slots at ``CommWait`` (a unit that is the only one of its side
  in every stage that reads it, or that is only relayed, stays in its message: no copy);
- partial outputs: O = (o, lse) merged by log-sum-exp, DQ = dq, DKV = (dk, dv) summed. A unit's first
  contribution (a view of the kernel's output, or of the message it came in) is its accumulator, no
  clone; a second one merges into it in place (``merge_into`` / ``add_``), after widening it to fp32
  (fp64 for fp64 runs) if needed. Partials of other homes are packed into the message to their home;
  the home ones are assembled into the local result at the end in one pass (one ``cat`` per tensor), or
  are the result itself when one kernel call covered every home row and head;
- received partials, merged into the accumulator by ``Reduce``.

``Compute(stage, tiles)`` runs one kernel call per (q row space, group of head blocks) — one call for
most stages — on views of those tensors (no gather): the tile table, derived once per plan and cached,
has segments and key offsets that address their rows directly.

Unit payloads (one unit = one token block × one head block, L tokens):
    Q: q [L, hq, D]                 KV: k, v [L, hkv, D]
    O: o [L, hq, D], lse [hq, L]    QG: q, dO [L, hq, D], lse, delta [hq, L]
    DQ: dq [L, hq, D]               DKV: dk, dv [L, hkv, D]
with q/k/v/dO and partials (o, dq, dk, dv) in the element dtype (as ``dcp.layout.units.bytes_per_token`` counts
them; ``partial_dtype`` may raise partials to fp32) and lse/delta in fp32 (fp64 for fp64 runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from dcp.errors import ExecutionError
from dcp.execute.buffers import BUF, HOME, MSG, cat_as, nbytes, new_like_rows, pack, rows_of, unpack
from dcp.execute.fallback import FallbackKernels
from dcp.execute.tables import INPUT_KINDS, OUTPUT_KINDS, Op, plan_tables
from dcp.ir.instructions import Unit
from dcp.ir.plan import Plan
from dcp.kernels import get_kernels
from dcp.kernels.tiles import TileTable
from dcp.kernels.varlen_ops import gpu_varlen_available
from dcp.layout.units import Kind


# --------------------------------------------------------------------------------------------- comm
class Comm(Protocol):
    """Point-to-point transfers of one device, grouped per round."""

    def launch(self, round: int, sends: list[tuple[int, torch.Tensor]],
               recvs: list[tuple[int, tuple, torch.dtype]]) -> Any:
        """Post this round's sends and receives (non-blocking); return a handle for ``wait``. A send tensor
        may be a view of the device's inputs or accumulators: read it, never write it."""

    def wait(self, handle: Any) -> list[torch.Tensor]:
        """Block until the round's transfers are done; the received tensors in the order of ``recvs``."""


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
@dataclass(frozen=True)
class Dtypes:
    el: torch.dtype      # q/k/v/dO
    part: torch.dtype    # partial outputs on the wire
    stat: torch.dtype    # lse, delta, accumulators

    @staticmethod
    def of(dtype: torch.dtype, partial_dtype: torch.dtype | None = None) -> "Dtypes":
        return Dtypes(dtype, partial_dtype or dtype, _stat_dtype(dtype))


class DeviceRunner:
    """Interpreter of one device's program for one direction.

    Args:
        plan, device, direction: what to run.
        home: forward: ``(q, k, v)`` local tensors; backward: ``(q, k, v, do, lse, delta)`` with
            ``lse``/``delta`` ``[Hq, n_local]`` in the stat dtype. They are read in place, never written.
        comm: the device's ``Comm``.
        kernels: object with ``forward``/``backward``/``merge_into`` (see ``dcp.kernels``).
        scale: softmax scale.
        partial_dtype: dtype of partial outputs on the wire (None: the element dtype).
    """

    def __init__(self, plan: Plan, device: int, direction: str, home: Sequence[torch.Tensor], comm: Comm,
                 kernels, scale: float, partial_dtype: torch.dtype | None = None):
        self.plan, self.rank, self.direction = plan, device, direction
        self.tab = tab = plan_tables(plan)
        self.ops, self.seg_starts = tab.program(direction, device)
        self.lay = lay = tab.layout(direction, device)
        self.home = home
        self.comm, self.scale = comm, float(scale)
        self.dev = home[0].device
        self.dt = Dtypes.of(home[0].dtype, partial_dtype)
        self.kernels = resolve_kernels(kernels).for_input(self.dt.el, self.dev, int(home[0].shape[-1]))
        self.in_q, self.in_kv = INPUT_KINDS[direction]
        fwd = direction == "forward"
        # the two sides: the caller's tensors (HOME) and the slot buffers (BUF), one per input tensor
        self.side_q = [tuple(home[:1]) if fwd else (home[0], home[3], home[4], home[5]), None]
        self.side_kv = [(home[1], home[2]), None]
        for side, n, zero in ((self.side_q, lay.n_q, lay.zero_q), (self.side_kv, lay.n_kv, lay.zero_kv)):
            if n:
                side[BUF] = tuple(new_like_rows(t, n) for t in side[HOME])
                for t in side[BUF]:
                    for a, m in zero:
                        rows_of(t, a, a + m).zero_()
        for h, b, n in lay.staged:
            for src, dst in zip(self.side_kv[HOME], self.side_kv[BUF]):
                dst[b:b + n].copy_(src[h:h + n])
        self.arrived: set[Unit] = set()
        self.relay: dict[Unit, list[torch.Tensor]] = {}   # received inputs no stage reads (only relayed)
        # partial outputs: a unit's first contribution (kernel output or message views) is its accumulator,
        # widened to the stat dtype when a second one is merged in; home results are assembled at the end
        self.hacc: dict[Any, list[torch.Tensor]] = {}      # home units (keyed by ``_home_key``)
        self.whole: dict[Kind, tuple] = {}                 # kernel outputs adopted as all home accumulators
        self.touched: set[Kind] = set()
        self.moved: set[Kind] = set()                      # kinds with an accumulator widened to the stat dtype
        self.acc: dict[Unit, list[torch.Tensor]] = {}      # partials of other homes, until sent
        self.sent: set[Unit] = set()
        self.inbox: dict[tuple[Unit, int], list[torch.Tensor]] = {}
        self.pending: dict[int, tuple[Any, tuple]] = {}

    # -- segments for lockstep execution
    @property
    def n_rounds(self) -> int:
        return len(self.seg_starts) - 1

    def run_segment(self, r: int, part: str = "all") -> None:
        """Run segment r: ``part`` "launch" (its first op, a launch when r >= 1), "rest", or "all"."""
        a = self.seg_starts[r] if r < len(self.seg_starts) else len(self.ops)
        b = self.seg_starts[r + 1] if r + 1 < len(self.seg_starts) else len(self.ops)
        if r >= 1:
            if part in ("launch", "all"):
                self._step(self.ops[a])
            if part == "launch":
                return
            a += 1
        for op in self.ops[a:b]:
            self._step(op)

    def run(self) -> None:
        for op in self.ops:
            self._step(op)

    # -- instructions
    def _step(self, op: Op) -> None:
        if op.code == "launch":
            self._launch(op)
        elif op.code == "wait":
            self._wait(op)
        elif op.code == "compute":
            self._compute(op)
        else:
            self._reduce(op)

    def _err(self, msg: str) -> ExecutionError:
        return ExecutionError(f"{self.direction} device {self.rank}: {msg}")

    def _is_home(self, tb: int) -> bool:
        return int(self.tab.home[tb]) == self.rank

    def _heads(self, unit: Unit) -> slice:
        tab = self.tab
        if unit.kind in (Kind.KV, Kind.DKV):
            return slice(tab.kv_lo[unit.hb], tab.kv_lo[unit.hb] + tab.kvb)
        return slice(unit.hb * tab.hqb, (unit.hb + 1) * tab.hqb)

    def _missing(self, unit: Unit) -> ExecutionError:
        return self._err(f"needs input {unit.kind.name}[{unit.tb},{unit.hb}], which it neither holds nor received")

    def _input(self, unit: Unit) -> list[torch.Tensor]:
        """Views of an input unit: in the caller's tensors, its BUF slot, or the message it came in."""
        if unit.kind not in (self.in_q, self.in_kv):
            raise self._err(f"{unit.kind.name} is not an input of the {self.direction} pass")
        side = self.side_q if unit.kind == self.in_q else self.side_kv
        if self._is_home(unit.tb):
            src, row = side[HOME], int(self.tab.local_off[unit.tb])
        elif unit not in self.arrived:
            raise self._missing(unit)
        elif unit in self.relay:
            return self.relay[unit]
        else:
            src, row = side[BUF], (self.lay.q_slot if unit.kind == self.in_q else self.lay.kv_slot)[unit.tb]
        n, heads = int(self.tab.tb_len[unit.tb]), self._heads(unit)
        return [rows_of(t, row, row + n, heads) for t in src]

    def _payload(self, unit: Unit) -> list[torch.Tensor]:
        if unit.kind in (self.in_q, self.in_kv):
            return self._input(unit)
        if unit in self.sent:
            raise self._err(f"sends partial {unit.kind.name}[{unit.tb},{unit.hb}] twice")
        acc = self.acc.pop(unit, None)
        if acc is None:
            raise self._err(f"sends partial {unit.kind.name}[{unit.tb},{unit.hb}], which it never computed")
        self.sent.add(unit)
        return acc

    def _launch(self, op: Op) -> None:
        sends = []
        for peer, units in op.sends:
            # a message of one tensor nobody writes any more (home input, sent partial) is sent as is
            alias = not any(u.kind in (self.in_q, self.in_kv) and not self._is_home(u.tb) and u not in self.relay
                            for u in units)
            tensors = [t for u in units for t in self._payload(u)]
            sends.append((peer, pack(tensors, self.tab.message(units, self.dt), self.dev, alias)))
        recvs = [(peer, (sum(nbytes(s, dt) for s, dt in self.tab.message(units, self.dt)),), torch.uint8)
                 for peer, units in op.recvs]
        if op.round in self.pending:
            raise self._err(f"launches round {op.round} twice")
        self.pending[op.round] = (self.comm.launch(op.round, sends, recvs), op.recvs)

    def _wait(self, op: Op) -> None:
        got = self.pending.pop(op.round, None)
        if got is None:
            raise self._err(f"waits for round {op.round}, which it never launched")
        handle, recv_groups = got
        bufs = self.comm.wait(handle)
        for (peer, units), buf in zip(recv_groups, bufs):
            layout = self.tab.message(units, self.dt)
            want = sum(nbytes(s, dt) for s, dt in layout)
            if buf.numel() != want or buf.dtype != torch.uint8:
                raise self._err(f"round {op.round}: message from device {peer} has {buf.numel()} bytes, "
                                f"expected {want}")
            tensors = unpack(buf, layout)
            i = 0
            for u in units:
                n = len(self.tab.pieces(u.kind, u.tb, self.dt))
                part = tensors[i:i + n]
                i += n
                if u.kind in (self.in_q, self.in_kv):
                    self._store_input(u, part)
                else:
                    if (u, peer) in self.inbox:
                        raise self._err(f"receives partial {u.kind.name}[{u.tb},{u.hb}] from {peer} twice")
                    self.inbox[u, peer] = part

    def _store_input(self, u: Unit, part: list[torch.Tensor]) -> None:
        """Unpack a received input unit into its BUF slot (kept as message views when no stage reads it)."""
        q_side = u.kind == self.in_q
        row = (self.lay.q_slot if q_side else self.lay.kv_slot).get(u.tb)
        self.arrived.add(u)
        if row is None or self._is_home(u.tb):
            self.relay[u] = part
            return
        self.relay.pop(u, None)
        n, heads = int(self.tab.tb_len[u.tb]), self._heads(u)
        for dst, src in zip((self.side_q if q_side else self.side_kv)[BUF], part):
            rows_of(dst, row, row + n, heads).copy_(src)

    # -- partial outputs
    def _home_key(self, unit: Unit):
        # dK/dV of head blocks that share a kv head (blocks smaller than a GQA group) add up in one region
        return (unit.kind, unit.tb, self.tab.kv_lo[unit.hb]) if unit.kind == Kind.DKV else unit

    def _merge(self, kind: Kind, acc: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
        if kind == Kind.O:
            self.kernels.merge_into(acc[0], acc[1], parts[0], parts[1])
        else:
            for a, p in zip(acc, parts):
                a.add_(p)

    def _acc_add(self, unit: Unit, parts: list[torch.Tensor]) -> None:
        """First contribution: its tensors (kernel output or message views, which nothing else uses) become
        the accumulator, no clone; later ones merge into it in place (widened to the stat dtype first)."""
        if unit in self.sent:
            raise self._err(f"adds to partial {unit.kind.name}[{unit.tb},{unit.hb}] after sending it")
        home = self._is_home(unit.tb)
        store, key = (self.hacc, self._home_key(unit)) if home else (self.acc, unit)
        if home:
            self.touched.add(unit.kind)
        acc = store.get(key)
        if acc is None:
            store[key] = list(parts)
            return
        if any(a.dtype != self.dt.stat for a in acc):
            acc = store[key] = [a.to(self.dt.stat) for a in acc]
            self.moved.add(unit.kind)
        self._merge(unit.kind, acc, parts)

    def _home_units(self, kind: Kind) -> list[tuple[Any, int, slice]]:
        """(key, token block, heads) of every home accumulator region of ``kind``, in local row order."""
        out, seen = [], set()
        for tb in self.lay.home_q:
            for hb in range(self.tab.nhb):
                u = Unit(kind, tb, hb)
                key = self._home_key(u)
                if key not in seen:
                    seen.add(key)
                    out.append((key, tb, self._heads(u)))
        return out

    def _adopt(self, kind: Kind, outs: tuple) -> bool:
        """A kernel output covering every home row and head, before any other contribution, becomes the
        home accumulator as a whole (and the finished result, unless a region had to be widened)."""
        if kind in self.touched or any(t.dtype != self.dt.stat and t.dim() == 2 for t in outs):
            return False
        self.touched.add(kind)
        self.whole[kind] = outs
        for key, tb, heads in self._home_units(kind):
            row = int(self.tab.local_off[tb])
            self.hacc[key] = [rows_of(t, row, row + int(self.tab.tb_len[tb]), heads) for t in outs]
        return True

    def _reduce(self, op: Op) -> None:
        for src in op.sources:
            parts = self.inbox.pop((op.unit, src), None)
            if parts is None:
                raise self._err(f"reduces {op.unit.kind.name}[{op.unit.tb},{op.unit.hb}] from device {src}, "
                                f"which never sent it")
            self._acc_add(op.unit, parts)

    def _src(self, side: list, src: int, kind: Kind, out: tuple) -> Sequence[torch.Tensor]:
        if src == MSG:  # the call's one unit on this side, as it arrived
            return self.relay[Unit(kind, out[0][0], out[0][1])]
        return side[src]

    def _compute(self, op: Op) -> None:
        for c in op.calls:
            for u in c.needs:
                if u not in self.arrived:
                    raise self._missing(u)
            qs = [rows_of(t, c.q_lo, c.q_hi, c.hq) for t in self._src(self.side_q, c.q_src, self.in_q, c.q_out)]
            k, v = (rows_of(t, c.kv_lo, c.kv_hi, c.hk) for t in self._src(self.side_kv, c.kv_src, self.in_kv,
                                                                             c.kv_out))
            if self.direction == "forward":
                o, lse = self.kernels.forward(qs[0], k, v, c.table, self.scale)
                if not (c.q_home_full and self._adopt(Kind.O, (o, lse))):
                    for tb, hb, a, b, hs in c.q_out:
                        self._acc_add(Unit(Kind.O, tb, hb), [rows_of(o, a, b, hs), rows_of(lse, a, b, hs)])
                continue
            dq, dk, dv = self.kernels.backward(qs[1], qs[0], k, v, qs[2], qs[3], c.table, self.scale,
                                               out_dtype=self.dt.stat)
            if not (c.q_home_full and self._adopt(Kind.DQ, (dq,))):
                for tb, hb, a, b, hs in c.q_out:
                    self._acc_add(Unit(Kind.DQ, tb, hb), [rows_of(dq, a, b, hs)])
            if not (c.kv_home_full and self._adopt(Kind.DKV, (dk, dv))):
                for tb, hb, a, b, hs in c.kv_out:
                    self._acc_add(Unit(Kind.DKV, tb, hb), [rows_of(dk, a, b, hs), rows_of(dv, a, b, hs)])

    # -- results
    def _check_done(self) -> None:
        if self.pending:
            raise self._err(f"rounds {sorted(self.pending)} launched but never waited")
        if self.inbox:
            (u, src) = next(iter(self.inbox))
            raise self._err(f"partial {u.kind.name}[{u.tb},{u.hb}] received from device {src} is never merged")
        for u in self.acc:
            raise self._err(f"partial {u.kind.name}[{u.tb},{u.hb}] is never sent to its home "
                            f"{int(self.tab.home[u.tb])}")

    def _split(self, kind: Kind) -> bool:
        """Whether head blocks split the rows of ``kind``'s home results into several regions."""
        h = self.tab.hkv if kind == Kind.DKV else self.tab.hq
        return any(heads != slice(0, h) for _, _, heads in self._home_units(kind))

    def _result(self, kind: Kind, dtypes: tuple, empty: tuple, blocks: dict | None) -> list[torch.Tensor]:
        """The local result tensors of ``kind`` (regions nothing was added to set to ``empty``): an adopted
        whole kernel output as it is, else one ``cat`` of the regions per tensor (one copy per region when
        head blocks split rows). With ``blocks``: append each home block's rows to ``blocks[tb]`` instead."""
        whole = self.whole.get(kind)
        if blocks is None and whole is not None and kind not in self.moved:
            return [t.to(dt) for t, dt in zip(whole, dtypes)]
        tab, n = self.tab, int(self.tab.n_local[self.rank])
        h, split = (tab.hkv if kind == Kind.DKV else tab.hq), self._split(kind)
        out = []
        for i, (dt, value) in enumerate(zip(dtypes, empty)):
            stat_rows = kind == Kind.O and i == 1  # lse [H, T]: rows along dim 1

            def shape(m: int) -> tuple:
                return (h, m) if stat_rows else (m, h, tab.d)

            res = torch.empty(shape(n), dtype=dt, device=self.dev) if split else None
            regions = []
            for key, tb, heads in self._home_units(kind):
                a, b = int(tab.local_off[tb]), int(tab.local_off[tb] + tab.tb_len[tb])
                t = self.hacc[key][i] if key in self.hacc else None
                if res is not None:  # head blocks split the rows: a copy per region
                    if t is None:
                        rows_of(res, a, b, heads).fill_(value)
                    else:
                        rows_of(res, a, b, heads).copy_(t)
                    continue
                t = torch.full(shape(b - a), value, dtype=dt, device=self.dev) if t is None else t
                if blocks is not None:
                    blocks.setdefault(tb, []).append(t)
                regions.append(t)
            if blocks is None:
                out.append(res if split else cat_as(regions, 1 if stat_rows else 0, dt,
                                                     torch.empty(shape(0), dtype=dt, device=self.dev)))
        return out

    def finish_forward(self, blocks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(o_local [n_local, Hq, D] in the element dtype, lse_local [Hq, n_local] in the stat dtype). With
        ``blocks`` (a dict; only when ``can_hand_blocks``) instead: ``blocks[tb]`` gets home block tb's
        (o, lse) rows, for assembling the packed result without a local one."""
        self._check_done()
        o_lse = self._result(Kind.O, (self.dt.el, self.dt.stat), (0.0, float("-inf")), blocks)
        return None if blocks is not None else own_storages(*o_lse)

    def finish_backward(self, blocks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(dq, dk, dv) local, in the element dtype; with ``blocks``: like ``finish_forward``."""
        self._check_done()
        el = self.dt.el
        dq = self._result(Kind.DQ, (el,), (0.0,), blocks)
        dk_dv = self._result(Kind.DKV, (el, el), (0.0, 0.0), blocks)
        return None if blocks is not None else own_storages(*dq, *dk_dv)

    @property
    def can_hand_blocks(self) -> bool:
        """Whether each home token block's result rows are one region (head blocks split no row)."""
        return not any(self._split(k) for k in OUTPUT_KINDS[self.direction])


def own_storages(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors``, each on a storage of its own: results adopted from one received message are views of
    one uint8 buffer (o in the element dtype, lse in fp32), and ``torch.save`` refuses tensors that share
    a storage with different dtypes. A tensor sharing an earlier one's storage is copied."""
    seen, out = set(), []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
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
