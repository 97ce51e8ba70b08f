"""Plan bytes: compact, versioned, checksummed; no pickle.

Layout: ``MAGIC`` (8 bytes), format version (uint32), header length (uint64), a UTF-8 JSON header
(batch description, cluster, planner, notes, and each array's name, dtype and shape), the arrays' raw
little-endian bytes in header order, then a CRC32 of everything before it (uint32).
Instruction streams are flattened to int64 code arrays (see ``_encode_program``).
"""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from dcp.blocks import BlockLayout, TileSet
from dcp.cluster import Cluster
from dcp.errors import DcpError, SerializationError
from dcp.plan import CommLaunch, CommWait, Compute, DevicePlan, Plan, Reduce, Transfer, Unit
from dcp.spec import BatchSpec
from dcp.units import Kind

MAGIC = b"DCPPLAN\0"
VERSION = 1
_LAUNCH, _WAIT, _COMPUTE, _REDUCE = 0, 1, 2, 3


def _encode_program(program: tuple[DevicePlan, ...]) -> np.ndarray:
    """Per device: [n_instructions, ...instructions]; launch: [0, round, n_send, n_recv, (kind, tb, hb,
    peer)*]; wait: [1, round]; compute: [2, stage, n, tiles*]; reduce: [3, kind, tb, hb, n, sources*]."""
    out: list[int] = []
    for p in program:
        out.append(len(p.instructions))
        for ins in p.instructions:
            if isinstance(ins, CommLaunch):
                out += [_LAUNCH, ins.round, len(ins.sends), len(ins.recvs)]
                for t in ins.sends + ins.recvs:
                    out += [int(t.unit.kind), t.unit.tb, t.unit.hb, t.peer]
            elif isinstance(ins, CommWait):
                out += [_WAIT, ins.round]
            elif isinstance(ins, Compute):
                out += [_COMPUTE, ins.stage, len(ins.tiles), *ins.tiles]
            elif isinstance(ins, Reduce):
                out += [_REDUCE, int(ins.unit.kind), ins.unit.tb, ins.unit.hb, len(ins.sources), *ins.sources]
            else:
                raise SerializationError(f"unknown instruction {ins!r}")
    return np.asarray(out, dtype=np.int64)


def _decode_program(codes: np.ndarray, n_devices: int) -> tuple[DevicePlan, ...]:
    c = codes.tolist()
    i, programs = 0, []

    def counts(*xs):
        if any(x < 0 for x in xs):
            raise SerializationError(f"negative count in the instruction stream at position {i}")
        return xs

    try:
        for d in range(n_devices):
            (n,), i = counts(c[i]), i + 1
            ins = []
            for _ in range(n):
                op = c[i]
                if op == _LAUNCH:
                    rnd, ns, nr = c[i + 1], *counts(*c[i + 2:i + 4])
                    i += 4
                    if i + 4 * (ns + nr) > len(c):
                        raise IndexError("a launch runs past the end")
                    ts = [Transfer(Unit(Kind(c[j]), c[j + 1], c[j + 2]), c[j + 3]) for j in range(i, i + 4 * (ns + nr), 4)]
                    i += 4 * (ns + nr)
                    ins.append(CommLaunch(rnd, tuple(ts[:ns]), tuple(ts[ns:])))
                elif op == _WAIT:
                    ins.append(CommWait(c[i + 1]))
                    i += 2
                elif op == _COMPUTE:
                    stage, (n_t,) = c[i + 1], counts(c[i + 2])
                    if i + 3 + n_t > len(c):
                        raise IndexError("a compute runs past the end")
                    ins.append(Compute(stage, tuple(c[i + 3:i + 3 + n_t])))
                    i += 3 + n_t
                elif op == _REDUCE:
                    kind, tb, hb, (n_s,) = c[i + 1], c[i + 2], c[i + 3], counts(c[i + 4])
                    if i + 5 + n_s > len(c):
                        raise IndexError("a reduce runs past the end")
                    ins.append(Reduce(Unit(Kind(kind), tb, hb), tuple(c[i + 5:i + 5 + n_s])))
                    i += 5 + n_s
                else:
                    raise SerializationError(f"unknown opcode {op} at position {i}")
            programs.append(DevicePlan(d, tuple(ins)))
    except (IndexError, ValueError) as err:
        raise SerializationError(f"truncated or corrupt instruction stream: {err}") from err
    if i != len(c):
        raise SerializationError("instruction stream has trailing data")
    return tuple(programs)


