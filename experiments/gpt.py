"""A small GPT for packed variable-length batches whose attention runs as a dcp plan.

Pre-norm decoder blocks: RMSNorm -> GQA attention with rotary position embeddings (RoPE, from each
token's position within its own sequence) -> residual; RMSNorm -> SwiGLU (or GELU) MLP -> residual.
Every layer except attention is token-wise, so on each rank the model runs on that rank's home tokens
only; ``DCPAttention`` moves what attention needs between ranks.

Shapes (n = this rank's home tokens): ``tokens``/``positions`` int64 ``[n]`` -> ``logits [n, vocab]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dcp.integration import DCPAttention


@dataclass(frozen=True)
class GPTConfig:
    """Model size. ``heads`` query heads, ``kv_heads`` key/value heads (GQA: ``heads % kv_heads == 0``)."""

    vocab_size: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp: str = "swiglu"  # "swiglu" | "gelu"
    mlp_hidden: int | None = None  # None: 8/3 * dim (SwiGLU, rounded to 8) or 4 * dim (GELU)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self):
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"dim={self.dim} must split into {self.heads} heads of even size")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        return 4 * self.dim if self.mlp == "gelu" else (8 * self.dim // 3 + 7) // 8 * 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # [n, dim]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """``cos, sin`` ``[n, 1, head_dim / 2]`` for int64 ``positions [n]``."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of ``x [n, H, D]`` by the angles of ``cos``/``sin`` ``[n, 1, D/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, attn: DCPAttention):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        self.wq = nn.Linear(d, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, d, bias=False)
        self.attn = attn

    def forward(self, x, cos, sin, plan):  # x [n, dim]
        n, hd = x.shape[0], self.cfg.head_dim
        q = apply_rope(self.wq(x).view(n, self.cfg.heads, hd), cos, sin)
        k = apply_rope(self.wk(x).view(n, self.cfg.kv_heads, hd), cos, sin)
        v = self.wv(x).view(n, self.cfg.kv_heads, hd)
        o = self.attn(q.contiguous(), k.contiguous(), v.contiguous(), plan)  # [n, heads, hd]
        return self.wo(o.reshape(n, self.cfg.heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.kind = cfg.mlp
        h = cfg.hidden
        self.up = nn.Linear(cfg.dim, 2 * h if cfg.mlp == "swiglu" else h, bias=False)
        self.down = nn.Linear(h, cfg.dim, bias=False)

    def forward(self, x):
        if self.kind == "swiglu":
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn: DCPAttention):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, attn)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, plan):
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """``logits [n, vocab] = GPT(cfg, attention)(tokens [n], positions [n], plan)``."""

    def __init__(self, cfg: GPTConfig, attention: DCPAttention | None = None):
        super().__init__()
        self.cfg = cfg
        attention = attention if attention is not None else DCPAttention()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg, attention) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = 1.0 / math.sqrt(2 * self.cfg.layers) if name.endswith(("wo.weight", "down.weight")) else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, plan) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, plan)
        return self.head(self.norm(x))


__all__ = ["GPT", "GPTConfig", "RMSNorm", "rope_tables", "apply_rope"]
