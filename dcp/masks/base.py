"""The mask contract: every attention mask is a set of KV index ranges per query token.

A mask object is independent of any one sequence: ``kv_ranges(seqlen)`` evaluates it for a sequence of
``seqlen`` tokens and returns an int32 array ``ranges_tr2`` of shape ``[seqlen, R, 2]`` where
``ranges_tr2[t, r] = (start, end)`` is a half-open interval of key/value positions that query token
``t`` attends to. Per token the ranges are sorted by start, pairwise disjoint and non-adjacent is not
required; unused slots are padded with empty ranges ``(0, 0)`` placed *after* the used ones.
All positions are local to the sequence, ``0 <= start <= end <= seqlen``.
"""
from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from dcp.errors import InvalidMaskError


class Mask(abc.ABC):
    """Base class of all masks. Subclasses are frozen dataclasses with validated parameters."""

    name: ClassVar[str] = "mask"

    @abc.abstractmethod
    def kv_ranges(self, seqlen: int) -> np.ndarray:
        """KV ranges per query token: int32 ``[seqlen, R, 2]`` (see module docstring)."""

    def check_length(self, seqlen: int) -> None:
        """Raise ``InvalidMaskError`` if the mask cannot be evaluated for ``seqlen`` tokens, when that is
        known without evaluating it (a ``BatchSpec`` calls this on construction). Default: no check."""

    def validated_ranges(self, seqlen: int, num_heads: int | None = None) -> np.ndarray:
        """``kv_ranges(seqlen)`` checked by ``validate_ranges``, read-only: what a ``BatchSpec`` plans with.
        ``num_heads``: the model's query heads (a mask_mod is probed for head dependence only at heads
        that exist). Masks whose ranges are valid by construction return them without a copy."""
        out = validate_ranges(self.kv_ranges(seqlen), seqlen)
        out.setflags(write=False)
        return out

    def describe(self) -> dict:
        """JSON-able description ``{"name": ..., **params}``; ``masks.from_description`` inverts it."""
        import dataclasses

        params = dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}
        return {"name": self.name, **params}

    def dense(self, seqlen: int) -> np.ndarray:
        """Boolean ``[seqlen, seqlen]`` matrix, True where query t may attend to key s (tests, drawing)."""
        return ranges_to_dense(self.kv_ranges(seqlen), seqlen)

    def draw(self, seqlen: int, path: str, max_pixels: int = 1024) -> None:
        """Write the mask of a ``seqlen``-token sequence as a PNG (downsampled to <= max_pixels)."""
        from dcp.masks.render import draw_ranges

        draw_ranges(self.kv_ranges(seqlen), seqlen, path, title=f"{self.name} (L={seqlen})",
                    max_pixels=max_pixels)


def check_seqlen(seqlen: int) -> int:
    if not isinstance(seqlen, (int, np.integer)) or isinstance(seqlen, bool) or seqlen <= 0:
        raise InvalidMaskError(f"sequence length must be a positive int, got {seqlen!r}")
    return int(seqlen)


def ranges_to_dense(ranges_tr2: np.ndarray, seqlen: int) -> np.ndarray:
    """Boolean ``[T, seqlen]`` matrix of the given ranges (vectorized over tokens and ranges)."""
    kv_pos = np.arange(seqlen)
    starts = ranges_tr2[:, :, 0][:, :, None]
    ends = ranges_tr2[:, :, 1][:, :, None]
    return ((kv_pos >= starts) & (kv_pos < ends)).any(axis=1)


