"""Document mask: a sequence packing several documents, each masked by ``inner`` on its own.

``doc_lengths`` are the documents' token counts in order; they must sum to the evaluated sequence
length (``check_length``: a ``BatchSpec`` refuses a mismatch on construction). Document i occupies [o_i, o_i + n_i) and its tokens use ``inner.kv_ranges(n_i)`` shifted by o_i,
so no token ever attends across a document boundary. The result is padded to the largest number of
range slots over all documents.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.base import Mask, check_int, check_seqlen
from dcp.masks.causal import CausalMask


@dataclass(frozen=True)
class DocumentMask(Mask):
    doc_lengths: tuple[int, ...]
    inner: Mask = field(default_factory=CausalMask)
    name = "document"

    def __post_init__(self):
        if isinstance(self.doc_lengths, (str, bytes)) or not hasattr(self.doc_lengths, "__iter__"):
            raise InvalidMaskError(f"document: doc_lengths must be a sequence of ints, got {self.doc_lengths!r}")
        lengths = tuple(check_int(n, f"document: doc_lengths[{i}]", 1) for i, n in enumerate(self.doc_lengths))
        if not lengths:
            raise InvalidMaskError("document: doc_lengths must name at least one document")
        object.__setattr__(self, "doc_lengths", lengths)
        if not isinstance(self.inner, Mask):
            raise InvalidMaskError(f"document: inner must be a Mask, got {self.inner!r}")

    def describe(self) -> dict:
        return {"name": self.name, "doc_lengths": list(self.doc_lengths), "inner": self.inner.describe()}

    def check_length(self, seqlen: int) -> None:
        total = sum(self.doc_lengths)
        if total != seqlen:
            raise InvalidMaskError(
                f"document: doc_lengths sum to {total} but the sequence has {seqlen} tokens")
        for n in sorted(set(self.doc_lengths)):
            self.inner.check_length(n)

    def kv_ranges(self, seqlen: int) -> np.ndarray:
        seqlen = check_seqlen(seqlen)
        self.check_length(seqlen)
        lengths = np.asarray(self.doc_lengths, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # evaluate the inner mask once per distinct document length
        per_length = {int(n): self.inner.kv_ranges(int(n)) for n in np.unique(lengths)}
        max_r = max(r.shape[1] for r in per_length.values())
        out = np.zeros((seqlen, max_r, 2), dtype=np.int32)
        for n, base in per_length.items():
            doc_offsets = offsets[lengths == n]  # [D]
            rows = (doc_offsets[:, None] + np.arange(n)[None, :]).reshape(-1)  # [D * n]
            used = (base[:, :, 1] > base[:, :, 0])[None, :, :, None]  # [1, n, R, 1]
            shifted = base[None].astype(np.int64) + doc_offsets[:, None, None, None] * used  # [D, n, R, 2]
            out[rows, : base.shape[1]] = shifted.reshape(-1, base.shape[1], 2)
        return out
