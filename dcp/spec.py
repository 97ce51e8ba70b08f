"""The batch description: sequence lengths, one mask per sequence, attention head geometry."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dcp.errors import InvalidBatchError
from dcp.masks import Mask

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise InvalidBatchError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name


@dataclass(frozen=True)
class BatchSpec:
    """A packed batch of variable-length sequences, each with an attention mask.

    Args:
        seqlens: positive token count of every sequence, in packing order.
        masks: one ``Mask`` for all sequences, or one per sequence.
        num_heads: query heads ``Hq``; ``num_kv_heads`` (``Hkv``) must divide it (GQA).
        head_dim: ``D``, the size of one head.
        dtype: element type of q/k/v/o: "bfloat16" (default), "float16", "float32" or "float64"
            (a ``torch.dtype`` is accepted too).

    Tokens are packed without padding: sequence ``i`` occupies rows
    ``cu_seqlens[i]:cu_seqlens[i+1]`` of a ``[total_tokens, heads, head_dim]`` tensor.
    """

    seqlens: tuple[int, ...]
    masks: tuple[Mask, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    _ranges_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __init__(self, seqlens: Sequence[int], masks: Mask | Sequence[Mask], num_heads: int,
                 num_kv_heads: int | None = None, head_dim: int = 128, dtype="bfloat16"):
        lens = np.asarray(list(seqlens) if not isinstance(seqlens, np.ndarray) else seqlens)
        if lens.ndim != 1 or lens.size == 0:
            raise InvalidBatchError("seqlens must be a non-empty 1-D sequence of positive ints")
        if not np.issubdtype(lens.dtype, np.integer):
            if not (np.issubdtype(lens.dtype, np.floating) and np.all(lens == np.round(lens))):
                raise InvalidBatchError(f"seqlens must be integers, got dtype {lens.dtype}")
        if (lens <= 0).any():
            i = int(np.argmax(lens <= 0))
            raise InvalidBatchError(f"sequence {i} has length {lens[i]}; lengths must be positive")
        if isinstance(masks, Mask):
            mask_tuple = (masks,) * lens.size
        else:
            mask_tuple = tuple(masks)
            if len(mask_tuple) != lens.size:
                raise InvalidBatchError(
                    f"got {len(mask_tuple)} masks for {lens.size} sequences; give one mask or one per sequence")
        for i, m in enumerate(mask_tuple):
            if not isinstance(m, Mask):
                raise InvalidBatchError(f"mask {i} is {type(m).__name__}, not a dcp.masks.Mask")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise InvalidBatchError(f"{name} must be a positive int, got {v!r}")
        if num_heads % num_kv_heads:
            raise InvalidBatchError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads} (GQA needs it)")
        object.__setattr__(self, "seqlens", tuple(int(x) for x in lens))
        object.__setattr__(self, "masks", mask_tuple)
        object.__setattr__(self, "num_heads", int(num_heads))
        object.__setattr__(self, "num_kv_heads", int(num_kv_heads))
        object.__setattr__(self, "head_dim", int(head_dim))
        object.__setattr__(self, "dtype", _dtype_name(dtype))
        object.__setattr__(self, "_ranges_cache", {})

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def total_tokens(self) -> int:
        return int(sum(self.seqlens))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int64 ``[num_seqs + 1]`` prefix sums of the lengths."""
        return np.concatenate([[0], np.cumsum(self.seqlens, dtype=np.int64)])

    def kv_ranges(self, seq: int) -> np.ndarray:
        """Validated KV ranges of sequence ``seq``: int32 ``[seqlen, R, 2]`` (cached per mask/length)."""
        from dcp.masks.base import validate_ranges

        key = (self.masks[seq], self.seqlens[seq])
        cached = self._ranges_cache.get(key)
        if cached is None:
            try:
                cached = validate_ranges(self.masks[seq].kv_ranges(self.seqlens[seq]), self.seqlens[seq])
            except InvalidBatchError:
                raise
            except Exception as err:  # a mask that fails on this length is a batch error naming the sequence
                from dcp.errors import InvalidMaskError

                if isinstance(err, InvalidMaskError):
                    raise InvalidMaskError(f"sequence {seq} (length {self.seqlens[seq]}): {err}") from err
                raise
            cached.setflags(write=False)
            self._ranges_cache[key] = cached
        return cached

    def describe(self) -> dict:
        """JSON-able description; ``BatchSpec.from_description`` inverts it."""
        uniq: list[dict] = []
        index: list[int] = []
        seen: dict = {}
        for m in self.masks:
            k = id(m) if not _hashable(m) else m
            if k not in seen:
                seen[k] = len(uniq)
                uniq.append(m.describe())
            index.append(seen[k])
        return {"seqlens": list(self.seqlens), "masks": uniq, "mask_index": index,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype}

    @staticmethod
    def from_description(d: dict) -> "BatchSpec":
        from dcp.masks import from_description

        uniq = [from_description(m) for m in d["masks"]]
        return BatchSpec(d["seqlens"], [uniq[i] for i in d["mask_index"]], d["num_heads"],
                         d["num_kv_heads"], d["head_dim"], d["dtype"])


def _hashable(obj) -> bool:
    try:
        hash(obj)
        return True
    except TypeError:
        return False
