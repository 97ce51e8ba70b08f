"""Plan bytes: compact, versioned, checksummed; no pickle.

Layout: ``MAGIC`` (8 bytes), format version (uint32), header length (uint64), a UTF-8 JSON header
(batch description, cluster, head blocking, planner, notes, and each array's name, dtype and shape), the
arrays' raw little-endian bytes in header order, then a CRC32 of everything before it (uint32).

Arrays (``ARRAYS``): the block layout, the tiles, the placement, and per direction the columnar program
(``forward.tile_stage``, ``forward.transfers`` ``[n, 6]``, ``forward.merges`` ``[m, 6]``, the same for
``backward``; ``dcp.ir.program``), written as they are in memory. Masks that travel as explicit KV ranges
(``RangesMask``, and callables such as mask_mod masks, materialized per sequence) are not JSON: the
header names them ``{"name": "ranges", "array": i}`` and their ranges ``[L, R, 2]`` follow as two arrays,
``mask{i}.runs`` and ``mask{i}.run_len``: the ranges' differences from one token to the next, with
equal consecutive rows stored once with their count. A sliding or neighbourhood window moves by one
token per token, so a 131,072-token mask of 31 ranges per token takes kilobytes instead of 32 MB.

Plans of more than ``COMPRESS_ABOVE`` bytes (static baselines at hundreds of devices: 10^6 transfer rows)
travel compressed: ``ZMAGIC``, the raw length (uint64), the zlib (level 1) stream of the bytes above, and
a CRC32 of everything before it. Sorted row tables compress 5-9x; dcp's own plans (well under a MiB at
1,024 devices) stay raw. ``plan_fields_from_bytes`` reads both.

The planning time is not written: it measures the process that planned, not the plan, so the same
inputs give the same bytes in every process (a plan read back has ``planning_time_s`` 0).

Format version 2 (columnar programs) replaced version 1 (instruction streams as code arrays); bytes of
another version raise ``SerializationError`` saying so.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import TYPE_CHECKING

import numpy as np

from dcp.cluster import Cluster
from dcp.errors import DcpError, SerializationError
from dcp.ir.program import COLUMNS, Program
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.spec import BatchSpec

if TYPE_CHECKING:  # Plan.to_bytes / Plan.from_bytes call this module; it does not need plan.py
    from dcp.ir.plan import Plan

MAGIC = b"DCPPLAN\0"
ZMAGIC = b"DCPPLANZ"
VERSION = 2
#: plan bytes above this size are written compressed (``ZMAGIC``)
COMPRESS_ABOVE = 4 << 20
_PROGRAM_ARRAYS = ("tile_stage", "transfers", "merges")
#: every fixed array of the format: (dtype kinds it may have, its number of dimensions)
ARRAYS = {"tb_seq": ("iu", 1), "tb_start": ("iu", 1), "tb_len": ("iu", 1), "seq_tb_ptr": ("iu", 1),
          "q_tb": ("iu", 1), "kv_tb": ("iu", 1), "hb": ("iu", 1), "unmasked": ("iu", 1), "full": ("b", 1),
          "fwd_flops": ("f", 1), "bwd_flops": ("f", 1), "home": ("iu", 1), "tile_device": ("iu", 1),
          **{f"{d}.{a}": ("iu", 1 if a == "tile_stage" else 2) for d in ("forward", "backward")
             for a in _PROGRAM_ARRAYS}}
#: a grouped layout's arrays (``dcp.layout.pieces``): all of them or none
GROUPED_ARRAYS = {"pieces.tb_seq": ("iu", 1), "pieces.tb_start": ("iu", 1), "pieces.tb_len": ("iu", 1),
                  "pieces.seq_tb_ptr": ("iu", 1), "piece_block": ("iu", 1), "sub_n": ("iu", 1),
                  "sub_wq": ("f", 1), "sub_wk": ("f", 1), "sub_wqk": ("f", 1)}
SUB_ARRAYS = ("sub_n", "sub_wq", "sub_wk", "sub_wqk")
_MASK_ARRAYS = {"runs": ("iu", 3), "run_len": ("iu", 1)}
_HEADER_KEYS = ("spec", "cluster", "layout", "planner", "notes", "meta", "arrays")
_KIND_NAMES = {"i": "int", "u": "uint", "b": "bool", "f": "float"}


# ----------------------------------------------------------------------------------------- ranges
def encode_ranges(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KV ranges ``[L, R, 2]`` as (runs int64 ``[k, R, 2]``, run_len int64 ``[k]``): row t of the
    differences ``ranges[t] - ranges[t - 1]`` (``ranges[-1]`` = 0) is ``runs[j]`` for ``run_len[j]``
    consecutive tokens. ``decode_ranges`` inverts it exactly."""
    r = np.asarray(ranges, dtype=np.int64)
    delta = np.diff(r, axis=0, prepend=np.zeros((1, *r.shape[1:]), dtype=np.int64))
    starts = np.flatnonzero(np.r_[True, (delta[1:] != delta[:-1]).any(axis=(1, 2))])
    return delta[starts], np.diff(np.r_[starts, r.shape[0]])


