"""Explicit mask: per-token KV ranges given directly for one sequence length.

The ranges are validated with ``validate_ranges`` on construction and stored as a read-only int32 array
with trailing all-empty slot columns trimmed (at least one slot kept). Two ``RangesMask`` are equal when
their stored arrays are equal; the hash is computed from the array contents (``content_hash``), so the
mask is usable as a dict key. A ``BatchSpec`` plans with the stored array itself (``validated_ranges``):
a mask of thousands of ranges per token (a strided mask_mod) is never copied or validated again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.base import Mask, check_seqlen, validate_ranges

_HASH_WIDTH = 1024
#: odd multipliers of a linear hash mod 2**64 (one per position in a 1024-word row)
_HASH_KEYS = np.random.default_rng(0x5EED).integers(0, 2**63, _HASH_WIDTH, dtype=np.uint64) | np.uint64(1)


def content_hash(arr: np.ndarray) -> int:
    """A hash of a contiguous int32 ``[L, R, 2]`` array's contents at memory speed: each 1024-word row of
    its 64-bit words (one (start, end) pair each) is dotted with odd random multipliers mod 2**64, and the
    row sums are hashed with BLAKE2 (a changed pair always changes its row's sum). A hash, not a digest:
    equality still compares the arrays."""
    words = arr.reshape(-1).view(np.uint64)
    main = words.size - words.size % _HASH_WIDTH
    rows = words[:main].reshape(-1, _HASH_WIDTH) @ _HASH_KEYS
    digest = hashlib.blake2b(rows.tobytes() + words[main:].tobytes(), digest_size=8).digest()
    return hash((arr.shape, digest))


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
        given = arr
        arr = validate_ranges(arr, arr.shape[0])
        # used ranges come first in a row: the last used slot column is the last with a used first row
        used_cols = np.flatnonzero((arr[:, :, 1] > arr[:, :, 0]).any(axis=0))
        keep = int(used_cols[-1]) + 1 if used_cols.size else 1
        if keep < arr.shape[1]:
            arr = np.ascontiguousarray(arr[:, :keep])
        if np.may_share_memory(arr, given):  # the caller's array: keep a copy of our own
            arr = arr.copy()
        self._set(arr)

    def _set(self, arr: np.ndarray) -> None:
        arr.setflags(write=False)
        object.__setattr__(self, "ranges", arr)
        object.__setattr__(self, "_hash", content_hash(arr))

    @classmethod
    def from_valid(cls, arr: np.ndarray) -> "RangesMask":
        """A mask of ranges that are valid by construction (``dcp.masks.mask_mod``): contiguous int32
        ``[L, R, 2]`` with a used last slot column, owned by no one else. Kept as is (made read-only),
        neither validated nor copied: a strided mask_mod's ranges on 32K tokens take a gigabyte."""
        if arr.dtype != np.int32 or arr.ndim != 3 or arr.shape[2] != 2 or not arr.flags.c_contiguous:
            raise InvalidMaskError(f"ranges: from_valid needs contiguous int32 [L, R, 2], got {arr.dtype} {arr.shape}")
        mask = cls.__new__(cls)
        mask._set(arr)
        return mask

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

    def check_length(self, seqlen: int) -> None:
        if seqlen != self.seqlen:
            raise InvalidMaskError(
                f"ranges: this mask was given for {self.seqlen} tokens, cannot evaluate it for {seqlen}")

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        self.check_length(check_seqlen(seqlen))
        return self.ranges.copy()

    def validated_ranges(self, seqlen: int, num_heads: int | None = None) -> np.ndarray:
        """The stored array itself (read-only, validated on construction)."""
        self.check_length(check_seqlen(seqlen))
        return self.ranges
