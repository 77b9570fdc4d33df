"""Partial channel reduce (CAAT-Net, docs/methods.md) at inference: plans, the block, the executors.

The reference here is written from the CAAT-Net paper's description alone (arXiv:2506.19645,
docs/methods.md): a Python loop over ranks, each rank with
its own residual stream, its own slice of the dense weights (transformers' rotary helpers for
RoPE), the partial reduce spelled out, and a vocab-parallel LM head.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from syncdrop.errors import SyncdropError
from syncdrop.models.loading import load_dense, resolve_model
from syncdrop.parallel.executor import simulated_model, vocab_slices
from syncdrop.parallel.launch import launch
from syncdrop.parallel.sharding import ShardLayout
from syncdrop.plan import BlockSync, Partial, SyncPlan, parse_plan

WORKER = str(Path(__file__).parent / "workers" / "dist_logits.py")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(cfg, W: dict[str, torch.Tensor], tp: int, ids: torch.Tensor, attn_p: float,
                     mlp_p: float, scale: bool = True) -> torch.Tensor:
    """Llama-family forward with every sync point a partial reduce, one rank at a time."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layout = ShardLayout.build(cfg, tp)
    B, S = ids.shape
    h, d, G = cfg.hidden_size, cfg.head_dim, cfg.group_size
    pos = torch.arange(S, dtype=torch.float32)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, -1)
    cos, sin = ang.cos()[None], ang.sin()[None]  # (1, S, d)

    def reduce(ys: list[torch.Tensor], p: float) -> list[torch.Tensor]:
        k = round(p * h)
        shared = sum(y[..., :k] for y in ys)
        f = math.sqrt(tp) if scale else 1.0
        return [torch.cat([shared, f * y[..., k:]], -1) for y in ys]

    xs = [W["embed"][ids] for _ in range(tp)]  # per-rank residual (B, S, h)
    for i in range(cfg.num_layers):
        P = f"layers.{i}."
        ys = []
        for r, rs in enumerate(layout.ranks):
            xn = _rms(xs[r], W[P + "attn_norm.weight"], cfg.norm_eps)
            outs = []
            for qh in rs.q_heads:
                kvh = qh // G
                q = (xn @ W[P + "q.weight"][qh * d:(qh + 1) * d].t())[:, None]  # (B, 1, S, d)
                k = (xn @ W[P + "k.weight"][kvh * d:(kvh + 1) * d].t())[:, None]
                v = (xn @ W[P + "v.weight"][kvh * d:(kvh + 1) * d].t())[:, None]
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]  # (B, S, d)
                outs.append(o @ W[P + "o.weight"][:, qh * d:(qh + 1) * d].t())
            ys.append(sum(outs))
        xs = [x + a for x, a in zip(xs, reduce(ys, attn_p), strict=True)]
        ys = []
        for r, rs in enumerate(layout.ranks):
            xn = _rms(xs[r], W[P + "mlp_norm.weight"], cfg.norm_eps)
            c = list(rs.ffn)
            a = F.silu(xn @ W[P + "gate.weight"][c].t()) * (xn @ W[P + "up.weight"][c].t())
            ys.append(a @ W[P + "down.weight"][:, c].t())
        xs = [x + z for x, z in zip(xs, reduce(ys, mlp_p), strict=True)]
    head = W["embed"] if cfg.tie_embeddings else W["lm_head"]
    sl = vocab_slices(cfg.vocab_size, tp)
    return torch.cat([_rms(xs[r], W["final_norm.weight"], cfg.norm_eps) @ head[sl[r]].t() for r in range(tp)], -1)


@pytest.mark.parametrize("tp,attn_p,mlp_p,scale", [(2, 0.5, 0.5, True), (3, 0.25, 0.75, True), (3, 0.0, 0.0, True),
                                                   (2, 1.0, 0.5, True), (3, 0.5, 0.5, False)])
def test_simulated_partial_matches_per_rank_reference(tiny_llama_dir, tp, attn_p, mlp_p, scale) -> None:
    src = resolve_model(str(tiny_llama_dir))
    cfg = src.config
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(tp))
    plan = SyncPlan([BlockSync(Partial(attn_p, scale), Partial(mlp_p, scale))] * cfg.num_layers)
    got = simulated_model(cfg, src.reader, tp, plan)(ids)
    ref = reference_logits(cfg, load_dense(src), tp, ids, attn_p, mlp_p, scale)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_opt_dir"])
def test_partial_one_is_ordinary_tp_and_tp1_is_dense(fixture, request) -> None:
    """p = 1 is plain tensor parallelism (vocab-parallel head included); at N = 1 any p is dense."""
    src = resolve_model(str(request.getfixturevalue(fixture)))
    cfg = src.config
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    dense = simulated_model(cfg, src.reader, 1)(ids)
    for tp, p in [(3, 1.0), (1, 0.3)]:
        m = simulated_model(cfg, src.reader, tp, SyncPlan.partial(cfg.num_layers, p))
        torch.testing.assert_close(m(ids), dense, atol=1e-5, rtol=0)
    m = simulated_model(cfg, src.reader, 3, SyncPlan.partial(cfg.num_layers, 0.5))
    assert (m(ids) - dense).abs().max() > 1e-3