def decode_ranges(runs: np.ndarray, run_len: np.ndarray) -> np.ndarray:
    """int64 ``[L, R, 2]`` ranges from ``encode_ranges`` output."""
    return np.cumsum(np.repeat(runs.astype(np.int64), run_len.astype(np.int64), axis=0), axis=0)


# ----------------------------------------------------------------------------------------- writing
def _rebuildable(mask) -> bool:
    from dcp.masks import RangesMask, from_description

    if isinstance(mask, RangesMask):
        return False
    try:
        from_description(json.loads(json.dumps(mask.describe())))
        return True
    except Exception:  # noqa: BLE001 - anything that does not survive JSON travels as ranges
        return False


def _spec_header(spec: BatchSpec) -> tuple[dict, list[np.ndarray]]:
    """The batch's JSON description, its explicit-ranges masks replaced by ``{"name": "ranges", "array":
    i}``, and those ranges (one array per distinct mask and length)."""
    from dcp.masks import RangesMask

    descs, ranges, index, seen = [], [], [], {}
    for s, m in enumerate(spec.masks):
        keep = _rebuildable(m)
        try:
            key = (m, None) if keep else (m, spec.seqlens[s])
            hash(key)
        except TypeError:
            key = (id(m), None if keep else spec.seqlens[s])
        if key not in seen:
            seen[key] = len(descs)
            if keep:
                descs.append(m.describe())
            else:
                descs.append({"name": "ranges", "array": len(ranges)})
                ranges.append(m.ranges if isinstance(m, RangesMask) else spec.kv_ranges(s))
        index.append(seen[key])
    head = {"seqlens": list(spec.seqlens), "masks": descs, "mask_index": index, "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "dtype": spec.dtype}
    return head, ranges


def _plan_arrays(plan: Plan) -> dict[str, np.ndarray]:
    """The plan's fixed arrays in format order, contiguous."""
    lay, tiles = plan.layout, plan.tiles
    arrays = {
        "tb_seq": lay.tb_seq, "tb_start": lay.tb_start, "tb_len": lay.tb_len, "seq_tb_ptr": lay.seq_tb_ptr,
        "q_tb": tiles.q_tb, "kv_tb": tiles.kv_tb, "hb": tiles.hb, "unmasked": tiles.unmasked,
        "full": tiles.full, "fwd_flops": tiles.fwd_flops, "bwd_flops": tiles.bwd_flops,
        "home": plan.home, "tile_device": plan.tile_device,
    }
    if lay.grouped:
        pc = lay.pieces
        arrays.update({"pieces.tb_seq": pc.tb_seq, "pieces.tb_start": pc.tb_start, "pieces.tb_len": pc.tb_len,
                       "pieces.seq_tb_ptr": pc.seq_tb_ptr, "piece_block": lay.piece_block,
                       **{k: getattr(tiles, k) for k in SUB_ARRAYS}})
    for d in ("forward", "backward"):
        prog = plan.columns(d)
        arrays.update({f"{d}.{a}": getattr(prog, a) for a in _PROGRAM_ARRAYS})
    return {k: np.ascontiguousarray(v) for k, v in arrays.items()}


def _mask_arrays(ranges: list[np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for i, r in enumerate(ranges):
        runs, run_len = encode_ranges(r)
        small = runs.size == 0 or (runs.min() >= -2**31 and runs.max() < 2**31)
        out[f"mask{i}.runs"] = runs.astype(np.int32 if small else np.int64)
        out[f"mask{i}.run_len"] = run_len.astype(np.int32 if run_len.max(initial=0) < 2**31 else np.int64)
    return out


def _layout_header(lay: BlockLayout) -> dict:
    return {"head_block_size": lay.head_block_size, "n_head_blocks": lay.n_head_blocks,
            "kv_heads_per_block": lay.kv_heads_per_block, "group_size": lay.group_size}


def _le(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("<"), copy=False)


def plan_to_bytes(plan: Plan, compress: bool | None = None) -> bytes:
    """The plan's bytes (module docstring); ``compress``: zlib-wrap them (None: above ``COMPRESS_ABOVE``)."""
    raw = _raw_bytes(plan)
    if not (len(raw) > COMPRESS_ABOVE if compress is None else compress):
        return raw
    body = ZMAGIC + struct.pack("<Q", len(raw)) + zlib.compress(raw, 1)
    return body + struct.pack("<I", zlib.crc32(body))


def _raw_bytes(plan: Plan) -> bytes:
    spec_head, ranges = _spec_header(plan.spec)
    arrays = {**_plan_arrays(plan), **_mask_arrays(ranges)}
    header = {
        "spec": spec_head,
        "cluster": {"nodes": plan.cluster.nodes, "gpus_per_node": plan.cluster.gpus_per_node},
        "layout": _layout_header(plan.layout),
        "planner": plan.planner, "notes": list(plan.notes),
        "meta": {k: v for k, v in plan.meta.items() if isinstance(v, (bool, int, float, str))},
        "arrays": [[k, v.dtype.newbyteorder("<").str, list(v.shape)] for k, v in arrays.items()],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    crc = zlib.crc32(MAGIC + struct.pack("<IQ", VERSION, len(head)) + head)
    parts = [MAGIC, struct.pack("<IQ", VERSION, len(head)), head]
    for v in arrays.values():
        body = memoryview(_le(v)).cast("B") if v.size else b""
        crc = zlib.crc32(body, crc)
        parts.append(body)
    parts.append(struct.pack("<I", crc))
    return b"".join(parts)


def execution_digest(plan: Plan) -> bytes:
    """sha256 (32 bytes) of everything that decides what a plan executes: the batch (lengths, masks as
    KV ranges where they are callables, heads, dtype), the cluster, the block layout, the tiles, the
    placement and both programs. Planner name, planning time, notes and meta are left out, so two ranks
    that planned the same thing at different speeds agree."""
    import hashlib

    h = hashlib.sha256()
    spec_head, ranges = _spec_header(plan.spec)
    fixed = {"spec": spec_head, "layout": _layout_header(plan.layout),
             "cluster": [plan.cluster.nodes, plan.cluster.gpus_per_node]}
    h.update(json.dumps(fixed, sort_keys=True, separators=(",", ":")).encode())
    for name, a in {**_plan_arrays(plan), **_mask_arrays(ranges)}.items():
        h.update(f"{name}:{a.dtype.newbyteorder('<').str}:{a.shape}".encode())
        h.update(_le(a).tobytes())
    return h.digest()


# ----------------------------------------------------------------------------------------- reading
def _array_rule(name) -> tuple[str, int] | None:
    if not isinstance(name, str):
        return None
    if name in ARRAYS:
        return ARRAYS[name]
    if name in GROUPED_ARRAYS:
        return GROUPED_ARRAYS[name]
    head, _, field = name.partition(".")
    if head.startswith("mask") and head[4:].isdigit() and field in _MASK_ARRAYS:
        return _MASK_ARRAYS[field]
    return None


def _read_arrays(data: bytes, specs, pos: int) -> dict[str, np.ndarray]:
    """Arrays named by the header's ``[name, dtype, shape]`` list, read from ``data`` at ``pos``."""
    if not isinstance(specs, list) or not all(isinstance(x, list) and len(x) == 3 for x in specs):
        raise SerializationError("plan header: 'arrays' must list [name, dtype, shape] triples")
    names = [x[0] for x in specs]
    fixed = [n for n in names if n in ARRAYS]
    grouped = [n for n in names if n in GROUPED_ARRAYS]
    if sorted(fixed) != sorted(ARRAYS) or len(set(map(str, names))) != len(names) or \
            any(_array_rule(n) is None for n in names) or (grouped and sorted(grouped) != sorted(GROUPED_ARRAYS)):
        raise SerializationError(f"plan header lists arrays {names}, the format has {list(ARRAYS)} (and "
                                 f"mask<i>.runs / mask<i>.run_len; a grouped layout all of {list(GROUPED_ARRAYS)})")
    arrays = {}
    end = len(data) - 4
    for name, dtype, shape in specs:
        kinds, ndim = _array_rule(name)
        try:
            dt = np.dtype(dtype) if isinstance(dtype, str) else None
        except TypeError:
            dt = None
        if dt is None or dt.kind not in kinds or dt.byteorder == ">" or dt.itemsize == 0 or dt.fields:
            raise SerializationError(f"plan array {name!r} has dtype {dtype!r}; expected a little-endian "
                                     f"{'/'.join(_KIND_NAMES[k] for k in kinds)}")
        width = {1: (), 2: (len(COLUMNS),), 3: (None, 2)}[ndim]
        if not (isinstance(shape, list) and len(shape) == ndim
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
                and all(w is None or x == w for x, w in zip(shape[1:], width))):
            raise SerializationError(f"plan array {name!r} has shape {shape!r}; expected {ndim} non-negative "
                                     f"lengths{f' ending in {[w or -1 for w in width]}' if width else ''}")
        count = int(np.prod(shape))
        n = count * dt.itemsize
        if pos + n > end:
            raise SerializationError(f"plan bytes are truncated in array {name!r}")
        arrays[name] = np.frombuffer(data, dtype=dt, count=count, offset=pos).reshape(shape).copy()
        pos += n
    if pos != end:
        raise SerializationError(f"plan bytes hold {end - pos} bytes after the last array")
    return arrays


def _header_fields(header) -> dict:
    if not isinstance(header, dict):
        raise SerializationError(f"plan header must be a JSON object, got {type(header).__name__}")
    missing = [k for k in _HEADER_KEYS if k not in header]
    if missing:
        raise SerializationError(f"plan header lacks {missing}")
    checks = (("spec", dict), ("cluster", dict), ("layout", dict), ("planner", str), ("notes", list), ("meta", dict))
    for key, typ in checks:
        if not isinstance(header[key], typ):
            raise SerializationError(f"plan header: {key!r} must be a {typ.__name__}, got {header[key]!r:.80}")
    if not all(isinstance(x, str) for x in header["notes"]):
        raise SerializationError("plan header: 'notes' must be strings")
    lh = header["layout"]
    keys = ("head_block_size", "n_head_blocks", "kv_heads_per_block", "group_size")
    if sorted(lh) != sorted(keys) or not all(isinstance(lh[k], int) and not isinstance(lh[k], bool) for k in keys):
        raise SerializationError(f"plan header: 'layout' must hold the ints {list(keys)}, got {lh!r}")
    return header


def _spec_from_header(d: dict, arrays: dict[str, np.ndarray]) -> BatchSpec:
    """Inverse of ``_spec_header`` (raises ``DcpError``/``KeyError``/``TypeError``/``ValueError`` when the
    description is malformed; the caller names them)."""
    from dcp.masks import RangesMask, from_description

    used = set()
    masks = []
    for m in d["masks"]:
        if isinstance(m, dict) and m.get("name") == "ranges" and "array" in m:
            i = m["array"]
            if sorted(m) != ["array", "name"] or not isinstance(i, int) or isinstance(i, bool) or \
                    f"mask{i}.runs" not in arrays or f"mask{i}.run_len" not in arrays:
                raise ValueError(f"mask {m!r} names no ranges arrays of the plan")
            runs, run_len = arrays[f"mask{i}.runs"], arrays[f"mask{i}.run_len"]
            if runs.shape[0] != run_len.size or (run_len <= 0).any():
                raise ValueError(f"ranges arrays of mask {i} do not describe runs of tokens")
            masks.append(RangesMask(decode_ranges(runs, run_len)))
            used.add(i)
        else:
            masks.append(from_description(m))
    extra = {n for n in arrays if n.startswith("mask")} - {f"mask{i}.{f}" for i in used for f in _MASK_ARRAYS}
    if extra:
        raise ValueError(f"arrays {sorted(extra)} belong to no mask")
    index = d["mask_index"]
    if not isinstance(index, list) or not all(isinstance(i, int) and 0 <= i < len(masks) for i in index):
        raise ValueError(f"mask_index {index!r:.80} must list indices of the {len(masks)} masks")
    return BatchSpec(d["seqlens"], [masks[i] for i in index], d["num_heads"], d["num_kv_heads"], d["head_dim"],
                     d["dtype"])


def _decompress(data: bytes) -> bytes:
    """The raw plan bytes inside a compressed plan (``ZMAGIC``), checked: checksum, then exactly the
    declared length (no more is inflated)."""
    if len(data) < len(ZMAGIC) + 12:
        raise SerializationError("compressed plan bytes are truncated")
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != crc:
        raise SerializationError("compressed plan bytes are corrupt (checksum mismatch)")
    (n,) = struct.unpack("<Q", data[len(ZMAGIC):len(ZMAGIC) + 8])
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(data[len(ZMAGIC) + 8:-4], n)
    except zlib.error as err:
        raise SerializationError(f"compressed plan bytes do not inflate: {err}") from err
    if len(raw) != n or inflate.unconsumed_tail or not inflate.eof:
        raise SerializationError(f"compressed plan bytes inflate to other than the declared {n} bytes")
    return raw


def plan_fields_from_bytes(data: bytes) -> dict:
    """Parse ``plan_to_bytes`` output into ``Plan``'s constructor arguments (``Plan.from_bytes`` builds it). Raises ``SerializationError`` for anything that is not such bytes
    (corrupt, truncated, another version, or a well-checksummed but malformed header or array). The
    plan's semantics are checked by ``dcp.validate``, not here."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SerializationError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if data[:len(ZMAGIC)] == ZMAGIC:
        data = _decompress(data)
    if len(data) < len(MAGIC) + 16 or data[:len(MAGIC)] != MAGIC:
        raise SerializationError("not a dcp plan (bad magic)")
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != crc:
        raise SerializationError("plan bytes are corrupt (checksum mismatch)")
    version, head_len = struct.unpack("<IQ", data[len(MAGIC):len(MAGIC) + 12])
    if version != VERSION:
        old = " (version 1 held per-device instruction streams; plan the batch again with this dcp)" \
            if version < VERSION else ""
        raise SerializationError(f"plan format version {version} is not supported (this dcp reads {VERSION}, "
                                 f"columnar programs){old}")
    pos = len(MAGIC) + 12
    if pos + head_len > len(data) - 4:
        raise SerializationError(f"plan header length {head_len} exceeds the {len(data)} bytes")
    try:
        header = json.loads(data[pos:pos + head_len])
    except ValueError as err:
        raise SerializationError(f"plan header is not valid JSON: {err}") from err
    header = _header_fields(header)
    arrays = _read_arrays(data, header["arrays"], pos + head_len)
    try:
        spec = _spec_from_header(header["spec"], arrays)
        cluster = Cluster(**header["cluster"])
    except (DcpError, KeyError, TypeError, ValueError, IndexError) as err:
        raise SerializationError(f"plan header describes no valid batch and cluster: {type(err).__name__}: "
                                 f"{err}") from err
    lh = header["layout"]
    heads = (lh["head_block_size"], lh["n_head_blocks"], lh["kv_heads_per_block"], lh["group_size"])
    grouped = "piece_block" in arrays
    pieces = BlockLayout(*(arrays[f"pieces.{k}"] for k in ("tb_seq", "tb_start", "tb_len", "seq_tb_ptr")),
                         *heads) if grouped else None
    layout = BlockLayout(arrays["tb_seq"], arrays["tb_start"], arrays["tb_len"], arrays["seq_tb_ptr"], *heads,
                         pieces=pieces, piece_block=arrays["piece_block"] if grouped else None)
    sub = {k: arrays[k] for k in SUB_ARRAYS} if grouped else {}
    tiles = TileSet(arrays["q_tb"], arrays["kv_tb"], arrays["hb"], arrays["unmasked"], arrays["full"],
                    arrays["fwd_flops"], arrays["bwd_flops"], **sub)
    fwd, bwd = (Program(d, *(arrays[f"{d}.{a}"] for a in _PROGRAM_ARRAYS)) for d in ("forward", "backward"))
    return dict(spec=spec, cluster=cluster, layout=layout, tiles=tiles, home=arrays["home"],
                tile_device=arrays["tile_device"], forward=fwd, backward=bwd, planner=header["planner"],
                planning_time_s=0.0, notes=tuple(header["notes"]), meta=dict(header["meta"]))
