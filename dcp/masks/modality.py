"""Modality (interleaved text / image) mask.

By default the sequence alternates a text segment of ``text_len`` tokens and an image segment of
``image_len`` tokens, starting with text; the last segment is truncated at L. Alternatively
``image_spans`` lists the images explicitly as half-open ``(start, end)`` token spans (sorted,
non-overlapping; spans reaching beyond L are clipped, spans starting at or after L are dropped), and
every other token is text.

Text tokens are causal, [0, t + 1). An image token attends bidirectionally within its image and causally
to everything before it, [0, image_end).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.base import Mask, check_int, check_seqlen


@dataclass(frozen=True)
class ModalityMask(Mask):
    text_len: int = 1024
    image_len: int = 1024
    image_spans: tuple[tuple[int, int], ...] | None = None
    name = "modality"

    def __post_init__(self):
        text_len = check_int(self.text_len, "modality: text_len", 0)
        image_len = check_int(self.image_len, "modality: image_len", 0)
        if text_len + image_len == 0:
            raise InvalidMaskError("modality: text_len + image_len must be positive")
        object.__setattr__(self, "text_len", text_len)
        object.__setattr__(self, "image_len", image_len)
        if self.image_spans is not None:
            spans = []
            try:
                items = list(self.image_spans)
            except TypeError:
                raise InvalidMaskError(
                    f"modality: image_spans must be a sequence of (start, end) pairs, got {self.image_spans!r}"
                ) from None
            for i, span in enumerate(items):
                try:
                    start, end = span
                except (TypeError, ValueError):
                    raise InvalidMaskError(
                        f"modality: image span {i} must be a (start, end) pair, got {span!r}") from None
                start = check_int(start, f"modality: image span {i} start", 0)
                end = check_int(end, f"modality: image span {i} end", start + 1)
                if spans and start < spans[-1][1]:
                    raise InvalidMaskError(f"modality: image span {i} {(start, end)} overlaps or precedes "
                                           f"span {i - 1} {spans[-1]}; spans must be sorted and disjoint")
                spans.append((start, end))
            object.__setattr__(self, "image_spans", tuple(spans))

    def image_end_per_token(self, seqlen: int) -> np.ndarray:
        """int64 ``[L]``: the end of the image containing each token, or 0 for text tokens."""
        t = np.arange(seqlen, dtype=np.int64)
        if self.image_spans is None:
            # clamping to L changes nothing inside the sequence and keeps the arithmetic small
            text_len, image_len = min(self.text_len, seqlen), min(self.image_len, seqlen)
            period = text_len + image_len
            is_image = t % period >= text_len
            image_end = np.minimum(seqlen, (t // period + 1) * period)
            return np.where(is_image, image_end, 0)
        spans = np.asarray(self.image_spans, dtype=np.int64).reshape(-1, 2)
        starts, ends = spans[:, 0], np.minimum(spans[:, 1], seqlen)
        idx = np.searchsorted(starts, t, side="right") - 1
        safe = np.maximum(idx, 0)
        is_image = (idx >= 0) & (t < ends[safe]) if len(spans) else np.zeros(seqlen, dtype=bool)
        return np.where(is_image, ends[safe] if len(spans) else 0, 0)

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        end = np.maximum(np.arange(1, seqlen + 1, dtype=np.int64), self.image_end_per_token(seqlen))
        ranges_tr2 = np.zeros((seqlen, 1, 2), dtype=np.int32)
        ranges_tr2[:, 0, 1] = end
        return ranges_tr2