def _spec_description(spec: BatchSpec) -> dict:
    """Masks that cannot be rebuilt from a description (callables) travel as explicit ranges."""
    from dcp.masks import RangesMask, from_description

    masks = []
    for i, m in enumerate(spec.masks):
        try:
            from_description(json.loads(json.dumps(m.describe())))
            masks.append(m)
        except Exception:
            masks.append(RangesMask(np.asarray(spec.kv_ranges(i))))
    return BatchSpec(spec.seqlens, masks, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype).describe()


#: every array of the format, with the dtype kinds it may have (integers, bool, floats)
ARRAYS = {"tb_seq": "iu", "tb_start": "iu", "tb_len": "iu", "seq_tb_ptr": "iu", "q_tb": "iu", "kv_tb": "iu",
          "hb": "iu", "unmasked": "iu", "full": "b", "fwd_flops": "f", "bwd_flops": "f", "home": "iu",
          "tile_device": "iu", "tile_stage": "iu", "forward": "i", "backward": "i"}
_HEADER_KEYS = ("spec", "cluster", "layout", "planner", "planning_time_s", "notes", "meta", "arrays")


def _plan_arrays(plan: Plan) -> dict[str, np.ndarray]:
    """The plan's arrays in format order (instruction streams encoded), contiguous."""
    lay, tiles = plan.layout, plan.tiles
    arrays = {
        "tb_seq": lay.tb_seq, "tb_start": lay.tb_start, "tb_len": lay.tb_len, "seq_tb_ptr": lay.seq_tb_ptr,
        "q_tb": tiles.q_tb, "kv_tb": tiles.kv_tb, "hb": tiles.hb, "unmasked": tiles.unmasked,
        "full": tiles.full, "fwd_flops": tiles.fwd_flops, "bwd_flops": tiles.bwd_flops,
        "home": plan.home, "tile_device": plan.tile_device, "tile_stage": plan.tile_stage,
        "forward": _encode_program(plan.forward), "backward": _encode_program(plan.backward),
    }
    return {k: np.ascontiguousarray(v) for k, v in arrays.items()}


def _layout_header(lay: BlockLayout) -> dict:
    return {"head_block_size": lay.head_block_size, "n_head_blocks": lay.n_head_blocks,
            "kv_heads_per_block": lay.kv_heads_per_block, "group_size": lay.group_size}


def _le(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("<"), copy=False)


