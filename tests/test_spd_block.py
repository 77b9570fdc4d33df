"""A hand-written 2-rank reference of the SPD block of docs/methods.md (and the ablation variants) against the executor.

The reference below loops over ranks and heads explicitly, with its own attention, RoPE and norms,
and is deliberately written without any of syncdrop's block code. It covers a Llama-family block
(RMSNorm, RoPE, GQA, SwiGLU, here with biases) and an OPT block (LayerNorm, biases, ReLU), where the
bias placement matters.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from syncdrop.models.loading import load_dense, resolve_model
from syncdrop.models.rope import inv_frequencies, rope_tables
from syncdrop.parallel.block import ForwardContext, block_forward
from syncdrop.parallel.comm import SimulatedComm
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import BlockSync

# Rank partition for N=2 of a 6-head model: heads 0-2 | 3-5, MLP channels first half | second half.
HEADS = [[0, 1, 2], [3, 4, 5]]


def _norm(x, W, name, cfg):
    if cfg.norm == "layer":
        return F.layer_norm(x, (x.shape[-1],), W[name + ".weight"], W[name + ".bias"], cfg.norm_eps)
    return W[name + ".weight"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)


def _lin(x, W, name, rows=None, cols=None):
    w = W[name + ".weight"]
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    y = x @ w.t()
    b = W.get(name + ".bias")
    if b is not None and cols is None:  # column slice keeps its bias slice; row-parallel bias excluded
        y = y + (b[rows] if rows is not None else b)
    return y


def _rope(x, pos, cfg):
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).double() / d))
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attn_partial(xn, W, cfg, heads):
    """Bias-free o_proj partial of the given heads: sum_h softmax(q_h k_h^T / sqrt(d)) v_h Wo[:, h]^T."""
    B, S, _ = xn.shape
    d, g = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    pos = torch.arange(S)
    mask = torch.full((S, S), float("-inf")).triu(1)
    out = 0
    for h in heads:
        q = _lin(xn, W, "q", rows=slice(h * d, (h + 1) * d))
        k = _lin(xn, W, "k", rows=slice((h // g) * d, (h // g + 1) * d))
        v = _lin(xn, W, "v", rows=slice((h // g) * d, (h // g + 1) * d))
        if cfg.uses_rope:
            q, k = _rope(q, pos, cfg), _rope(k, pos, cfg)
        p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + mask, dim=-1)
        out = out + (p @ v) @ W["o.weight"][:, h * d : (h + 1) * d].t()
    return out


def _mlp_partial(xn, W, cfg, chans):
    if cfg.gated_mlp:
        a = F.silu(_lin(xn, W, "gate", rows=chans)) * _lin(xn, W, "up", rows=chans)
    else:
        a = F.relu(_lin(xn, W, "up", rows=chans))
    return a @ W["down.weight"][:, chans].t()


def reference_block(X, W, cfg, mode) -> list[torch.Tensor]:
    """The SPD block (docs/methods.md) for N=2, one rank at a time. Returns every rank's block output (its own
    residual stream; the same tensor on both ranks except under ``naive``, whose rank r keeps its
    own attention partial: ``X_out_r = X + A_r + b_o + sum_r' Z_r' + b_down``)."""
    N, I = 2, cfg.intermediate_size
    chans = [list(range(0, (I + 1) // 2)), list(range((I + 1) // 2, I))]
    b_o = W.get("o.bias", torch.zeros(X.shape[-1]))
    b_d = W.get("down.bias", torch.zeros(X.shape[-1]))
    P = [_attn_partial(_norm(X, W, "attn_norm", cfg), W, cfg, HEADS[r]) for r in range(N)]
    if mode == "full":
        X1 = X + P[0] + P[1] + b_o
        Z = [_mlp_partial(_norm(X1, W, "mlp_norm", cfg), W, cfg, chans[r]) for r in range(N)]
        return [X1 + Z[0] + Z[1] + b_d] * N
    H = [X + P[r] + b_o for r in range(N)]
    Z = [_mlp_partial(_norm(H[r], W, "mlp_norm", cfg), W, cfg, chans[r]) for r in range(N)]
    if mode == "drop":
        return [X + (P[0] + Z[0]) + (P[1] + Z[1]) + b_o + b_d] * N
    if mode == "naive":
        return [H[r] + Z[0] + Z[1] + b_d for r in range(N)]
    if mode == "desync":
        return [(Z[0] + H[0] / N) + (Z[1] + H[1] / N) + b_d] * N
    if mode == "bias-in-sum":
        return [X + (P[0] + b_o + Z[0] + b_d) + (P[1] + b_o + Z[1] + b_d)] * N
    raise ValueError(mode)


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_opt_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("mode", ["full", "drop", "naive", "desync", "bias-in-sum"])
def test_executor_block_matches_hand_written_two_rank_reference(family, mode, request) -> None:
    """Every rank's block output from the executor equals the hand-written reference's output
    for that rank; under ``naive`` the two ranks' streams really differ (and each is checked)."""
    src = resolve_model(str(request.getfixturevalue(family)))
    cfg = src.config
    assert cfg.num_heads == 6, "the fixture's head count changed; update HEADS"
    dense = load_dense(src)
    W = {k[len("layers.0."):]: v for k, v in dense.items() if k.startswith("layers.0.")}
    model = simulated_model(cfg, dense.__getitem__, 2)
    assert [list(r.q_heads) for r in model.layout.ranks] == HEADS

    B, S = 2, 11
    X = torch.randn(B, S, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cos = sin = None
    if cfg.uses_rope:
        cos, sin = rope_tables(inv_frequencies(cfg), torch.arange(S), torch.float32)
    out = block_forward(X.reshape(1, B * S, -1), model.blocks[0], model.geo, cfg, SimulatedComm(2),
                        ForwardContext(B, S, cos, sin), BlockSync(attn=mode))
    ref = reference_block(X, W, cfg, mode)
    # one stream shared by the ranks (leading dim 1), or one per rank (naive: the streams diverge)
    assert out.shape[0] == 2 if mode == "naive" else out.shape[0] in (1, 2)
    for r in range(2):
        got = out[r if out.shape[0] > 1 else 0].view(B, S, -1)
        assert (got - ref[r]).abs().max().item() < 1e-4, f"rank {r}"
    if mode == "naive":
        assert (ref[0] - ref[1]).abs().max().item() > 1e-2


def test_bias_in_sum_counts_biases_n_times(tiny_opt_dir) -> None:
    """The exact difference between bias-in-sum and SPD at N=2 is one extra copy of b_o + b_down."""
    src = resolve_model(str(tiny_opt_dir))
    cfg, dense = src.config, load_dense(src)
    model = simulated_model(cfg, dense.__getitem__, 2)
    B, S = 1, 7
    X = torch.randn(1, B * S, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    ctx = ForwardContext(B, S, None, None)
    comm = SimulatedComm(2)
    spd = block_forward(X, model.blocks[0], model.geo, cfg, comm, ctx, BlockSync(attn="drop"))
    bis = block_forward(X, model.blocks[0], model.geo, cfg, comm, ctx, BlockSync(attn="bias-in-sum"))
    extra = dense["layers.0.o.bias"] + dense["layers.0.down.bias"]
    assert extra.abs().max() > 1e-3
    assert torch.allclose(bis - spd, extra.expand_as(spd), atol=1e-5)
