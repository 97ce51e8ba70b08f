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
from dcp.errors import SerializationError
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
    try:
        for d in range(n_devices):
            n, i = c[i], i + 1
            ins = []
            for _ in range(n):
                op = c[i]
                if op == _LAUNCH:
                    rnd, ns, nr = c[i + 1:i + 4]
                    i += 4
                    ts = [Transfer(Unit(Kind(c[j]), c[j + 1], c[j + 2]), c[j + 3]) for j in range(i, i + 4 * (ns + nr), 4)]
                    i += 4 * (ns + nr)
                    ins.append(CommLaunch(rnd, tuple(ts[:ns]), tuple(ts[ns:])))
                elif op == _WAIT:
                    ins.append(CommWait(c[i + 1]))
                    i += 2
                elif op == _COMPUTE:
                    stage, n_t = c[i + 1:i + 3]
                    ins.append(Compute(stage, tuple(c[i + 3:i + 3 + n_t])))
                    i += 3 + n_t
                elif op == _REDUCE:
                    kind, tb, hb, n_s = c[i + 1:i + 5]
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


def plan_to_bytes(plan: Plan) -> bytes:
    lay, tiles = plan.layout, plan.tiles
    arrays = {
        "tb_seq": lay.tb_seq, "tb_start": lay.tb_start, "tb_len": lay.tb_len, "seq_tb_ptr": lay.seq_tb_ptr,
        "q_tb": tiles.q_tb, "kv_tb": tiles.kv_tb, "hb": tiles.hb, "unmasked": tiles.unmasked,
        "full": tiles.full, "fwd_flops": tiles.fwd_flops, "bwd_flops": tiles.bwd_flops,
        "home": plan.home, "tile_device": plan.tile_device, "tile_stage": plan.tile_stage,
        "forward": _encode_program(plan.forward), "backward": _encode_program(plan.backward),
    }
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header = {
        "spec": _spec_description(plan.spec),
        "cluster": {"nodes": plan.cluster.nodes, "gpus_per_node": plan.cluster.gpus_per_node},
        "layout": {"head_block_size": lay.head_block_size, "n_head_blocks": lay.n_head_blocks,
                   "kv_heads_per_block": lay.kv_heads_per_block, "group_size": lay.group_size},
        "planner": plan.planner, "planning_time_s": plan.planning_time_s, "notes": list(plan.notes),
        "meta": {k: v for k, v in plan.meta.items() if isinstance(v, (bool, int, float, str))},
        "arrays": [[k, v.dtype.newbyteorder("<").str, list(v.shape)] for k, v in arrays.items()],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(v.astype(v.dtype.newbyteorder("<"), copy=False).tobytes() for v in arrays.values())
    blob = MAGIC + struct.pack("<IQ", VERSION, len(head)) + head + body
    return blob + struct.pack("<I", zlib.crc32(blob))


def plan_from_bytes(data: bytes) -> Plan:
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
    try:
        header = json.loads(data[pos:pos + head_len])
    except ValueError as err:
        raise SerializationError(f"plan header is not valid JSON: {err}") from err
    pos += head_len
    arrays = {}
    for name, dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if pos + n > len(data) - 4:
            raise SerializationError(f"plan bytes are truncated in array {name!r}")
        arrays[name] = np.frombuffer(data, dtype=dt, count=int(np.prod(shape)), offset=pos).reshape(shape).copy()
        pos += n
    spec = BatchSpec.from_description(header["spec"])
    cluster = Cluster(**header["cluster"])
    lh = header["layout"]
    layout = BlockLayout(arrays["tb_seq"], arrays["tb_start"], arrays["tb_len"], arrays["seq_tb_ptr"],
                         lh["head_block_size"], lh["n_head_blocks"], lh["kv_heads_per_block"], lh["group_size"])
    tiles = TileSet(arrays["q_tb"], arrays["kv_tb"], arrays["hb"], arrays["unmasked"], arrays["full"],
                    arrays["fwd_flops"], arrays["bwd_flops"])
    n = cluster.n_devices
    return Plan(spec, cluster, layout, tiles, arrays["home"], arrays["tile_device"], arrays["tile_stage"],
                _decode_program(arrays["forward"], n), _decode_program(arrays["backward"], n),
                header["planner"], header["planning_time_s"], tuple(header["notes"]), dict(header["meta"]))
