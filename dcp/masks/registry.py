"""Mask families by name, and building masks from descriptions (JSON) or command-line strings.

``from_description(mask.describe()) == mask`` for every mask except ``MaskModMask`` (callables cannot be
rebuilt from a description; materialize with ``from_mask_mod`` instead).
"""
from __future__ import annotations

import dataclasses
import json

from dcp.errors import InvalidMaskError
from dcp.masks.base import Mask
from dcp.masks.causal import CausalMask
from dcp.masks.causal_blockwise import CausalBlockwiseMask
from dcp.masks.document import DocumentMask
from dcp.masks.full import FullMask
from dcp.masks.lambda_mask import LambdaMask
from dcp.masks.mask_mod import MaskModMask
from dcp.masks.modality import ModalityMask
from dcp.masks.prefix_lm import PrefixLMMask
from dcp.masks.ranges import RangesMask
from dcp.masks.shared_question import SharedQuestionMask
from dcp.masks.sliding_window import SlidingWindowMask

MASKS: dict[str, type[Mask]] = {
    cls.name: cls
    for cls in (CausalMask, FullMask, SlidingWindowMask, LambdaMask, SharedQuestionMask, CausalBlockwiseMask,
                ModalityMask, PrefixLMMask, DocumentMask, RangesMask, MaskModMask)
}


def _lookup(name) -> type[Mask]:
    cls = MASKS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidMaskError(f"unknown mask {name!r}; valid names: {', '.join(sorted(MASKS))}")
    return cls


def _param_names(cls: type[Mask]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _build(cls: type[Mask], params: dict) -> Mask:
    valid = _param_names(cls)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise InvalidMaskError(f"mask {cls.name!r} has no parameter(s) {unknown}; valid: {valid or 'none'}")
    try:
        return cls(**params)
    except TypeError as exc:  # e.g. a missing required parameter
        raise InvalidMaskError(f"mask {cls.name!r}: {exc}; parameters: {valid}") from None


def from_description(d: dict) -> Mask:
    """Rebuild a mask from ``Mask.describe()`` output (also after a JSON round trip)."""
    if isinstance(d, Mask):
        return d
    if not isinstance(d, dict) or "name" not in d:
        raise InvalidMaskError(f"a mask description must be a dict with a 'name' key, got {d!r}")
    params = dict(d)
    cls = _lookup(params.pop("name"))
    if cls is MaskModMask:
        raise InvalidMaskError("a mask_mod mask cannot be rebuilt from its description (it holds a callable); "
                               "materialize it with dcp.masks.from_mask_mod(fn, seqlen) instead")
    if cls is DocumentMask and "inner" in params:
        params["inner"] = from_description(params["inner"])
    return _build(cls, params)


# ----------------------------------------------------------------------------------------------------
# command line: parameter values may arrive as strings
# ----------------------------------------------------------------------------------------------------

def _parse_scalar(value: str, what: str, kind: type):
    try:
        return kind(value)
    except ValueError:
        raise InvalidMaskError(f"{what}: expected {kind.__name__}, got {value!r}") from None


def _coerce(cls: type[Mask], key: str, value):
    if not isinstance(value, str):
        return value
    what = f"mask {cls.name!r} parameter {key!r}"
    text = value.strip()
    if key == "inner":  # a nested mask: JSON description or a bare name
        if text.startswith("{"):
            return from_description(json.loads(text))
        return from_cli(text)
    if key == "ranges":
        return json.loads(text)
    if text.lower() == "none" and key in ("prefix_len", "image_spans"):
        return None
    if key == "doc_lengths":  # "100,200,300" or JSON list
        if text.startswith("["):
            return tuple(json.loads(text))
        return tuple(_parse_scalar(x, what, int) for x in text.split(",") if x.strip())
    if key == "image_spans":  # "0:100,300:400" or JSON list of pairs
        if text.startswith("["):
            return tuple(tuple(p) for p in json.loads(text))
        spans = []
        for item in text.split(","):
            start, sep, end = item.partition(":")
            if not sep:
                raise InvalidMaskError(f"{what}: spans are written start:end, got {item!r}")
            spans.append((_parse_scalar(start, what, int), _parse_scalar(end, what, int)))
        return tuple(spans)
    field_type = {f.name: f.type for f in dataclasses.fields(cls)}.get(key)
    type_text = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", "")
    if type_text.startswith("int"):
        return _parse_scalar(text, what, int)
    if type_text.startswith("float"):
        return _parse_scalar(text, what, float)
    return value


def from_cli(name: str, **params) -> Mask:
    """Build a mask from a command line: ``name`` plus parameters whose values may be strings.

    Unknown names or parameters raise ``InvalidMaskError`` listing the valid ones. Strings are converted
    by parameter type: ints and floats; ``doc_lengths`` as "100,200,300"; ``image_spans`` as
    "0:100,300:400"; ``inner`` as a mask name or JSON description; "none" for optional parameters.
    """
    cls = _lookup(name)
    if cls is MaskModMask:
        raise InvalidMaskError("a mask_mod mask needs a Python callable and cannot be built from a command line")
    valid = _param_names(cls)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise InvalidMaskError(f"mask {cls.name!r} has no parameter(s) {unknown}; valid: {valid or 'none'}")
    try:
        coerced = {key: _coerce(cls, key, value) for key, value in params.items()}
    except json.JSONDecodeError as exc:
        raise InvalidMaskError(f"mask {cls.name!r}: cannot parse a parameter as JSON: {exc}") from None
    return _build(cls, coerced)
