"""Layer kinds of a model for the loader: ``LayerKind`` (how many layers, which sliding window) and
``windowed_mask`` (a sample's mask restricted to a layer's window)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidConfigError
from dcp.masks import CausalMask, Mask


@dataclass(frozen=True)
class LayerKind:
    """One kind of attention layer of the model: ``count`` layers, attending through each sample's mask
    restricted to a sliding ``window`` of keys (the query itself included: query ``t`` sees keys ``s`` with
    ``t - s < window``, transformers' ``sliding_window``), or through the sample's mask (``window`` None)."""

    count: int
    window: int | None = None

    def __post_init__(self):
        for name, v, low in (("count", self.count, 1), ("window", self.window, 1)):
            if v is None and name == "window":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise InvalidConfigError(f"LayerKind.{name} must be an int >= {low}, got {v!r}")


def windowed_mask(mask: Mask, length: int, window: int, num_heads: int | None = None) -> Mask:
    """``mask`` on a ``length``-token sequence restricted to keys ``s > t - window`` (transformers'
    ``sliding_window_overlay``): ``SlidingWindowMask(window)`` for a causal mask, the narrower window for a
    ``SlidingWindowMask``, ``mask`` itself when it never reaches further back, else a ``dcp.masks.RangesMask``
    of the clipped ranges (int32 ``[length, R, 2]``). ``InvalidMaskError`` when a query keeps no key."""
    from dcp.errors import InvalidMaskError
    from dcp.masks import RangesMask, SlidingWindowMask

    if isinstance(mask, CausalMask):
        return SlidingWindowMask(window)
    if isinstance(mask, SlidingWindowMask):
        return mask if mask.window <= window else SlidingWindowMask(window)
    ranges_tr2 = mask.validated_ranges(length, num_heads=num_heads)
    lo_t = np.arange(length, dtype=np.int64) - window + 1  # [T] first key inside the window
    used_tr = ranges_tr2[:, :, 1] > ranges_tr2[:, :, 0]
    if not (used_tr & (ranges_tr2[:, :, 0] < lo_t[:, None])).any():
        return mask
    start_tr = np.maximum(ranges_tr2[:, :, 0], lo_t[:, None])
    keep_tr = used_tr & (ranges_tr2[:, :, 1] > start_tr)
    lost = np.flatnonzero(used_tr.any(1) & ~keep_tr.any(1))
    if lost.size:
        raise InvalidMaskError(f"query token {int(lost[0])} attends to no key within the sliding window of "
                               f"{window}: a window layer cannot run this mask")
    # ranges are sorted, so the dropped ones (ending before the window) come first: shift the kept ones left
    first_r = np.argmax(keep_tr, axis=1)  # [T] first kept slot
    slots = ranges_tr2.shape[1]
    src_tr = np.minimum(first_r[:, None] + np.arange(slots), slots - 1)
    out_tr2 = np.stack([np.take_along_axis(start_tr, src_tr, 1), np.take_along_axis(ranges_tr2[:, :, 1], src_tr, 1)],
                       axis=-1).astype(np.int32)
    out_tr2[~np.take_along_axis(keep_tr, src_tr, 1) | (first_r[:, None] + np.arange(slots) >= slots)] = 0
    return RangesMask(out_tr2)


def check_layer_kinds(layer_kinds) -> dict | None:
    """``layer_kinds`` as a ``{name: LayerKind}`` dict (None stays None), or ``InvalidConfigError``."""
    if layer_kinds is None:
        return None
    if not isinstance(layer_kinds, dict) or not layer_kinds:
        raise InvalidConfigError(f"layer_kinds must be a non-empty dict of layer kind name -> LayerKind, got "
                                 f"{layer_kinds!r}")
    for name, kind in layer_kinds.items():
        if not isinstance(name, str) or not name or not isinstance(kind, LayerKind):
            raise InvalidConfigError(f"layer_kinds: {name!r} -> {kind!r}: give a non-empty name and a "
                                     f"dcp.integration.LayerKind")
    return dict(layer_kinds)


__all__ = ["LayerKind", "windowed_mask", "check_layer_kinds"]
