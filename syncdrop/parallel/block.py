"""The one transformer-block implementation, shared by both executors.

Activations carry an explicit *rank axis*: the residual stream is ``(R, M, h)`` with ``M = B*S``
tokens and ``R = 1`` when every rank holds the same values (after a sync point) or ``R`` = number
of local ranks when ranks differ (inside an SPD block, or after a diverging ablation). Partial
outputs of row-parallel layers are ``(R, M, h)``; ``comm.all_reduce`` sums them over *all* N ranks
and returns ``(1, M, h)``. The simulated executor holds all N ranks (R = N) and sums in-process;
the distributed runtime holds one (R = 1) and calls ``torch.distributed``. The block never knows
which.

Block math: the sync modes own it (:mod:`syncdrop.plan.modes`, one class per mode). The block is
nanoGPT's two residual steps with the sync points made explicit::

    P_r   = Attention_r(norm(X))            bias-free o_proj partials, (R, M, h)
    H     = attn_mode.mlp_input(X, P_r)     X + AllReduce(P_r) + b_o, or X + P_r + b_o when dropped
    Z_r   = MLP_r(norm(H))                  bias-free down partials, (R, M, h)
    X_out = attn_mode.block_output(...)     H + Sync_mlp(Z_r) + b_down; SPD: X + Sync_mlp(P_r + Z_r) + b_o + b_down
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from syncdrop.models.config import ModelConfig
from syncdrop.models.rope import apply_rope
from syncdrop.parallel.comm import Communicator
from syncdrop.parallel.weights import BlockWeights, LocalGeometry
from syncdrop.plan import BlockSync

DENSE = BlockSync()  # both sync points full: the standard block


@dataclass
class ForwardContext:
    """Per-forward constants: batch geometry, the position of the first token (``start`` > 0 when
    extending a KV cache) and RoPE tables ``(S, d)`` for positions ``start..start+S-1`` (None for OPT)."""

    batch: int
    seq: int
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    start: int = 0


@dataclass
class LayerKV:
    """One block's KV cache for the local ranks: ``k``, ``v`` of shape ``(B, R*K, max_len, d)``
    (rank-major KV-head axis, keys after RoPE); positions ``0..start+S-1`` are valid after a step."""

    k: torch.Tensor
    v: torch.Tensor


def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: ModelConfig) -> torch.Tensor:
    """RMSNorm (in fp32, as transformers does) or LayerNorm over the last axis."""
    if cfg.norm == "layer":
        return F.layer_norm(x, (x.shape[-1],), w, b, cfg.norm_eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    return w * xf.to(x.dtype)


def head_norm(q: torch.Tensor, k: torch.Tensor, w: BlockWeights, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Qwen3's per-head RMSNorm of q ``(B, H, S, d)`` and k ``(B, K, S, d)`` over each head's ``d`` features
    (before RoPE), one ``(d,)`` gain for all heads; identity when the model has none. Within a head, so any
    split of the heads over ranks commutes with it, and a zero-padded head stays zero."""
    if w.q_norm_w is None:
        return q, k
    return norm(q, w.q_norm_w, None, cfg), norm(k, w.k_norm_w, None, cfg)  # same shapes


