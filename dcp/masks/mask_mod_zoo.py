"""FlexAttention-style mask_mods (``mask_mod(b, h, q_idx, kv_idx) -> bool``), written as users write them
(torch lookup tables, ``//`` and ``%`` on token indices, ``clamp``), as workloads for tests and
``benchmarks/bench_mask_mod.py``. Each factory returns a mask_mod; ``ZOO`` builds each one for a length.

They follow the shapes of the public attention-gym examples (causal, sliding window, document packing
around an inner mask, prefix-LM, dilated sliding window, 2-D neighbourhood attention, 2-D sliding tile
attention) plus a video-sparse-attention-like top-k tile selection and block-causal attention.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

MaskMod = Callable[..., torch.Tensor]


def causal() -> MaskMod:
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return causal_mask


def sliding_window(window: int) -> MaskMod:
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return sliding_window_mask


def document(doc_lengths: list[int], inner: MaskMod | None = None) -> MaskMod:
    """Documents packed back to back, each masked by ``inner`` (causal) in its own coordinates."""
    inner = inner or causal()
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(doc_lengths)]), dtype=torch.int32)
    doc_id = torch.repeat_interleave(torch.arange(len(doc_lengths), dtype=torch.int32),
                                     torch.tensor(doc_lengths))

    def document_mask(b, h, q_idx, kv_idx):
        same_doc = doc_id[q_idx] == doc_id[kv_idx]
        q_logical = q_idx - offsets[doc_id[q_idx]]
        kv_logical = kv_idx - offsets[doc_id[kv_idx]]
        return same_doc & inner(b, h, q_logical, kv_logical)
    return document_mask


def prefix_lm(prefix_len: int) -> MaskMod:
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)
    return prefix_lm_mask


def dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    def dilated_mask(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        return (diff >= 0) & (diff <= window) & (diff % dilation == 0)
    return dilated_mask


def natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int) -> MaskMod:
    """2-D neighbourhood attention on a row-major canvas; the kernel centre is clamped inside it."""
    def natten_mask(b, h, q_idx, kv_idx):
        q_x, q_y = q_idx // canvas_w, q_idx % canvas_w
        kv_x, kv_y = kv_idx // canvas_w, kv_idx % canvas_w
        centre_x = q_x.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
        centre_y = q_y.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
        return ((centre_x - kv_x).abs() <= kernel_h // 2) & ((centre_y - kv_y).abs() <= kernel_w // 2)
    return natten_mask


def sta_2d(canvas_hw: tuple[int, int], kernel_hw: tuple[int, int], tile_hw: tuple[int, int]) -> MaskMod:
    """Sliding tile attention: tokens in tiles of ``tile_hw``, a window of ``kernel_hw`` in tile units."""
    tiles_w = canvas_hw[1] // tile_hw[1]
    tiles_h = canvas_hw[0] // tile_hw[0]
    k_h, k_w = kernel_hw[0] // tile_hw[0], kernel_hw[1] // tile_hw[1]
    tile_numel = tile_hw[0] * tile_hw[1]

    def sta_mask(b, h, q_idx, kv_idx):
        q_tile, kv_tile = q_idx // tile_numel, kv_idx // tile_numel
        q_th, q_tw = q_tile // tiles_w, q_tile % tiles_w
        kv_th, kv_tw = kv_tile // tiles_w, kv_tile % tiles_w
        centre_h = q_th.clamp(k_h // 2, (tiles_h - 1) - (k_h // 2 + k_h % 2 - 1))
        centre_w = q_tw.clamp(k_w // 2, (tiles_w - 1) - (k_w // 2 + k_w % 2 - 1))
        h_ok = (kv_th >= centre_h - k_h // 2) & (kv_th <= centre_h + k_h // 2 + k_h % 2 - 1)
        w_ok = (kv_tw >= centre_w - k_w // 2) & (kv_tw <= centre_w + k_w // 2 + k_w % 2 - 1)
        return h_ok & w_ok
    return sta_mask


def vsa_topk(seqlen: int, tile: int, topk: int, seed: int = 0) -> MaskMod:
    """Video-sparse-attention-like: each query tile attends to its ``topk`` highest-scoring key tiles
    (random scores), looked up in a bool ``[tiles, tiles]`` table."""
    tiles = -(-seqlen // tile)
    scores = torch.rand(tiles, tiles, generator=torch.Generator().manual_seed(seed))
    selected = torch.zeros(tiles, tiles, dtype=torch.bool)
    selected.scatter_(1, scores.topk(min(topk, tiles), dim=1).indices, True)

    def vsa_mask(b, h, q_idx, kv_idx):
        return selected[q_idx // tile, kv_idx // tile]
    return vsa_mask


def block_causal(block: int) -> MaskMod:
    def block_causal_mask(b, h, q_idx, kv_idx):
        return q_idx // block >= kv_idx // block
    return block_causal_mask


def random_doc_lengths(seqlen: int, mean: int, seed: int = 0) -> list[int]:
    """Document lengths (uniform in [mean / 4, 2 * mean)) filling ``seqlen`` exactly."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < seqlen:
        n = min(int(rng.integers(max(1, mean // 4), 2 * mean)), seqlen - total)
        lengths.append(n)
        total += n
    return lengths


def _canvas(seqlen: int) -> tuple[int, int]:
    """A canvas of ``seqlen`` tokens as square as powers of two allow (width >= height)."""
    w = 1 << ((int(seqlen).bit_length() - 1 + 1) // 2)
    return w, seqlen // w


def _natten_for(seqlen: int) -> MaskMod:
    w, h = _canvas(seqlen)
    return natten(w, h, min(13, w), min(13, h))


def _sta_for(seqlen: int) -> MaskMod:
    w, h = _canvas(seqlen)
    tile = (min(8, h), min(8, w))
    return sta_2d((h, w), (3 * tile[0], 3 * tile[1]), tile)


#: name -> factory of a mask_mod for a sequence length (lengths that are powers of two suit the 2-D ones)
ZOO: dict[str, Callable[[int], MaskMod]] = {
    "causal": lambda n: causal(),
    "sliding_window": lambda n: sliding_window(max(1, n // 32)),
    "document": lambda n: document(random_doc_lengths(n, max(4, n // 40))),
    "prefix_lm": lambda n: prefix_lm(n // 4),
    "dilated_sliding_window": lambda n: dilated_sliding_window(max(1, n // 128), 4),
    # thousands of single-token ranges per row (L / 48): the KV ranges themselves are the cost
    "dilated_sliding_window_wide": lambda n: dilated_sliding_window(max(1, n // 16), 3),
    "natten": _natten_for,
    "sta": _sta_for,
    "vsa_topk": lambda n: vsa_topk(n, 64, 16),
    "block_causal": lambda n: block_causal(max(1, n // 16)),
}
