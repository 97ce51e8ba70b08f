"""Device memory a plan needs: resident (home) tokens, and the peak of transient buffers per direction.

Resident: the attention inputs (and outputs, gradients) of a device's home token blocks live there for
the whole step, whatever the plan; ``resident_tokens`` counts them.

Transient: what a direction's ``Program`` makes a device hold beyond its home data, under the canonical
stream of ``dcp.ir.program`` (iteration r = 1 .. L, L = max(R, S): ``CommLaunch(r)``, ``Compute(r-1)``,
``CommWait(r)``, the reduces of round r). ``transient_peak_bytes`` counts, per device and iteration r,
the bytes of these buffers alive in r (one head block each, ``dcp.layout.units.unit_bytes``), and returns the
largest sum over r:

- a received input (a transfer of ``INPUT_KINDS[direction]``, i.e. Q/KV forward, QG/KV backward, whose
  dst is the device; one buffer per unit, however often it arrives): alive from its (first) receive
  round r0 (the buffer is posted at ``CommLaunch(r0)``) through the latest of r0, s+1 for the last stage s
  in which one of the device's tiles reads it (a tile reads its q-side unit (q_tb, hb), the ``Q_SIDE``
  kind, and its kv-side unit (kv_tb, hb)), and the last round in which the device relays it onward;
- a partial-output accumulator (``OUTPUT_KINDS[direction]``: O forward keyed by (q_tb, hb); DQ keyed by
  (q_tb, hb) and DKV keyed by (kv_tb, hb) backward) of a unit whose token block is not homed on the
  device: alive from the first of s+1 for the first stage s in which one of its tiles adds to it and the
  first round in which it receives a partial of it, through the last round in which it sends the unit
  (at least its start; through L if it never sends it, which the validator refuses);
- a received partial (a transfer of an output kind whose dst is the device): alive in its round only
  (merged by the reduces right after ``CommWait``).

Home inputs and home accumulators are not transient. This is what the plan needs at minimum, with every
buffer freed as soon as the stream no longer uses it; an executor that keeps every received slot for the
whole direction holds up to ``received_bytes`` (all bytes a device receives in the direction) instead.
Rows or tiles naming a device outside 0..n_devices-1 are ignored (the validator refuses such plans).
"""
from __future__ import annotations

import numpy as np

from dcp.ir.program import DST, HB, KIND, ROUND, SRC, TB, Program
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.layout.units import INPUT_KINDS, OUTPUT_KINDS, Q_SIDE, unit_bytes
from dcp.setops import lookup
from dcp.spec import BatchSpec


def resident_tokens(plan) -> np.ndarray:
    """int64 ``[n_devices]``: tokens homed on each device."""
    w = plan.layout.tb_len.astype(np.int64)
    out = np.zeros(plan.n_devices, dtype=np.int64)
    np.add.at(out, np.asarray(plan.home, dtype=np.int64), w)
    return out


def resident_input_bytes(spec: BatchSpec, layout: BlockLayout, tokens) -> np.ndarray:
    """int64: bytes of the attention inputs (Q, K and V of all heads) of ``tokens`` home tokens."""
    per_token = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * spec.element_bytes
    return np.asarray(tokens, dtype=np.int64) * per_token


def received_bytes(spec: BatchSpec, layout: BlockLayout, program: Program, n_devices: int) -> np.ndarray:
    """int64 ``[n_devices]``: all bytes (inputs and partials) each device receives in the direction."""
    tr = program.transfers.astype(np.int64)
    out = np.zeros(n_devices, dtype=np.int64)
    ok = (tr[:, DST] >= 0) & (tr[:, DST] < n_devices)
    np.add.at(out, tr[ok, DST], unit_bytes(spec, layout, tr[ok, KIND], tr[ok, TB]))
    return out


class _Keys:
    """(device, kind, tb, hb) as one int64 key, and back."""

    def __init__(self, n_devices: int, n_tb: int, n_hb: int):
        self.n, self.n_tb, self.n_hb = n_devices, max(n_tb, 1), max(n_hb, 1)

    def encode(self, dev, kind, tb, hb) -> np.ndarray:
        dev, kind, tb, hb = (np.asarray(a, dtype=np.int64) for a in (dev, kind, tb, hb))
        return ((kind * self.n_tb + tb) * self.n_hb + hb) * self.n + dev

    def decode(self, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device, kind, tb) of keys."""
        unit, dev = np.divmod(key, self.n)
        return dev, unit // self.n_hb // self.n_tb, unit // self.n_hb % self.n_tb


def _group(keys: np.ndarray, vals: np.ndarray, reduce) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique keys, ``reduce`` (np.minimum or np.maximum) of the values of each key)."""
    ukeys, inv = np.unique(keys, return_inverse=True)
    out = np.full(ukeys.size, np.iinfo(np.int64).max if reduce is np.minimum else np.iinfo(np.int64).min)
    reduce.at(out, inv.reshape(-1), vals.astype(np.int64))
    return ukeys, out


