"""The batch description: sequence lengths, one mask per sequence (or one per sequence and *layer kind*),
attention head geometry."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from dcp.errors import InvalidBatchError
from dcp.masks import Mask

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise InvalidBatchError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name


#: bytes of block pair counts a ``BatchSpec`` keeps (``BatchSpec.block_pair_counts``)
PAIR_COUNTS_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class BatchSpec:
    """A packed batch of variable-length sequences, each with an attention mask.

    Args:
        seqlens: positive token count of every sequence, in packing order.
        masks: one ``Mask`` for all sequences, or one per sequence; a mask family's name ("causal",
            "full", or any ``dcp.masks.from_cli`` name whose parameters all have defaults) stands for it.
        num_heads: query heads ``Hq``; ``num_kv_heads`` (``Hkv``) must divide it (GQA).
        head_dim: ``D``, the size of one head.
        dtype: element type of q/k/v/o: "bfloat16" (default), "float16", "float32" or "float64"
            (a ``torch.dtype`` is accepted too).
        layers: for a model whose layers differ: ``masks`` is then a dict from *layer kind* name to that
            kind's mask(s) (one, or one per sequence), e.g. ``{"full": "causal", "sliding":
            SlidingWindowMask(128)}``, and ``layers`` how many layers of each kind the model has (a dict
            with the same names; omitted: one layer each). dcp's planner then places the tokens once and
            emits one program per kind (``dcp.ir.layered.LayeredPlan``).

    A layered batch's ``masks`` are its first kind's; ``kinds``, ``kind_masks`` and ``layers`` list every
    kind in the order given (empty for a batch of one kind), and ``for_kind(name)`` is the one-kind batch
    of a kind.

    Tokens are packed without padding: sequence ``i`` occupies rows
    ``cu_seqlens[i]:cu_seqlens[i+1]`` of a ``[total_tokens, heads, head_dim]`` tensor.
    """

    seqlens: tuple[int, ...]
    masks: tuple[Mask, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    kinds: tuple[str, ...] = ()
    kind_masks: tuple[tuple[Mask, ...], ...] = ()
    layers: tuple[int, ...] = ()
    _ranges_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __init__(self, seqlens: Sequence[int], masks: Mask | Sequence[Mask] | Mapping[str, Mask | Sequence[Mask]],
                 num_heads: int, num_kv_heads: int | None = None, head_dim: int = 128, dtype="bfloat16", *,
                 layers: Mapping[str, int] | None = None):
        lens = _lengths(seqlens)
        kinds, kind_masks, layer_counts = _layer_kinds(masks, layers, lens)
        mask_tuple = kind_masks[0] if kinds else _mask_tuple(masks, lens)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise InvalidBatchError(f"{name} must be a positive int, got {v!r}")
        if num_heads % num_kv_heads:
            raise InvalidBatchError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads} (GQA needs it)")
        for ms in kind_masks or (mask_tuple,):
            _check_lengths(ms, lens)
        object.__setattr__(self, "seqlens", tuple(int(x) for x in lens))
        object.__setattr__(self, "masks", mask_tuple)
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "kind_masks", kind_masks)
        object.__setattr__(self, "layers", layer_counts)
        object.__setattr__(self, "num_heads", int(num_heads))
        object.__setattr__(self, "num_kv_heads", int(num_kv_heads))
        object.__setattr__(self, "head_dim", int(head_dim))
        object.__setattr__(self, "dtype", _dtype_name(dtype))
        object.__setattr__(self, "_ranges_cache", {})

    @property
    def layered(self) -> bool:
        """Whether the batch names layer kinds (``masks`` given as a dict)."""
        return bool(self.kinds)

    def for_kind(self, kind: str) -> "BatchSpec":
        """The one-kind batch of layer kind ``kind`` (same lengths and heads; that kind's masks); cached."""
        if kind not in self.kinds:
            raise InvalidBatchError(f"no layer kind {kind!r} in this batch (kinds: {list(self.kinds)})")
        key = ("kind", kind)
        got = self._ranges_cache.get(key)
        if got is None:
            got = self._ranges_cache[key] = BatchSpec(self.seqlens, self.kind_masks[self.kinds.index(kind)],
                                                      self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
        return got

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
        """Validated KV ranges of sequence ``seq``: int32 ``[seqlen, R, 2]``, read-only (cached per
        mask/length; ``Mask.validated_ranges``)."""
        key = (self.masks[seq], self.seqlens[seq])
        cached = self._ranges_cache.get(key)
        if cached is None:
            try:
                # the model's head count: a mask_mod is probed for head dependence at its heads only
                cached = self.masks[seq].validated_ranges(self.seqlens[seq], num_heads=self.num_heads)
            except InvalidBatchError:
                raise
            except Exception as err:  # a mask that fails on this length is a batch error naming the sequence
                from dcp.errors import InvalidMaskError

                if isinstance(err, InvalidMaskError):
                    raise InvalidMaskError(f"sequence {seq} (length {self.seqlens[seq]}): {err}") from err
                raise
            self._ranges_cache[key] = cached
        return cached

    def block_pair_counts(self, seq: int, bounds: np.ndarray) -> np.ndarray:
        """Attended pairs between the blocks ``bounds`` cuts sequence ``seq`` into: int64 ``[n, n]`` (q, kv),
        read-only (``dcp.layout.blocks.pair_counts``). Cached per (mask, length, bounds) up to
        ``PAIR_COUNTS_CACHE_BYTES``: a planner evaluates dozens of layouts that cut most sequences alike."""
        # ``pair_counts``'s call, not the function: dcp.layout stands on the spec (tests/test_house.py)
        from dcp.masks.box_counts import box_counts

        b = np.ascontiguousarray(bounds, dtype=np.int64)
        key = ("counts", self.masks[seq], self.seqlens[seq], b.tobytes())
        got = self._ranges_cache.get(key)
        if got is None:
            got = box_counts(self.kv_ranges(seq), b, b)
            got.setflags(write=False)
            held = self._ranges_cache.get(("counts_bytes",), 0)
            if held + got.nbytes <= PAIR_COUNTS_CACHE_BYTES:
                self._ranges_cache[key] = got
                self._ranges_cache[("counts_bytes",)] = held + got.nbytes
        return got

    def describe(self) -> dict:
        """JSON-able description; ``BatchSpec.from_description`` inverts it."""
        uniq: list[dict] = []
        seen: dict = {}

        def indices(masks) -> list[int]:
            index = []
            for m in masks:
                k = id(m) if not _hashable(m) else m
                if k not in seen:
                    seen[k] = len(uniq)
                    uniq.append(m.describe())
                index.append(seen[k])
            return index

        d = {"seqlens": list(self.seqlens), "masks": uniq, "mask_index": indices(self.masks),
             "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
             "dtype": self.dtype}
        if self.kinds:
            d["kinds"] = [{"name": k, "mask_index": indices(ms), "layers": n}
                          for k, ms, n in zip(self.kinds, self.kind_masks, self.layers)]
        return d

    @staticmethod
    def from_description(d: dict) -> "BatchSpec":
        from dcp.masks import from_description

        uniq = [from_description(m) for m in d["masks"]]
        if d.get("kinds"):
            return BatchSpec(d["seqlens"], {k["name"]: [uniq[i] for i in k["mask_index"]] for k in d["kinds"]},
                             d["num_heads"], d["num_kv_heads"], d["head_dim"], d["dtype"],
                             layers={k["name"]: k["layers"] for k in d["kinds"]})
        return BatchSpec(d["seqlens"], [uniq[i] for i in d["mask_index"]], d["num_heads"],
                         d["num_kv_heads"], d["head_dim"], d["dtype"])


def _mask_tuple(masks, lens: np.ndarray) -> tuple[Mask, ...]:
    """One mask per sequence from one mask (or name) or one per sequence."""
    if isinstance(masks, (Mask, str)):
        return (_mask(masks, 0),) * lens.size
    try:
        mask_tuple = tuple(_mask(m, i) for i, m in enumerate(masks))
    except TypeError:
        raise InvalidBatchError(f"masks must be a dcp.masks.Mask (or a mask name), or one per sequence; got "
                                f"{type(masks).__name__}") from None
    if len(mask_tuple) != lens.size:
        raise InvalidBatchError(
            f"got {len(mask_tuple)} masks for {lens.size} sequences; give one mask or one per sequence")
    return mask_tuple


def _layer_kinds(masks, layers, lens: np.ndarray) -> tuple[tuple, tuple, tuple]:
    """(kind names, their mask tuples, their layer counts) of a ``masks`` dict; all empty otherwise."""
    if not isinstance(masks, Mapping):
        if layers is not None:
            raise InvalidBatchError("layers= counts the layers of each layer kind: give masks as a dict from kind "
                                    "name to mask, e.g. masks={'full': 'causal', 'sliding': SlidingWindowMask(128)}")
        return (), (), ()
    if not masks:
        raise InvalidBatchError("masks is an empty dict: give at least one layer kind")
    names = tuple(masks)
    bad = [k for k in names if not isinstance(k, str) or not k]
    if bad:
        raise InvalidBatchError(f"layer kind names must be non-empty strings, got {bad[0]!r}")
    layers = {k: 1 for k in names} if layers is None else dict(layers)
    if set(layers) != set(names):
        raise InvalidBatchError(f"layers names kinds {sorted(layers)}, masks names {sorted(names)}: give a layer "
                                "count for every kind and no other")
    counts = []
    for k in names:
        n = layers[k]
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
            raise InvalidBatchError(f"layers[{k!r}] must be a positive int, got {n!r}")
        counts.append(int(n))
    kind_masks = []
    for k in names:
        try:
            kind_masks.append(_mask_tuple(masks[k], lens))
        except InvalidBatchError as err:
            raise InvalidBatchError(f"layer kind {k!r}: {err}") from None
    return names, tuple(kind_masks), tuple(counts)


def _lengths(seqlens) -> np.ndarray:
    """``seqlens`` as a 1-D int64 array of positive lengths, or ``InvalidBatchError`` saying what is wrong."""
    what = "seqlens must be a non-empty 1-D sequence of positive ints"
    if seqlens is None or isinstance(seqlens, (str, bytes, dict)):
        raise InvalidBatchError(f"{what}, got {type(seqlens).__name__}")
    try:
        items = seqlens if isinstance(seqlens, np.ndarray) else list(seqlens)
        lens = np.asarray(items)
    except (TypeError, ValueError) as err:
        raise InvalidBatchError(f"{what}, got {seqlens!r:.80} ({err})") from None
    if lens.ndim != 1 or lens.size == 0:
        raise InvalidBatchError(f"{what}, got shape {lens.shape}")
    bools = [i for i, x in enumerate(lens.tolist() if lens.dtype == bool else items) if isinstance(x, (bool, np.bool_))]
    if lens.dtype == bool or bools:
        raise InvalidBatchError(f"{what}: entry {bools[0] if bools else 0} is a bool")
    if not np.issubdtype(lens.dtype, np.integer):
        if not np.issubdtype(lens.dtype, np.floating):
            raw = list(items)
            i = next((i for i, x in enumerate(raw) if not isinstance(x, (int, float, np.integer, np.floating))), 0)
            raise InvalidBatchError(f"{what}: entry {i} is {raw[i]!r}")
        bad = ~np.isfinite(lens) | (lens != np.round(lens))
        if bad.any():
            raise InvalidBatchError(f"{what}: entry {int(np.argmax(bad))} is {lens[np.argmax(bad)].item()!r}")
    if (lens <= 0).any():
        i = int(np.argmax(lens <= 0))
        raise InvalidBatchError(f"sequence {i} has length {lens[i]}; lengths must be positive")
    if lens.max() >= 2**31:
        raise InvalidBatchError(f"sequence {int(np.argmax(lens >= 2**31))} has {int(lens.max())} tokens; at most "
                                f"{2**31 - 1} per sequence")
    return lens.astype(np.int64)


def _check_lengths(masks: tuple[Mask, ...], lens: np.ndarray) -> None:
    """Refuse, now rather than at planning, a mask that cannot hold its sequence's length where that is
    known without evaluating it (``Mask.check_length``: a ``DocumentMask`` whose documents do not sum to
    the length, a ``RangesMask`` of another length): ``InvalidMaskError`` naming the sequence, as
    ``BatchSpec.kv_ranges`` would at planning."""
    from dcp.errors import InvalidMaskError

    seen: set = set()
    for seq, (m, n) in enumerate(zip(masks, lens.tolist())):
        key = (id(m), n)  # masks repeat (one for all sequences): check each (mask, length) once
        if key in seen:
            continue
        seen.add(key)
        try:
            m.check_length(n)
        except InvalidMaskError as err:
            raise InvalidMaskError(f"sequence {seq} (length {n}): {err}") from None


def _mask(m, i: int) -> Mask:
    """A mask, or a mask family name (``dcp.masks.from_cli``: "causal", "full", ...)."""
    if isinstance(m, Mask):
        return m
    if isinstance(m, str):
        from dcp.masks import from_cli

        return from_cli(m)
    raise InvalidBatchError(f"mask {i} is {type(m).__name__}, not a dcp.masks.Mask or a mask name")


def _hashable(obj) -> bool:
    try:
        hash(obj)
        return True
    except TypeError:
        return False
