"""Architecture description shared by every model family.

One dataclass describes Llama-family (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2) and OPT decoders.
The block math in :mod:`syncdrop.parallel.block` reads only these fields; loaders fill them from a
``config.json`` or from GGUF metadata.

Canonical weight names (what loaders produce and sharding consumes), PyTorch ``nn.Linear``
layout ``(out_features, in_features)``::

    embed                (V, h)          token embedding
    pos_embed            (P, h)          learned positions (OPT only)
    layers.{i}.attn_norm.weight/.bias    (h,)  pre-attention norm (bias only for LayerNorm)
    layers.{i}.q/k/v.weight  (H*d, h) / (Hkv*d, h),  .bias optional
    layers.{i}.q_norm.weight (d,)        per-head RMSNorm gain on q, shared by every head (Qwen3 only)
    layers.{i}.k_norm.weight (d,)        the same on k
    layers.{i}.o.weight      (h, H*d),  .bias optional
    layers.{i}.mlp_norm.weight/.bias     (h,)
    layers.{i}.gate.weight   (I, h)      gated MLPs only (SwiGLU)
    layers.{i}.up.weight     (I, h),  .bias optional   (OPT fc1)
    layers.{i}.down.weight   (h, I),  .bias optional   (OPT fc2)
    final_norm.weight/.bias  (h,)
    lm_head                  (V, h)      absent when tied to ``embed``
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("llama", "opt")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a pre-norm decoder-only transformer.

    ``family`` selects the block variant: ``llama`` = RMSNorm, RoPE, gated MLP; ``opt`` =
    LayerNorm, learned positions (offset ``pos_offset``), plain MLP, biases everywhere.
    ``qk_norm``: an RMSNorm over each head's ``d`` features of q and k, after the projection and before
    RoPE (Qwen3's ``q_norm`` / ``k_norm``); it acts within a head, so sharding and SPD are unchanged.
    """

    family: str
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_positions: int = 2048
    pos_offset: int = 0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.qk_norm and self.family != "llama":
            raise ValueError("qk_norm (per-head RMSNorm on q and k) needs the llama family (RMSNorm)")

    @property
    def norm(self) -> str:
        return "rms" if self.family == "llama" else "layer"

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    @property
    def uses_rope(self) -> bool:
        return self.family == "llama"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def layer_names(i: int, cfg: ModelConfig) -> list[str]:
    """Canonical names of every tensor of block ``i`` that ``cfg`` says exists."""
    p = f"layers.{i}."
    names = [p + "attn_norm.weight", p + "mlp_norm.weight"]
    if cfg.norm == "layer":
        names += [p + "attn_norm.bias", p + "mlp_norm.bias"]
    for proj in ("q", "k", "v"):
        names.append(p + f"{proj}.weight")
        if cfg.qkv_bias:
            names.append(p + f"{proj}.bias")
    if cfg.qk_norm:
        names += [p + "q_norm.weight", p + "k_norm.weight"]
    names.append(p + "o.weight")
    if cfg.o_bias:
        names.append(p + "o.bias")
    if cfg.gated_mlp:
        names.append(p + "gate.weight")
    names += [p + "up.weight", p + "down.weight"]
    if cfg.mlp_bias:
        names += [p + "up.bias", p + "down.bias"]
        if cfg.gated_mlp:
            names.append(p + "gate.bias")
    return names


def model_names(cfg: ModelConfig) -> list[str]:
    """Canonical names of every tensor of the model."""
    names = ["embed", "final_norm.weight"]
    if cfg.norm == "layer":
        names.append("final_norm.bias")
    if cfg.family == "opt":
        names.append("pos_embed")
    if not cfg.tie_embeddings:
        names.append("lm_head")
    for i in range(cfg.num_layers):
        names += layer_names(i, cfg)
    return names
