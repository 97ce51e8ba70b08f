"""Command line: draw a mask as a PNG (rendering: ``dcp.masks.render``).

``python -m dcp.masks.draw NAME OUT.png [--seqlen L] [--max-pixels N] [key=value ...]``, e.g.
``python -m dcp.masks.draw lambda out.png sink=64 window=512``. Masks with required parameters draw an
example (``EXAMPLES``) when none are given.
"""
from __future__ import annotations

import argparse

from dcp.masks.registry import MASKS, from_cli

#: parameters and sequence length drawn when the command line gives none (one example per mask)
EXAMPLES: dict[str, tuple[dict, int]] = {
    "lambda": ({"sink": 64, "window": 512}, 8192),
    "sliding_window": ({"window": 256}, 8192),
    "modality": ({"text_len": 256, "image_len": 512}, 8192),
    "document": ({"doc_lengths": (1024, 512, 2048, 512)}, 4096),
}


def mask_main(name: str | None = None, argv=None, defaults: dict | None = None, seqlen: int | None = None) -> int:
    """Command line entry: build a mask (by name and ``key=value`` parameters) and draw it. Parameters not
    given take ``defaults``, else the mask's entry in ``EXAMPLES``; ``seqlen`` likewise (else 8192)."""
    parser = argparse.ArgumentParser(description="Draw an attention mask as a PNG.")
    if name is None:
        parser.add_argument("mask", help=f"mask name, one of {sorted(MASKS)}")
    parser.add_argument("out", help="output PNG path")
    parser.add_argument("--seqlen", type=int, default=None, help="sequence length (default: the example's, else 8192)")
    parser.add_argument("--max-pixels", type=int, default=1024)
    parser.add_argument("params", nargs="*", metavar="key=value", help="mask parameters")
    args = parser.parse_intermixed_args(argv)
    mask_name = name or args.mask
    example_params, example_seqlen = EXAMPLES.get(mask_name, ({}, 8192))
    params = dict(example_params if defaults is None else defaults)
    seqlen = args.seqlen or seqlen or example_seqlen
    for item in args.params:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"parameter {item!r} is not of the form key=value")
        params[key] = value
    mask = from_cli(mask_name, **params)
    mask.draw(seqlen, args.out, max_pixels=args.max_pixels)
    print(f"wrote {args.out}: {mask.describe() if mask.name != 'ranges' else mask!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(mask_main())