def validate_ranges(ranges_tr2: np.ndarray, seqlen: int) -> np.ndarray:
    """Check the contract of ``kv_ranges`` and return the array as contiguous int32.

    Raises ``InvalidMaskError`` naming the first offending token. Checked in chunks of rows, so that the
    temporaries of a mask of thousands of ranges per token stay small.
    """
    arr = np.asarray(ranges_tr2)
    if arr.ndim != 3 or arr.shape[0] != seqlen or arr.shape[2] != 2 or arr.shape[1] < 1:
        raise InvalidMaskError(f"KV ranges must have shape [{seqlen}, R>=1, 2], got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidMaskError(f"KV ranges must be integers, got dtype {arr.dtype}")
    step = max(1, VALIDATE_CHUNK // arr.shape[1])
    for t0 in range(0, arr.shape[0], step):
        _check_rows(arr[t0: t0 + step], seqlen, t0)
    return np.ascontiguousarray(arr, dtype=np.int32)


#: range slots checked at once by ``validate_ranges``
VALIDATE_CHUNK = 1 << 20


def _check_rows(arr: np.ndarray, seqlen: int, t0: int) -> None:
    """``validate_ranges`` on rows ``t0 ..`` of the array (``arr`` holds just those rows)."""
    starts, ends = arr[:, :, 0], arr[:, :, 1]
    bad = (starts < 0) | (ends > seqlen) | (ends < starts)
    if bad.any():
        t, r = np.argwhere(bad)[0]
        raise InvalidMaskError(
            f"query token {t0 + t}: range {tuple(arr[t, r])} lies outside [0, {seqlen}] or is reversed")
    used = ends > starts
    # used ranges come first; each starts at or after the previous one's end
    if (~used[:, :-1] & used[:, 1:]).any():
        t = int(np.argwhere(~used[:, :-1] & used[:, 1:])[0, 0])
        raise InvalidMaskError(f"query token {t0 + t}: an empty range precedes a non-empty one")
    overlap = used[:, 1:] & (starts[:, 1:] < ends[:, :-1])
    if overlap.any():
        t = int(np.argwhere(overlap)[0, 0])
        raise InvalidMaskError(f"query token {t0 + t}: ranges {arr[t].tolist()} overlap or are unsorted")


def dense_to_ranges(allowed_tk: np.ndarray) -> np.ndarray:
    """Run-length encode a boolean ``[T, K]`` matrix into padded KV ranges ``[T, R, 2]`` (vectorized)."""
    allowed = np.asarray(allowed_tk, dtype=bool)
    n_tok, n_kv = allowed.shape
    padded = np.zeros((n_tok, n_kv + 2), dtype=np.int8)
    padded[:, 1:-1] = allowed
    edges = np.diff(padded, axis=1)
    start_t, start_k = np.nonzero(edges == 1)
    end_t, end_k = np.nonzero(edges == -1)
    counts = np.bincount(start_t, minlength=n_tok)
    max_r = max(int(counts.max()) if n_tok else 0, 1)
    out = np.zeros((n_tok, max_r, 2), dtype=np.int32)
    # slot of each run within its row: position minus the row's first run index
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(len(start_t)) - first[start_t]
    out[start_t, slot, 0] = start_k
    out[end_t, slot, 1] = end_k
    return out


# ----------------------------------------------------------------------------------------------------
# helpers for mask implementations (parameter validation and vectorized range packing)
# ----------------------------------------------------------------------------------------------------

def check_int(value, what: str, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, or raise ``InvalidMaskError`` if it is not an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidMaskError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidMaskError(f"{what} must be >= {minimum}, got {value}")
    return value


def check_float(value, what: str, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> float:
    """Return ``value`` as a float in the interval ``low..high`` (open ends as flagged) or raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidMaskError(f"{what} must be a number, got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if not np.isfinite(value) or too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise InvalidMaskError(f"{what} must lie in {interval}, got {value}")
    return value


def pack_two_ranges(s0: np.ndarray, e0: np.ndarray, s1: np.ndarray, e1: np.ndarray) -> np.ndarray:
    """Pack two sorted candidate ranges per token into a valid ``[T, 2, 2]`` int32 array.

    Requires ``e0 <= s1`` wherever both ranges are non-empty. Empty ranges are dropped (the used one
    moves to slot 0, empty slots become ``(0, 0)``) and touching ranges are merged into one.
    """
    s0, e0, s1, e1 = (np.asarray(a).astype(np.int32, copy=False) for a in (s0, e0, s1, e1))
    used0 = e0 > s0
    used1 = e1 > s1
    both = used0 & used1
    second = both & (e0 != s1)  # two separate ranges; when they touch they merge into slot 0
    out = np.zeros((s0.shape[0], 2, 2), dtype=np.int32)
    out[:, 0, 0] = np.where(used0, s0, s1 * used1)
    out[:, 0, 1] = np.where(used0, np.where(both & ~second, e1, e0), e1 * used1)
    out[:, 1, 0] = s1 * second
    out[:, 1, 1] = e1 * second
    return out