def transient_peak_bytes(spec: BatchSpec, layout: BlockLayout, program: Program, tile_device: np.ndarray,
                         home: np.ndarray, n_devices: int, tiles: TileSet) -> np.ndarray:
    """int64 ``[n_devices]``: the peak transient bytes of one direction per device (module docstring).
    ``tiles``: the plan's ``TileSet`` (each tile's q block, kv block and head block)."""
    direction = program.direction
    last = max(program.n_rounds, program.n_stages)
    if last == 0 or n_devices == 0:
        return np.zeros(n_devices, dtype=np.int64)
    tr = program.transfers.astype(np.int64)
    tr = tr[(tr[:, SRC] >= 0) & (tr[:, SRC] < n_devices) & (tr[:, DST] >= 0) & (tr[:, DST] < n_devices)]
    dev, stage = np.asarray(tile_device, dtype=np.int64), np.asarray(program.tile_stage, dtype=np.int64)
    ok = np.flatnonzero((dev >= 0) & (dev < n_devices)) if dev.size == stage.size else np.zeros(0, np.int64)
    dev, stage = dev[ok], stage[ok]
    q_tb, kv_tb, hb = (np.asarray(a, dtype=np.int64)[ok] for a in (tiles.q_tb, tiles.kv_tb, tiles.hb))
    n_hb = int(max(hb.max(initial=-1), tr[:, HB].max(initial=-1))) + 1
    keys = _Keys(n_devices, layout.n_token_blocks, n_hb)

    def tile_keys(kinds) -> np.ndarray:  # the unit of each kind every tile reads or adds to, on its device
        return np.concatenate([keys.encode(dev, k, q_tb if k in Q_SIDE else kv_tb, hb) for k in kinds])

    def row_keys(rows: np.ndarray, col: int) -> np.ndarray:
        return keys.encode(rows[:, col], rows[:, KIND], rows[:, TB], rows[:, HB])

    starts, ends, devs, nbytes = [], [], [], []

    def add(key: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        d, kind, tb = keys.decode(key)
        starts.append(start), ends.append(end), devs.append(d), nbytes.append(unit_bytes(spec, layout, kind, tb))

    # received inputs: first receive round .. max(that round, last read stage + 1, last relay round)
    in_kinds, out_kinds = INPUT_KINDS[direction], OUTPUT_KINDS[direction]
    inp = tr[np.isin(tr[:, KIND], [int(k) for k in in_kinds])]
    part = tr[np.isin(tr[:, KIND], [int(k) for k in out_kinds])]
    rkey, r0 = _group(row_keys(inp, DST), inp[:, ROUND], np.minimum)
    ukey, uend = _group(np.concatenate([tile_keys(in_kinds), row_keys(inp, SRC)]),
                        np.concatenate([np.tile(stage + 1, len(in_kinds)), inp[:, ROUND]]), np.maximum)
    add(rkey, r0, np.maximum(r0, lookup(ukey, uend, rkey, 0)))

    # accumulators of units homed elsewhere: first contribution (stage + 1) or partial receive .. last send
    akey, a0 = _group(np.concatenate([tile_keys(out_kinds), row_keys(part, DST)]),
                      np.concatenate([np.tile(stage + 1, len(out_kinds)), part[:, ROUND]]), np.minimum)
    d, _, tb = keys.decode(akey)
    away = np.asarray(home, dtype=np.int64)[tb] != d
    akey, a0 = akey[away], a0[away]
    skey, sent = _group(row_keys(part, SRC), part[:, ROUND], np.maximum)
    add(akey, a0, np.maximum(a0, lookup(skey, sent, akey, last)))

    # received partials: their round only
    starts.append(part[:, ROUND]), ends.append(part[:, ROUND]), devs.append(part[:, DST])
    nbytes.append(unit_bytes(spec, layout, part[:, KIND], part[:, TB]))

    start, end, d, b = (np.concatenate(x).astype(np.int64) for x in (starts, ends, devs, nbytes))
    start, end = np.clip(start, 1, last), np.clip(end, 1, last)  # only a malformed plan needs the clip
    width = last + 2  # iterations 1..last, and one past the end for the frees
    delta = np.zeros(n_devices * width, dtype=np.int64)
    np.add.at(delta, d * width + start, b)
    np.add.at(delta, d * width + end + 1, -b)
    alive = np.cumsum(delta.reshape(n_devices, width), axis=1)
    return alive[:, 1:last + 1].max(axis=1)


def plan_transient_peaks(plan) -> dict[str, np.ndarray]:
    """``transient_peak_bytes`` of a plan's forward and backward programs, by direction."""
    return {d: transient_peak_bytes(plan.spec, plan.layout, plan.columns(d), plan.tile_device, plan.home,
                                    plan.n_devices, plan.tiles) for d in ("forward", "backward")}


def memory_report(plan) -> dict:
    """Per-device int64 arrays: ``resident_tokens``, ``resident_input_bytes``, and per direction
    ``peak_transient_bytes_<direction>`` and ``received_bytes_<direction>`` (module docstring)."""
    tokens = resident_tokens(plan)
    out = {"resident_tokens": tokens, "resident_input_bytes": resident_input_bytes(plan.spec, plan.layout, tokens)}
    for direction, peak in plan_transient_peaks(plan).items():
        out[f"peak_transient_bytes_{direction}"] = peak
        out[f"received_bytes_{direction}"] = received_bytes(plan.spec, plan.layout, plan.columns(direction),
                                                            plan.n_devices)
    return out
