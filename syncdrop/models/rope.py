"""Rotary position embeddings (RoPE), in the Hugging Face ``rotate_half`` convention.

For head dim d and position p: ``cos[p, j] = cos(p * inv_freq[j mod d/2])`` (same for sin) and
``rope(x) = x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``.
Supported scalings: none (``default``), ``linear`` and ``llama3``.
"""

from __future__ import annotations

import math

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """``inv_freq[j] = theta^(-2j/d)``, adjusted by ``cfg.rope_scaling``; shape ``(d/2,)``, fp32."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    else:
        raise SyncdropError(f"unsupported rope scaling {kind!r}: syncdrop supports default, linear, llama3")
    return inv.float()


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``cos, sin`` of shape ``(S, d)`` for integer ``positions`` of shape ``(S,)``."""
    ang = positions.float()[:, None] * inv_freq[None, :]  # (S, d/2)
    emb = torch.cat([ang, ang], dim=-1)  # (S, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, S, d)`` by tables of shape ``(S, d)``."""
    return x * cos + _rotate_half(x) * sin
