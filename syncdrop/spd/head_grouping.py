"""Head-grouping initialisation (HG) for one SPD block (docs/methods.md, head grouping).

Once a block's attention sync is dropped, rank r's MLP reads ``H_r = X + P_r (+ b_o)``, where
``P_r`` sums only the heads rank r owns. Which heads share a rank, and which MLP channels sit
with them, then matters. HG picks both, as a per-block :class:`ShardLayout` (``head_order``,
``ffn_order``): the dense weights are untouched and sharding reads q/k/v rows, o_proj columns,
gate/up rows and down columns in the new order, so with all syncs kept the block computes the
same function (an exact re-parameterisation; tested).

1. Head scattering. Per query head a, the attention-score map ``A_a = softmax(q_a k_a^T / sqrt(d))``
   (causal) on calibration windows; ``D[a, b] = ||A_a - A_b||_F`` (Euclidean distance of the maps,
   summed in squares over windows). Heads are assigned so that the total within-rank distance
   ``sum_r sum_{a<b on r} D[a, b]`` is largest. ``unit="group"`` moves whole KV groups (a query
   head stays with its KV head, no extra KV work; exhaustive over group orders when there are at
   most 8 groups); ``unit="head"`` scatters single query heads, the KV heads they read being
   replicated on every rank that needs them (more K/V compute per rank; best-improvement swaps
   from several seeded starts).
2. MLP matching, given the head assignment. ``mlp="shard"``: the N contiguous MLP shards are
   paired with the ranks' head groups by the permutation maximising ``sum_r ||MLP_s(norm(H_r))||``
   (exhaustive for N <= 8). ``mlp="channel"``: each intermediate channel c goes to a rank, with
   the ranks' channel counts fixed, by the score ``sum_tokens |act_c(norm(H_r))| * ||down[:, c]||``
   (its output magnitude on rank r's input), greedily by regret. ``mlp="none"`` keeps the
   default channel split.

Per-head quantities reuse the block code: a layout with one head per rank (TP = number of heads)
gives every head's o_proj partial ``P_a`` from :func:`attention_partial` directly.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from syncdrop.models.config import ModelConfig
from syncdrop.models.rope import apply_rope
from syncdrop.parallel.block import ForwardContext, attention_partial, column_linear, head_norm, mlp_partial, norm
from syncdrop.parallel.sharding import ShardLayout, _even_split
from syncdrop.parallel.weights import TensorSource, block_weights, local_geometry
from syncdrop.spd import HG_MLP as MLP_MATCHING
from syncdrop.spd import HG_UNITS as UNITS


@dataclass
class Grouping:
    head_order: list[int]
    ffn_order: list[int]
    report: dict[str, Any]


def _within_rank(D: torch.Tensor, order: list[int], sizes: list[int]) -> float:
    total, start = 0.0, 0
    for n in sizes:
        idx = order[start : start + n]
        start += n
        total += float(D[idx][:, idx].sum()) / 2
    return total


def _best_order(D: torch.Tensor, units: list[tuple[int, ...]], sizes: list[int], seed: int) -> list[int]:
    """Order of ``units`` (concatenated into a head order) maximising the within-rank distance."""

    def flat(perm: list[int]) -> list[int]:
        return [h for u in perm for h in units[u]]

    n = len(units)
    if n <= 8:
        best = max(itertools.permutations(range(n)), key=lambda p: _within_rank(D, flat(list(p)), sizes))
        return flat(list(best))
    rng = random.Random(seed)
    starts = [list(range(n))] + [rng.sample(range(n), n) for _ in range(7)]
    best_perm, best_val = starts[0], -math.inf
    for perm in starts:
        val = _within_rank(D, flat(perm), sizes)
        improved = True
        while improved:
            improved = False
            for a, b in itertools.combinations(range(n), 2):
                perm[a], perm[b] = perm[b], perm[a]
                v = _within_rank(D, flat(perm), sizes)
                if v > val + 1e-9:
                    val, improved = v, True
                else:
                    perm[a], perm[b] = perm[b], perm[a]
        if val > best_val:
            best_perm, best_val = list(perm), val
    return flat(best_perm)


def _score_maps_distance(
    xn: torch.Tensor, w, geo, cfg: ModelConfig, ctx: ForwardContext,
) -> torch.Tensor:
    """``sum over windows ||A_a - A_b||_F^2`` for every pair of query heads, ``(H, H)``."""
    B, S, d, H, K = ctx.batch, ctx.seq, geo.head_dim, geo.r, geo.kv
    dev = xn.device
    qkv = column_linear(xn, w.qkv_w, w.qkv_b, H)  # (M, H, (1 + 2K) * d): one q head per "rank"
    q, k, _ = qkv.split([d, K * d, K * d], dim=-1)
    heads = torch.arange(H, device=dev)
    kv_of_q = geo.kv_map.view(H) - heads * K if geo.kv_map is not None else torch.zeros(H, dtype=torch.long, device=dev)
    k = k.reshape(B * S, H, K, d)[:, heads, kv_of_q]  # (M, H, d): the KV head each q head reads
    q = q.reshape(B, S, H, d).transpose(1, 2)  # (B, H, S, d)
    k = k.reshape(B, S, H, d).transpose(1, 2)
    q, k = head_norm(q, k, w, cfg)  # (B, H, S, d) each: q/k norms (Qwen3) before RoPE, as attention_partial
    if ctx.cos is not None:
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5  # (B, H, S, S)
    causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    maps = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    flat = maps.transpose(0, 1).reshape(H, -1).double()  # (H, B*S*S)
    sq = (flat * flat).sum(1)
    return (sq[:, None] + sq[None, :] - 2 * flat @ flat.t()).clamp_min(0)


def group_heads(
    params: dict[str, torch.Tensor], layer: int, cfg: ModelConfig, tp: int,
    batches: list[tuple[torch.Tensor, ForwardContext]], unit: str = "group", mlp: str = "shard", seed: int = 0,
) -> Grouping:
    """HG layout for block ``layer`` from its dense weights ``params`` (canonical names) and the
    residuals entering it, ``batches`` of ``(x (1, B*S, h), ctx)``.

    Runs on the residuals' device (``params`` are moved there); the combinatorial searches run on
    the host over the small accumulated matrices (``(H, H)`` distances, ``(N, N)`` MLP norms,
    ``(N, F)`` channel scores), each copied back once."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    if mlp not in MLP_MATCHING:
        raise ValueError(f"mlp must be one of {MLP_MATCHING}, got {mlp!r}")
    H, G = cfg.num_heads, cfg.group_size
    dev = batches[0][0].device
    params = {k: v.detach().to(dev) for k, v in params.items()}
    batches = [(x.float(), ctx) for x, ctx in batches]  # the statistics in float32, whatever the model dtype
    per_head = ShardLayout.build(cfg, H)  # one query head per "rank"
    geo_h = local_geometry(cfg, per_head, range(H), dev)
    src = TensorSource(params)
    w_h = block_weights(src, cfg, geo_h, per_head, layer)
    p = f"layers.{layer}."
    D2 = torch.zeros(H, H, dtype=torch.float64, device=dev)
    with torch.no_grad():
        xs = [(x, norm(x, w_h.attn_norm_w, w_h.attn_norm_b, cfg), ctx) for x, ctx in batches]
        for _, xn, ctx in xs:
            D2 += _score_maps_distance(xn, w_h, geo_h, cfg, ctx)
    D = D2.sqrt().cpu()  # (H, H): the order search reads it entry by entry
    sizes = [len(r) for r in _even_split(H, tp)]
    units = ([tuple(range(g * G, (g + 1) * G)) for g in range(cfg.num_kv_heads)] if unit == "group"
             else [(a,) for a in range(H)])
    head_order = _best_order(D, units, sizes, seed)
    default = list(range(H))
    report: dict[str, Any] = {
        "unit": unit, "mlp": mlp,
        "head_distance_within_ranks": {"default": _within_rank(D, default, sizes),
                                       "grouped": _within_rank(D, head_order, sizes)},
    }
    # each rank's local MLP input under the new head assignment
    layout = ShardLayout.build(cfg, tp, head_order)
    report["kv_heads_per_rank"] = {"default": ShardLayout.build(cfg, tp).max_kv, "grouped": layout.max_kv}
    F_ = cfg.intermediate_size
    shards = [list(r) for r in _even_split(F_, tp)]
    with torch.no_grad():
        local_inputs = []  # per batch: (tp, M, h) normed H_r
        for x, xn, ctx in xs:
            P = attention_partial(xn, w_h, geo_h, cfg, ctx)  # (H, M, h): every head's o_proj partial
            Hr = torch.stack([x[0] + P[list(r.q_heads)].sum(0) for r in layout.ranks])  # (tp, M, h)
            if cfg.o_bias:
                Hr = Hr + params[p + "o.bias"]
            local_inputs.append(norm(Hr, params[p + "mlp_norm.weight"],
                                     params.get(p + "mlp_norm.bias"), cfg))
        shard_layout = ShardLayout.build(cfg, tp)  # ffn shards s = 0..tp-1, default order
        geo_s = local_geometry(cfg, shard_layout, range(tp), dev)
        w_s = block_weights(src, cfg, geo_s, shard_layout, layer)
        C = torch.zeros(tp, tp, dtype=torch.float64, device=dev)  # C[r, s] = ||MLP_s(norm(H_r))||^2
        for hn in local_inputs:
            for r in range(tp):
                C[r] += mlp_partial(hn[r : r + 1], w_s, geo_s, cfg).double().pow(2).sum((1, 2))
        Cn = C.sqrt().cpu()
        ident = float(Cn.diagonal().sum())
        if mlp == "shard":
            perms = itertools.permutations(range(tp)) if tp <= 8 else [tuple(range(tp))]
            best = max(perms, key=lambda s: sum(float(Cn[r, s[r]]) for r in range(tp)))
            ffn_order = [c for s in best for c in shards[s]]
        elif mlp == "channel":
            ffn_order = _channel_assignment(params, p, cfg, local_inputs, [len(s) for s in shards])
        else:
            ffn_order = list(range(F_))
        report["mlp_output_norm"] = {"default": ident, "grouped": _mlp_norm(
            src, cfg, tp, layer, head_order, ffn_order, local_inputs)}
    return Grouping(head_order, ffn_order, report)


