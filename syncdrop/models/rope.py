"""Rotary position embeddings (RoPE), in the Hugging Face ``rotate_half`` convention.

For head dim d and position p: ``cos[p, j] = cos(p * inv_freq[j mod d/2])`` (same for sin) and
``rope(x) = x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``.
Supported scalings (:data:`SCALINGS`): none (``default``), ``linear`` and ``llama3`` (Llama 3.1-3.3), each
computed as transformers' ``ROPE_INIT_FUNCTIONS`` does. Others (``dynamic``, ``yarn``, Phi-3's ``longrope`` /
``su``, whose frequencies switch with the sequence length and which also scale cos/sin) are refused when the
checkpoint is read (:func:`check_scaling`).
"""

from __future__ import annotations

import math

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig

SCALINGS = ("default", "linear", "llama3")
_KEYS = {"default": (), "linear": ("factor",),
         "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def scaling_kind(scaling: dict | None) -> str:
    """The rope type of a ``rope_scaling`` / ``rope_parameters`` dict (``rope_type``, or the older ``type``)."""
    sc = scaling or {}
    return str(sc.get("rope_type", sc.get("type", "default")))


def check_scaling(scaling: dict | None) -> str:
    """The type of ``scaling``; :class:`SyncdropError` (one line naming it) unless it is one of :data:`SCALINGS`,
    which :func:`inv_frequencies` computes exactly."""
    kind = scaling_kind(scaling)
    if kind not in SCALINGS:
        why = (" (Phi-3's long-context RoPE: short or long factors chosen by the sequence length, cos/sin scaled)"
               if kind in ("longrope", "su", "yarn") and "short_factor" in (scaling or {}) else "")
        raise SyncdropError(f"unsupported rope scaling {kind!r}{why}: syncdrop supports {', '.join(SCALINGS)}")
    return kind


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """``inv_freq[j] = theta^(-2j/d)``, adjusted by ``cfg.rope_scaling``; shape ``(d/2,)``, fp32."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = check_scaling(sc)
    missing = [k for k in _KEYS[kind] if sc.get(k) is None]
    if missing:
        raise SyncdropError(f"rope scaling {kind!r} lacks {', '.join(missing)}")
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
