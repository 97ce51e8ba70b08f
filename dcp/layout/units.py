"""Data units moved between devices and their sizes in bytes.

A unit is (kind, token block, head block). Forward: Q and KV are inputs, O is a partial output (o + lse).
Backward: QG (q, dO, lse, delta) and KV are inputs, DQ and DKV are partial outputs (gradients summed).
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from dcp.layout.blocks import BlockLayout
from dcp.spec import BatchSpec

LSE_BYTES = 4  # lse and delta travel in fp32


class Kind(IntEnum):
    Q = 0
    KV = 1
    O = 2
    QG = 3
    DQ = 4
    DKV = 5


INPUT_KINDS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
OUTPUT_KINDS = {"forward": (Kind.O,), "backward": (Kind.DQ, Kind.DKV)}
Q_SIDE = {Kind.Q, Kind.O, Kind.QG, Kind.DQ}  # keyed by the tile's q block; the others by its kv block


def bytes_per_token(spec: BatchSpec, layout: BlockLayout) -> dict[Kind, int]:
    """Bytes one token of one head block contributes to a unit of each kind."""
    es, d = spec.element_bytes, spec.head_dim
    hq, hkv = layout.head_block_size, layout.kv_heads_per_block
    return {
        Kind.Q: hq * d * es,
        Kind.KV: 2 * hkv * d * es,
        Kind.O: hq * d * es + hq * LSE_BYTES,
        Kind.QG: 2 * hq * d * es + 2 * hq * LSE_BYTES,
        Kind.DQ: hq * d * es,
        Kind.DKV: 2 * hkv * d * es,
    }


def unit_bytes(spec: BatchSpec, layout: BlockLayout, kind, tb) -> np.ndarray:
    """Bytes of unit(s) of ``kind`` (one kind, or an int array of kinds) for token block(s) ``tb``
    (one head block each), int64."""
    per_token = np.array([bytes_per_token(spec, layout)[k] for k in Kind], dtype=np.int64)
    return per_token[np.asarray(kind, dtype=np.int64)] * layout.tb_len[np.asarray(tb)].astype(np.int64)
