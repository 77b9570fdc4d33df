"""The one transformer-block implementation, shared by both executors.

Activations carry an explicit *rank axis*: the residual stream is ``(R, M, h)`` with ``M = B*S``
tokens and ``R = 1`` when every rank holds the same values (after a sync point) or ``R`` = number
of local ranks when ranks differ (inside an SPD block, or after a diverging ablation). Partial
outputs of row-parallel layers are ``(R, M, h)``; ``comm.all_reduce`` sums them over *all* N ranks
and returns ``(1, M, h)``. The simulated executor holds all N ranks (R = N) and sums in-process;
the distributed runtime holds one (R = 1) and calls ``torch.distributed``. The block never knows
which.

Block math (docs/methods.md, SPD block; P_r = bias-free o_proj partial of rank r, Z_r = bias-free MLP partial):

``full``:  X' = X + AllReduce(P_r) + b_o;  X_out = X' + AllReduce(MLP_r(norm(X'))) + b_down
``drop``:  H_r = X + P_r + b_o;  Z_r = MLP_r(norm(H_r));  X_out = X + AllReduce(P_r + Z_r) + b_o + b_down
and the ablations ``naive``, ``desync``, ``bias-in-sum`` documented in :mod:`syncdrop.plan`.
A sync point may instead be a partial channel reduce (:meth:`Communicator.partial_reduce
<syncdrop.parallel.comm.Communicator.partial_reduce>`, CAAT-Net): then
``AllReduce(Y_r) + b`` is replaced by ``PartialReduce_k(Y_r, b)`` and the residual keeps a rank
axis of length R from there on (shared channels equal on every rank, private ones not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from syncdrop.models.config import ModelConfig
from syncdrop.models.rope import apply_rope
from syncdrop.parallel.comm import Communicator
from syncdrop.parallel.weights import BlockWeights, LocalGeometry


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


def _add(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x if b is None else x + b


def _sync(comm: Communicator, y: torch.Tensor, mode, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x + Sync(y) + b`` for a sync point in ``mode`` (``"full"`` or a ``Partial``)."""
    if mode == "full":
        return _add(x + comm.all_reduce(y), b)
    return x + comm.partial_reduce(y, mode.channels(y.shape[-1]), b, mode.scale, mode.mask)


def block_forward(
    x: torch.Tensor, w: BlockWeights, geo: LocalGeometry, cfg: ModelConfig, comm: Communicator,
    ctx: ForwardContext, attn_mode="full", kv: LayerKV | None = None, mlp_mode="full",
) -> torch.Tensor:
    """One block under the given sync modes; ``x``: ``(1 or R, M, h)`` -> same form (``(R, M, h)``
    after a partial sync or a diverging ablation). ``attn_mode``: ``full``, a drop variant, or a
    :class:`~syncdrop.plan.Partial`; ``mlp_mode``: ``full`` or a ``Partial``."""
    p = attention_partial(norm(x, w.attn_norm_w, w.attn_norm_b, cfg), w, geo, cfg, ctx, kv)  # (R, M, h)
    if not isinstance(attn_mode, str) or attn_mode == "full":
        x1 = _sync(comm, p, attn_mode, w.o_b, x)
        z = mlp_partial(norm(x1, w.mlp_norm_w, w.mlp_norm_b, cfg), w, geo, cfg)
        return _sync(comm, z, mlp_mode, w.down_b, x1)
    h = _add(x + p, w.o_b)  # (R, M, h): each rank's MLP sees only its own heads
    z = mlp_partial(norm(h, w.mlp_norm_w, w.mlp_norm_b, cfg), w, geo, cfg)
    if attn_mode == "drop" and mlp_mode != "full":
        b = w.o_b if w.down_b is None else (w.down_b if w.o_b is None else w.o_b + w.down_b)
        return _sync(comm, p + z, mlp_mode, b, x)
    if mlp_mode != "full":
        raise ValueError(f"a partial MLP sync does not combine with attention mode {attn_mode!r}")
    if attn_mode == "drop":
        return _add(_add(x + comm.all_reduce(p + z), w.o_b), w.down_b)
    if attn_mode == "naive":
        return _add(h + comm.all_reduce(z), w.down_b)
    if attn_mode == "desync":
        return _add(comm.all_reduce(z + h / comm.tp), w.down_b)
    if attn_mode == "bias-in-sum":
        return x + comm.all_reduce(_add(_add(p, w.o_b) + z, w.down_b))
    raise ValueError(f"unknown attention sync mode {attn_mode!r}")
