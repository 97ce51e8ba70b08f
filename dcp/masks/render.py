"""Draw a mask as a PNG image (query tokens down, key positions across; attended pairs dark).

The image is computed from the KV ranges without building the dense ``L x L`` matrix: with
``n = min(L, max_pixels)`` pixels per side, token k falls into pixel ``k * n // L`` along either axis.
A pixel's darkness is the *fraction* of its (query, key) pairs that are attended (``density_ranges``,
exact counts from ``dcp.masks.box_counts``), on a square-root scale — ``darkness = sqrt(fraction)`` — so
that a strided or dilated mask shows as the grey of its density rather than as a solid block, while a
thin structure (a one-key sink, a diagonal) still shows: any pixel with an attended pair is at least
``MIN_DARKNESS`` dark, a full one black. (``downsample_ranges`` gives the plain max-pool: whether any
pair of a pixel is attended.) Small masks are scaled up by an integer factor so that the picture is at
least about 256 pixels wide (never beyond ``max_pixels``).

matplotlib is optional: when it is importable (and ``backend`` is "auto" or "matplotlib") the image is
drawn with axes and a title; otherwise a plain grayscale PNG is written with ``zlib`` + ``struct`` (the
title goes into a ``tEXt`` chunk).

The command line is ``dcp.masks.draw``.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.box_counts import box_counts

MIN_SIDE = 256
#: darkness of a pixel with a single attended pair, at least (a fully attended pixel is 1: black)
MIN_DARKNESS = 1 / 16


def downsample_ranges(ranges_tr2: np.ndarray, seqlen: int, max_pixels: int = 1024) -> np.ndarray:
    """Max-pool the mask given by ``ranges_tr2`` into a boolean ``[n, n]`` image, ``n = min(L, max_pixels)``."""
    ranges_tr2 = np.asarray(ranges_tr2)
    if max_pixels < 1:
        raise InvalidMaskError(f"max_pixels must be >= 1, got {max_pixels}")
    n = min(seqlen, int(max_pixels))
    starts = ranges_tr2[:, :, 0].astype(np.int64)
    ends = ranges_tr2[:, :, 1].astype(np.int64)
    used = ends > starts
    tok = np.broadcast_to(np.arange(ranges_tr2.shape[0], dtype=np.int64)[:, None], used.shape)[used]
    row = tok * n // seqlen
    col_first = starts[used] * n // seqlen
    col_last = (ends[used] - 1) * n // seqlen
    # difference array per pixel row: +1 at the first covered column, -1 after the last one
    width = n + 1
    diff = np.bincount(row * width + col_first, minlength=n * width).astype(np.int64)
    diff -= np.bincount(row * width + col_last + 1, minlength=n * width)
    return np.cumsum(diff.reshape(n, width), axis=1)[:, :n] > 0


def pixel_bounds(seqlen: int, max_pixels: int) -> np.ndarray:
    """Token boundaries of the ``n = min(L, max_pixels)`` pixels: token k is in pixel ``k * n // L``."""
    if max_pixels < 1:
        raise InvalidMaskError(f"max_pixels must be >= 1, got {max_pixels}")
    n = min(seqlen, int(max_pixels))
    return -(-np.arange(n + 1, dtype=np.int64) * seqlen // n)


def density_ranges(ranges_tr2: np.ndarray, seqlen: int, max_pixels: int = 1024) -> np.ndarray:
    """Fraction of attended (query, key) pairs in each pixel: float64 ``[n, n]``, ``n = min(L, max_pixels)``
    (pixels as in ``downsample_ranges``; exact counts over the pixel's area)."""
    bounds = pixel_bounds(seqlen, max_pixels)
    counts = box_counts(np.asarray(ranges_tr2), bounds, bounds)
    side = np.diff(bounds).astype(np.float64)
    return counts / (side[:, None] * side[None, :])


def darkness(fraction: np.ndarray) -> np.ndarray:
    """Pixel darkness in [0, 1] from the fraction of attended pairs (module docstring)."""
    return np.where(fraction > 0, np.maximum(np.sqrt(fraction), MIN_DARKNESS), 0.0)


def png_bytes(gray_hw: np.ndarray, title: str | None = None) -> bytes:
    """Encode an 8-bit grayscale image ``[H, W]`` as PNG bytes (no dependencies)."""
    img = np.ascontiguousarray(gray_hw, dtype=np.uint8)
    height, width = img.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = np.zeros((height, width + 1), dtype=np.uint8)  # filter byte 0 (None) per scanline
    raw[:, 1:] = img
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    if title:
        out += chunk(b"tEXt", b"Title\x00" + title.encode("latin-1", "replace"))
    out += chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b"")
    return out


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def draw_ranges(ranges_tr2: np.ndarray, seqlen: int, path: str, title: str | None = None,
                max_pixels: int = 1024, backend: str = "auto") -> None:
    """Write the mask given by KV ranges ``[seqlen, R, 2]`` as a PNG at ``path``.

    ``backend``: "auto" (matplotlib if importable, else plain PNG), "matplotlib" or "png".
    """
    if backend not in ("auto", "matplotlib", "png"):
        raise InvalidMaskError(f"draw backend must be 'auto', 'matplotlib' or 'png', got {backend!r}")
    dark = darkness(density_ranges(ranges_tr2, seqlen, max_pixels))
    if backend == "matplotlib" or (backend == "auto" and _have_matplotlib()):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 6), dpi=max(100, min(300, dark.shape[0] // 5)))
        image = ax.imshow(dark, cmap="gray_r", interpolation="nearest", extent=(0, seqlen, seqlen, 0),
                          vmin=0, vmax=1)
        bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ticks = np.array([0.0, 1 / 64, 1 / 16, 1 / 4, 1 / 2, 1.0])
        bar.set_ticks(np.sqrt(ticks), labels=["0", "1/64", "1/16", "1/4", "1/2", "1"])
        bar.set_label("fraction of (query, key) pairs attended")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return
    n = dark.shape[0]
    scale = max(1, min(MIN_SIDE, int(max_pixels)) // n)
    gray = np.rint(255 * (1 - dark)).astype(np.uint8)
    if scale > 1:
        gray = np.repeat(np.repeat(gray, scale, axis=0), scale, axis=1)
    with open(path, "wb") as f:
        f.write(png_bytes(gray, title))