def _mlp_norm(src, cfg, tp, layer, head_order, ffn_order, local_inputs) -> float:
    """``sum_r ||MLP_r(norm(H_r))||`` under the chosen channel split."""
    lay = ShardLayout.build(cfg, tp, head_order, ffn_order)
    dev = local_inputs[0].device
    geo = local_geometry(cfg, lay, range(tp), dev)
    w = block_weights(src, cfg, geo, lay, layer)
    sq = torch.zeros(tp, dtype=torch.float64, device=dev)
    for hn in local_inputs:  # (tp, M, h): rank r's own input
        sq += mlp_partial(hn, w, geo, cfg).double().pow(2).sum((1, 2))
    return float(sq.sqrt().sum())


def _channel_assignment(params, p, cfg: ModelConfig, local_inputs, capacity: list[int]) -> list[int]:
    """Channels to ranks by output-magnitude score, greedily by regret, counts fixed."""
    from syncdrop.parallel.block import ACTIVATIONS

    tp = len(capacity)
    down_norm = params[p + "down.weight"].detach().norm(dim=0)  # (F,)
    score = torch.zeros(tp, cfg.intermediate_size, dtype=torch.float64, device=down_norm.device)
    for hn in local_inputs:  # (tp, M, h)
        up = hn @ params[p + "up.weight"].t()  # (tp, M, F)
        if cfg.gated_mlp:
            a = torch.nn.functional.silu(hn @ params[p + "gate.weight"].t()) * up
        else:
            a = ACTIVATIONS[cfg.act](up + params[p + "up.bias"] if cfg.mlp_bias else up)
        score += (a.abs().sum(1) * down_norm).double()
    score = score.cpu()  # (tp, F): the greedy assignment below reads it channel by channel
    top2 = score.topk(min(2, tp), dim=0).values
    regret = top2[0] - (top2[1] if tp > 1 else 0)
    left = list(capacity)
    owner = [0] * cfg.intermediate_size
    for c in regret.argsort(descending=True).tolist():
        for r in score[:, c].argsort(descending=True).tolist():
            if left[r] > 0:
                owner[c], left[r] = r, left[r] - 1
                break
    return [c for r in range(tp) for c in range(cfg.intermediate_size) if owner[c] == r]