def plan_to_bytes(plan: Plan) -> bytes:
    arrays = _plan_arrays(plan)
    header = {
        "spec": _spec_description(plan.spec),
        "cluster": {"nodes": plan.cluster.nodes, "gpus_per_node": plan.cluster.gpus_per_node},
        "layout": _layout_header(plan.layout),
        "planner": plan.planner, "planning_time_s": plan.planning_time_s, "notes": list(plan.notes),
        "meta": {k: v for k, v in plan.meta.items() if isinstance(v, (bool, int, float, str))},
        "arrays": [[k, v.dtype.newbyteorder("<").str, list(v.shape)] for k, v in arrays.items()],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(_le(v).tobytes() for v in arrays.values())
    blob = MAGIC + struct.pack("<IQ", VERSION, len(head)) + head + body
    return blob + struct.pack("<I", zlib.crc32(blob))


def execution_digest(plan: Plan) -> bytes:
    """sha256 (32 bytes) of everything that decides what a plan executes: the batch (lengths, masks as
    KV ranges where they are callables, heads, dtype), the cluster, the block layout, the tiles, the
    placement and both programs. Planner name, planning time, notes and meta are left out, so two ranks
    that planned the same thing at different speeds agree."""
    import hashlib

    h = hashlib.sha256()
    fixed = {"spec": _spec_description(plan.spec), "layout": _layout_header(plan.layout),
             "cluster": [plan.cluster.nodes, plan.cluster.gpus_per_node]}
    h.update(json.dumps(fixed, sort_keys=True, separators=(",", ":")).encode())
    for name, a in _plan_arrays(plan).items():
        h.update(f"{name}:{a.dtype.newbyteorder('<').str}:{a.shape}".encode())
        h.update(_le(a).tobytes())
    return h.digest()


def _read_arrays(data: bytes, specs, pos: int) -> tuple[dict[str, np.ndarray], int]:
    """Arrays named by the header's ``[name, dtype, shape]`` list, read from ``data`` at ``pos``."""
    if not isinstance(specs, list) or not all(isinstance(x, list) and len(x) == 3 for x in specs):
        raise SerializationError("plan header: 'arrays' must list [name, dtype, shape] triples")
    names = [x[0] for x in specs]
    if sorted(map(str, names)) != sorted(ARRAYS) or len(set(map(str, names))) != len(names):
        raise SerializationError(f"plan header lists arrays {names}, the format has {list(ARRAYS)}")
    arrays = {}
    end = len(data) - 4
    for name, dtype, shape in specs:
        try:
            dt = np.dtype(dtype) if isinstance(dtype, str) else None
        except TypeError:
            dt = None
        if dt is None or dt.kind not in ARRAYS[name] or dt.byteorder == ">" or dt.itemsize == 0:
            raise SerializationError(f"plan array {name!r} has dtype {dtype!r}; expected a little-endian "
                                     f"{'/'.join({'i': 'int', 'u': 'uint', 'b': 'bool', 'f': 'float'}[k] for k in ARRAYS[name])}")
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)
                and not isinstance(shape[0], bool) and shape[0] >= 0):
            raise SerializationError(f"plan array {name!r} has shape {shape!r}; expected one non-negative length")
        n = shape[0] * dt.itemsize
        if pos + n > end:
            raise SerializationError(f"plan bytes are truncated in array {name!r}")
        arrays[name] = np.frombuffer(data, dtype=dt, count=shape[0], offset=pos).copy()
        pos += n
    if pos != end:
        raise SerializationError(f"plan bytes hold {end - pos} bytes after the last array")
    return arrays, pos


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
    t = header["planning_time_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise SerializationError(f"plan header: 'planning_time_s' must be a number, got {t!r}")
    if not all(isinstance(x, str) for x in header["notes"]):
        raise SerializationError("plan header: 'notes' must be strings")
    lh = header["layout"]
    keys = ("head_block_size", "n_head_blocks", "kv_heads_per_block", "group_size")
    if sorted(lh) != sorted(keys) or not all(isinstance(lh[k], int) and not isinstance(lh[k], bool) for k in keys):
        raise SerializationError(f"plan header: 'layout' must hold the ints {list(keys)}, got {lh!r}")
    return header


def plan_from_bytes(data: bytes) -> Plan:
    """Parse ``plan_to_bytes`` output. Raises ``SerializationError`` for anything that is not such bytes
    (corrupt, truncated, another version, or a well-checksummed but malformed header or array). The
    plan's semantics are checked by ``dcp.validate``, not here."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SerializationError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) + 16 or data[:len(MAGIC)] != MAGIC:
        raise SerializationError("not a dcp plan (bad magic)")
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != crc:
        raise SerializationError("plan bytes are corrupt (checksum mismatch)")
    version, head_len = struct.unpack("<IQ", data[len(MAGIC):len(MAGIC) + 12])
    if version != VERSION:
        raise SerializationError(f"plan format version {version} is not supported (this dcp reads {VERSION})")
    pos = len(MAGIC) + 12
    if pos + head_len > len(data) - 4:
        raise SerializationError(f"plan header length {head_len} exceeds the {len(data)} bytes")
    try:
        header = json.loads(data[pos:pos + head_len])
    except ValueError as err:
        raise SerializationError(f"plan header is not valid JSON: {err}") from err
    header = _header_fields(header)
    arrays, _ = _read_arrays(data, header["arrays"], pos + head_len)
    try:
        spec = BatchSpec.from_description(header["spec"])
        cluster = Cluster(**header["cluster"])
    except (DcpError, KeyError, TypeError, ValueError, IndexError) as err:
        raise SerializationError(f"plan header describes no valid batch and cluster: {type(err).__name__}: "
                                 f"{err}") from err
    lh = header["layout"]
    layout = BlockLayout(arrays["tb_seq"], arrays["tb_start"], arrays["tb_len"], arrays["seq_tb_ptr"],
                         lh["head_block_size"], lh["n_head_blocks"], lh["kv_heads_per_block"], lh["group_size"])
    tiles = TileSet(arrays["q_tb"], arrays["kv_tb"], arrays["hb"], arrays["unmasked"], arrays["full"],
                    arrays["fwd_flops"], arrays["bwd_flops"])
    n = cluster.n_devices
    return Plan(spec, cluster, layout, tiles, arrays["home"], arrays["tile_device"], arrays["tile_stage"],
                _decode_program(arrays["forward"], n), _decode_program(arrays["backward"], n),
                header["planner"], float(header["planning_time_s"]), tuple(header["notes"]), dict(header["meta"]))