def column_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: int) -> torch.Tensor:
    """Column-parallel ``Y_r = X_r A_r + b_r`` for R ranks, A split along its output dimension.

    ``x``: ``(1 or R, M, h)``; ``w``: ``(h, R*out)``; returns ``(M, R, out)`` (maybe a strided view).
    A replicated input (rank axis 1) costs one dense GEMM against all ranks' columns at once.
    """
    if x.shape[0] == 1:
        y = x[0] @ w  # (M, R*out)
        if b is not None:
            y = y + b
        return y.view(y.shape[0], r, -1)  # (M, R, out)
    out = w.shape[1] // r
    y = torch.bmm(x, w.view(w.shape[0], r, out).transpose(0, 1))  # (R, M, out)
    if b is not None:
        y = y + b.view(r, 1, out)
    return y.transpose(0, 1)  # (M, R, out)


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row-parallel partial ``P_r = X_r A_r`` (A split along its input dimension), no bias, no sum.

    ``x``: ``(M, R, in)``; ``w``: ``(R, in, h)``; returns partials ``(R, M, h)``.
    """
    return torch.bmm(x.transpose(0, 1), w)


def attention_partial(
    xn: torch.Tensor, w: BlockWeights, geo: LocalGeometry, cfg: ModelConfig, ctx: ForwardContext,
    kv: LayerKV | None = None,
) -> torch.Tensor:
    """Causal self-attention of each rank's heads; returns o_proj partials ``(R, M, h)``, bias-free.

    With a cache ``kv`` the new keys/values are written at positions ``start..start+S-1`` and the
    queries attend to everything up to their own position.
    """
    B, S, d, R, Q, K = ctx.batch, ctx.seq, geo.head_dim, geo.r, geo.q, geo.kv
    qkv = column_linear(xn, w.qkv_w, w.qkv_b, R)  # (M, R, (Q+2K)*d)
    q, k, v = qkv.split([Q * d, K * d, K * d], dim=-1)
    q = q.reshape(B, S, R * Q, d).transpose(1, 2)  # (B, R*Q, S, d): rank-major head axis
    k = k.reshape(B, S, R * K, d).transpose(1, 2)  # (B, R*K, S, d)
    v = v.reshape(B, S, R * K, d).transpose(1, 2)
    q, k = head_norm(q, k, w, cfg)  # (B, R*Q, S, d), (B, R*K, S, d): Qwen3's q_norm / k_norm, before RoPE
    if ctx.cos is not None:
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
    mask, causal = None, True
    if kv is not None:
        end = ctx.start + S
        kv.k[:, :, ctx.start : end] = k
        kv.v[:, :, ctx.start : end] = v
        k, v = kv.k[:, :, :end], kv.v[:, :, :end]  # (B, R*K, end, d)
        if ctx.start > 0:  # query i (position start+i) sees keys 0..start+i
            causal = False
            if S > 1:
                pos = torch.arange(end, device=k.device)
                mask = pos[None, :] <= (pos[ctx.start : end, None])  # (S, end)
    gqa = Q != K
    if geo.kv_map is not None:  # irregular q->kv map (uneven split / replicated KV heads)
        k, v, gqa = k.index_select(1, geo.kv_map), v.index_select(1, geo.kv_map), False
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)  # (B, R*Q, S, d)
    o = o.transpose(1, 2).reshape(B * S, R, Q * d)  # (M, R, Q*d)
    return row_linear(o, w.o_w)


def mlp_partial(xn: torch.Tensor, w: BlockWeights, geo: LocalGeometry, cfg: ModelConfig) -> torch.Tensor:
    """Each rank's MLP slice: SwiGLU ``down(silu(gate) * up)`` or ``down(act(up + b))``; ``(R, M, h)``."""
    y = column_linear(xn, w.up_w, w.up_b, geo.r)  # (M, R, G*F)
    if cfg.gated_mlp:
        g, u = y.split([geo.ffn, geo.ffn], dim=-1)
        a = F.silu(g) * u
    else:
        a = ACTIVATIONS[cfg.act](y)
    return row_linear(a, w.down_w)


ACTIVATIONS = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu,
               "gelu_new": lambda t: F.gelu(t, approximate="tanh")}


def block_forward(
    x: torch.Tensor, w: BlockWeights, geo: LocalGeometry, cfg: ModelConfig, comm: Communicator,
    ctx: ForwardContext, sync: BlockSync = DENSE, kv: LayerKV | None = None,
) -> torch.Tensor:
    """One block under its sync modes ``sync`` (:class:`~syncdrop.plan.BlockSync`); ``x``: ``(1 or R, M, h)``
    -> same form (``(R, M, h)`` once ranks diverge). The attention mode decides how the partials are
    combined and reduced (:mod:`syncdrop.plan.modes`)."""
    p = attention_partial(norm(x, w.attn_norm_w, w.attn_norm_b, cfg), w, geo, cfg, ctx, kv)  # (R, M, h): P_r
    h = sync.attn.mlp_input(comm, x, p, w.o_b)  # (1 or R, M, h): the residual the MLP reads
    z = mlp_partial(norm(h, w.mlp_norm_w, w.mlp_norm_b, cfg), w, geo, cfg)  # (R, M, h): Z_r
    return sync.attn.block_output(comm, x, h, p, z, w.o_b, w.down_b, sync.mlp)
