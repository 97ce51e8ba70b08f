"""Explicit mask: per-token KV ranges given directly for one sequence length.

The ranges are validated with ``validate_ranges`` on construction and stored as a read-only int32 array
with trailing all-empty slot columns trimmed (at least one slot kept). Two ``RangesMask`` are equal when
their stored arrays are equal; the hash is computed from the array bytes, so the mask is usable as a
dict key.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.base import Mask, check_seqlen, validate_ranges


@dataclass(frozen=True, eq=False)
class RangesMask(Mask):
    ranges: np.ndarray
    name = "ranges"

    def __post_init__(self):
        try:
            arr = np.asarray(self.ranges)
        except (TypeError, ValueError) as exc:
            raise InvalidMaskError(f"ranges: cannot read the KV ranges as an array: {exc}") from None
        if arr.dtype == object or (arr.dtype.kind == "f" and not np.all(arr == np.round(arr))):
            raise InvalidMaskError(f"ranges: KV ranges must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "f":
            arr = arr.astype(np.int64)
        if arr.ndim != 3 or arr.shape[0] < 1:
            raise InvalidMaskError(f"ranges: KV ranges must have shape [L>=1, R>=1, 2], got {arr.shape}")
        arr = validate_ranges(arr, arr.shape[0]).copy()
        used_cols = (arr[:, :, 1] > arr[:, :, 0]).any(axis=0)
        keep = int(np.nonzero(used_cols)[0].max()) + 1 if used_cols.any() else 1
        arr = np.ascontiguousarray(arr[:, :keep])
        arr.setflags(write=False)
        object.__setattr__(self, "ranges", arr)
        digest = hashlib.blake2b(arr.tobytes(), digest_size=8).digest()
        object.__setattr__(self, "_hash", hash((arr.shape, digest)))

    @property
    def seqlen(self) -> int:
        return int(self.ranges.shape[0])

    def __eq__(self, other):
        if not isinstance(other, RangesMask):
            return NotImplemented
        return self._hash == other._hash and np.array_equal(self.ranges, other.ranges)

    def __hash__(self):
        return self._hash

    def __reduce__(self):
        return (RangesMask, (np.array(self.ranges),))

    def __repr__(self):
        return f"RangesMask(seqlen={self.seqlen}, slots={self.ranges.shape[1]})"

    def describe(self) -> dict:
        return {"name": self.name, "ranges": self.ranges.tolist()}

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        if seqlen != self.seqlen:
            raise InvalidMaskError(
                f"ranges: this mask was given for {self.seqlen} tokens, cannot evaluate it for {seqlen}")
        return self.ranges.copy()
