"""Attention masks as KV ranges per query token. See ``dcp.masks.base`` for the contract.

Mask families (one module each): ``CausalMask``, ``FullMask``, ``SlidingWindowMask``, ``LambdaMask``,
``SharedQuestionMask``, ``CausalBlockwiseMask``, ``ModalityMask``, ``PrefixLMMask``, ``DocumentMask``,
``RangesMask`` (explicit ranges) and ``MaskModMask`` (a FlexAttention-style predicate). ``MASKS`` maps
family names to classes; ``from_description`` inverts ``Mask.describe()``; ``from_cli`` builds a mask
from command-line strings; ``from_mask_mod`` materializes a predicate. Any mask draws as a PNG:
``mask.draw(seqlen, "out.png")``, or ``python -m dcp.masks.draw lambda out.png [--seqlen L] [key=value ...]``.

The submodules other than ``base`` and ``causal`` are imported lazily on first attribute access, so that
``import dcp.masks`` stays light.
"""
from __future__ import annotations

import importlib

from dcp.masks.base import Mask, check_seqlen, dense_to_ranges, pack_two_ranges, ranges_to_dense, validate_ranges
from dcp.masks.causal import CausalMask

_LAZY = {
    "FullMask": "full",
    "SlidingWindowMask": "sliding_window",
    "LambdaMask": "lambda_mask",
    "SharedQuestionMask": "shared_question",
    "CausalBlockwiseMask": "causal_blockwise",
    "ModalityMask": "modality",
    "PrefixLMMask": "prefix_lm",
    "DocumentMask": "document",
    "RangesMask": "ranges",
    "MaskModMask": "mask_mod",
    "from_mask_mod": "mask_mod",
    "MASKS": "registry",
    "from_description": "registry",
    "from_cli": "registry",
    "draw_ranges": "render",
}

__all__ = ["Mask", "CausalMask", "dense_to_ranges", "ranges_to_dense", "validate_ranges", "check_seqlen",
           "pack_two_ranges", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