@pytest.mark.parametrize("mask", ["random", "topk"])
def test_channel_mask_ablations(tiny_qwen2_dir, mask) -> None:
    """With p = 1 every channel is shared whatever the mask: ordinary TP. With p = 0.5 the mask
    matters (differs from fixed channels)."""
    src = resolve_model(str(tiny_qwen2_dir))
    cfg = src.config
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    dense = simulated_model(cfg, src.reader, 3)(ids)
    full = simulated_model(cfg, src.reader, 3, SyncPlan.partial(cfg.num_layers, 1.0, mask=mask))(ids)
    torch.testing.assert_close(full, dense, atol=1e-5, rtol=0)
    fixed = simulated_model(cfg, src.reader, 3, SyncPlan.partial(cfg.num_layers, 0.5))(ids)
    other = simulated_model(cfg, src.reader, 3, SyncPlan.partial(cfg.num_layers, 0.5, mask=mask))(ids)
    assert (fixed - other).abs().max() > 1e-3


def test_spd_drop_with_partial_mlp(tiny_opt_dir) -> None:
    """attn drop + mlp partial: with p = 1 it is exactly the SPD block (biases once)."""
    src = resolve_model(str(tiny_opt_dir))
    cfg = src.config
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    spd = simulated_model(cfg, src.reader, 3, SyncPlan.uniform(cfg.num_layers, "drop"))(ids)
    mixed = SyncPlan([BlockSync("drop", Partial(1.0))] * cfg.num_layers)
    torch.testing.assert_close(simulated_model(cfg, src.reader, 3, mixed)(ids), spd, atol=1e-5, rtol=0)


def test_partial_plans_parse_and_round_trip(tmp_path) -> None:
    plan = parse_plan("partial:0.25", 4)
    assert plan.has_partial and plan.dropped == [] and plan.payload_fraction(576)[0] == 144 / 576
    mixed = SyncPlan([BlockSync("drop", Partial(0.5)), BlockSync(), BlockSync(Partial(0.0), "full"),
                      BlockSync("full", Partial(1.0))])
    mixed.save(tmp_path / "p.json")
    back = parse_plan(str(tmp_path / "p.json"), 4)
    assert back.blocks == mixed.blocks and back.dropped == [0]
    assert "partial" in back.summary() and "dropped" in back.summary()
    for spec, msg in [("partial:1.5", "between 0 and 1"), ("partial:x", "malformed")]:
        with pytest.raises(SyncdropError, match=msg):
            parse_plan(spec, 4)
    bad = {"blocks": [{"attn": "naive", "mlp": {"partial": 0.5}}]}
    with pytest.raises(SyncdropError, match="MLP sync point in mode partial:0.5 combines with attn full, drop, "
                                            "partial, not naive"):
        SyncPlan.from_dict(bad)
    with pytest.raises(SyncdropError, match=r"\[0, 1\]"):
        SyncPlan.from_dict({"blocks": [{"attn": {"partial": 2}}]})


@pytest.mark.parametrize("tp", [2, 3])
def test_distributed_partial_equals_simulated(tiny_llama_dir, tmp_path, tp) -> None:
    """gloo, one process per rank: per-rank residual streams, the shared-channel all-reduce and the
    vocab-parallel head (logits all-gathered) give the simulated executor's logits; random masks
    agree because both draw them from the communicator's generator in the same order (only the
    random plan draws, once per sync point)."""
    mixed = SyncPlan([BlockSync("drop", Partial(0.5)), BlockSync(Partial(0.25), "full")])
    mixed.save(tmp_path / "mixed.json")
    SyncPlan.partial(2, 0.5, mask="random").save(tmp_path / "random.json")
    SyncPlan.partial(2, 0.5, mask="topk").save(tmp_path / "topk.json")
    plans = ["partial:0.5", "partial:0", str(tmp_path / "mixed.json"), str(tmp_path / "random.json"),
             str(tmp_path / "topk.json")]
    out = tmp_path / "logits.safetensors"
    assert launch([str(tiny_llama_dir), str(tp), ",".join(plans), "", str(out)], tp, program=[WORKER]) == 0
    got = load_file(str(out))
    src = resolve_model(str(tiny_llama_dir))
    sim = simulated_model(src.config, src.reader, tp)
    ids = torch.randint(0, src.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    for spec in plans:
        sim.plan = parse_plan(spec, src.config.num_layers)
        assert (got[f"exact/{spec}"] - sim(ids)).abs().max() <= 1e-5, spec
