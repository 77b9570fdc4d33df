"""Compute of one forward on the slowest rank: FLOPs, bytes read, and the time they take.

FLOPs of the *slowest* rank (a multiply-add = 2 FLOPs; ``q, kv`` = that rank's query and KV heads,
``d`` = head dim, ``B`` sequences; ``P_layer`` = its weights per block, :mod:`.arch`)::

    prefill of S tokens:
      matmuls   = 2 * L * P_layer * B * S
      attention = 4 * L * q * d * B * S (S + 1) / 2     (QK^T and AV, causal: S(S+1)/2 pairs)
      LM head   = 2 * h * V * B                         (last position only: that is what TTFT
                                                          needs; divided by N if vocab-parallel)
    decode step at context c (keys incl. the new token):
      matmuls   = 2 * L * P_layer * B,  attention = 4 * L * q * d * B * c,  LM head = 2 * h * V * B

Each block counts its own slowest rank (head-grouping layouts may differ per block). Norms, RoPE,
activations, softmax, embedding lookups and sampling are not counted (they are O(S h), not
O(S h^2)); the per-layer overhead term absorbs them. The time is a roofline plus a fixed per-layer
overhead::

    T_compute = max(FLOPs / F_eff, bytes_read / HBM_eff) + L * t_layer

``F_eff`` = effective FLOP/s of one rank (peak x MFU on a GPU, fitted on a CPU); ``bytes_read`` =
that rank's weights (+ KV cache in decode) read once per forward; the memory term is used only
when ``HBM_eff`` is given (cluster predictions), the calibrated CPU model uses ``F_eff`` and
``t_layer`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncdrop.bench.cost.arch import block_shares, layer_weights
from syncdrop.models.config import ModelConfig


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes read by the slowest rank for one forward."""

    matmul_flops: float
    attn_flops: float
    head_flops: float
    bytes_read: float
    layers: int

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attn_flops + self.head_flops


def prefill_work(cfg: ModelConfig, n_ranks: int, seq: int, batch: int = 1, dtype_bytes: int = 4,
                 lm_head_parallel: bool = False, block_layouts: dict | None = None) -> Work:
    """The prefill of ``batch`` prompts of ``seq`` tokens plus the LM head on the last position; each
    block's work is its slowest rank's (:func:`~syncdrop.bench.cost.arch.block_shares`)."""
    shares = block_shares(cfg, n_ranks, block_layouts)
    L, h, d, V = cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    w = sum(layer_weights(cfg, sh) for sh in shares)
    q = sum(sh.q_heads for sh in shares)
    head = 2 * h * V * batch / (n_ranks if lm_head_parallel else 1)
    head_w = h * V / (n_ranks if lm_head_parallel else 1)
    return Work(matmul_flops=2.0 * w * batch * seq, attn_flops=4.0 * q * d * batch * seq * (seq + 1) / 2,
                head_flops=head, bytes_read=(w + head_w) * dtype_bytes, layers=L)


def decode_work(cfg: ModelConfig, n_ranks: int, context: int, batch: int = 1, dtype_bytes: int = 4,
                lm_head_parallel: bool = False, block_layouts: dict | None = None) -> Work:
    """One decode step whose new token attends to ``context`` keys (itself included)."""
    shares = block_shares(cfg, n_ranks, block_layouts)
    L, h, d, V = cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    w = sum(layer_weights(cfg, sh) for sh in shares)
    q, kv = sum(sh.q_heads for sh in shares), sum(sh.kv_heads for sh in shares)
    head_w = h * V / (n_ranks if lm_head_parallel else 1)
    kv_bytes = 2 * kv * d * context * batch * dtype_bytes
    return Work(matmul_flops=2.0 * w * batch, attn_flops=4.0 * q * d * batch * context,
                head_flops=2 * head_w * batch, bytes_read=(w + head_w) * dtype_bytes + kv_bytes, layers=L)


@dataclass(frozen=True)
class ComputeModel:
    """``max(FLOPs / flops_per_s, bytes / mem_bw) + layers * layer_overhead_s`` for one rank."""

    flops_per_s: float
    layer_overhead_s: float = 0.0
    mem_bw: float | None = None

    def time(self, work: Work) -> float:
        t = work.flops / self.flops_per_s
        if self.mem_bw:
            t = max(t, work.bytes_read / self.mem_bw)
        return t + work.layers * self.layer_overhead_s
