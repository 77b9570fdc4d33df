"""Per-rank weights of each block, stacked along a leading rank axis for batched execution.

A process holds R *local* ranks: all N in the simulated executor, one in the distributed runtime.
Ranks with fewer heads or channels than the largest local rank are zero-padded (exact: a padded
query head has zero q weights and zero o_proj columns, so it contributes nothing; a padded MLP
channel has zero gate/up rows and zero down columns).

Layouts (Q = max local q heads, K = max local KV heads, F = max local MLP channels, d = head dim):

* ``qkv_w``  ``(h, R * (Q + 2K) * d)``  column-parallel; rank r's block of columns is
  ``[q_r | k_r | v_r]``, i.e. ``y = x @ qkv_w`` then ``y.view(M, R, (Q + 2K) * d)``.
* ``o_w``    ``(R, Q * d, h)``          row-parallel; rank r computes ``a_r @ o_w[r]`` (a partial sum).
* ``up_w``   ``(h, R * G * F)``         column-parallel, ``G = 2`` for gated MLPs (``[gate_r | up_r]``).
* ``down_w`` ``(R, F, h)``              row-parallel.
* Column biases are sharded like their columns; row-parallel biases (``o_b``, ``down_b``) are
  whole ``(h,)`` vectors, added once after the sync point (never inside the sum).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from syncdrop.models.config import ModelConfig
from syncdrop.parallel.sharding import ShardLayout, rank_indices

# Reads one dense canonical tensor by name (lazily, from a checkpoint or a dict).
TensorGetter = Callable[[str], torch.Tensor]


@dataclass
class BlockWeights:
    """One block's weights for R local ranks (see module docstring for layouts)."""

    attn_norm_w: torch.Tensor
    attn_norm_b: torch.Tensor | None
    mlp_norm_w: torch.Tensor
    mlp_norm_b: torch.Tensor | None
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    up_w: torch.Tensor
    up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


@dataclass(frozen=True)
class LocalGeometry:
    """Shapes shared by every block for the local ranks, and the q-head -> KV-head map."""

    ranks: tuple[int, ...]  # global rank ids held locally
    q: int  # Q: padded q heads per local rank
    kv: int  # K: padded KV heads per local rank
    ffn: int  # F: padded MLP channels per local rank
    head_dim: int
    # (R*Q,) index of the KV head (in the (R*K,) local layout) each q head reads; None when the
    # plain GQA pattern ``kv = q // (Q // K)`` holds, so SDPA's enable_gqa can be used.
    kv_map: torch.Tensor | None

    @property
    def r(self) -> int:
        return len(self.ranks)


def local_geometry(cfg: ModelConfig, layout: ShardLayout, ranks: Sequence[int]) -> LocalGeometry:
    sl = [layout.ranks[r] for r in ranks]
    Q = max(len(s.q_heads) for s in sl)
    K = max(len(s.kv_heads) for s in sl)
    F = max(len(s.ffn) for s in sl)
    kv_map = torch.zeros(len(sl) * Q, dtype=torch.long)
    for i, s in enumerate(sl):
        for j, kv in enumerate(s.kv_of_q):
            kv_map[i * Q + j] = i * K + kv
    regular = Q % K == 0 and all(
        len(s.q_heads) == Q and list(s.kv_of_q) == [j // (Q // K) for j in range(Q)] for s in sl
    )
    return LocalGeometry(tuple(ranks), Q, K, F, cfg.head_dim, None if regular else kv_map)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _column_weight(parts: list[list[torch.Tensor]], sizes: Sequence[int]) -> torch.Tensor:
    """Stack per-rank row slices ``parts[r][k]`` (each padded to ``sizes[k]`` rows) into ``(h, R*out)``."""
    per_rank = [torch.cat([_pad_rows(p, n) for p, n in zip(ps, sizes, strict=True)], 0) for ps in parts]
    stacked = torch.stack(per_rank, 0)  # (R, out_r, h)
    return stacked.permute(2, 0, 1).reshape(stacked.shape[2], -1).contiguous()  # (h, R*out_r)


def _column_bias(parts: list[list[torch.Tensor]], sizes: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.cat([_pad_rows(p, n) for p, n in zip(ps, sizes, strict=True)]) for ps in parts])


def _row_weight(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """Stack per-rank column slices (h, in_r) into ``(R, in, h)``, zero-padding ``in``."""
    return torch.stack([_pad_rows(p.t(), rows) for p in parts], 0).contiguous()


def block_weights(
    get: TensorGetter, cfg: ModelConfig, geo: LocalGeometry, layout: ShardLayout, layer: int,
    dtype: torch.dtype = torch.float32,
) -> BlockWeights:
    """Slice, pad and stack block ``layer``'s dense weights for the local ranks."""
    p = f"layers.{layer}."
    idx = [rank_indices(cfg, layout.ranks[r]) for r in geo.ranks]
    d = cfg.head_dim
    qkv_sizes = (geo.q * d, geo.kv * d, geo.kv * d)

    def maybe(name: str, present: bool) -> torch.Tensor | None:
        return get(p + name).to(dtype) if present else None

    wq, wk, wv = (get(p + f"{n}.weight").to(dtype) for n in ("q", "k", "v"))
    qkv_w = _column_weight([[wq[i["q"]], wk[i["kv"]], wv[i["kv"]]] for i in idx], qkv_sizes)
    qkv_b = None
    if cfg.qkv_bias:
        bq, bk, bv = (get(p + f"{n}.bias").to(dtype) for n in ("q", "k", "v"))
        qkv_b = _column_bias([[bq[i["q"]], bk[i["kv"]], bv[i["kv"]]] for i in idx], qkv_sizes)
    wo = get(p + "o.weight").to(dtype)
    o_w = _row_weight([wo[:, i["o"]] for i in idx], geo.q * d)

    up_names = ("gate", "up") if cfg.gated_mlp else ("up",)
    ups = [get(p + f"{n}.weight").to(dtype) for n in up_names]
    up_sizes = (geo.ffn,) * len(up_names)
    up_w = _column_weight([[u[i["ffn"]] for u in ups] for i in idx], up_sizes)
    up_b = None
    if cfg.mlp_bias:
        ubs = [get(p + f"{n}.bias").to(dtype) for n in up_names]
        up_b = _column_bias([[b[i["ffn"]] for b in ubs] for i in idx], up_sizes)
    wd = get(p + "down.weight").to(dtype)
    down_w = _row_weight([wd[:, i["ffn"]] for i in idx], geo.ffn)

    ln = cfg.norm == "layer"
    return BlockWeights(
        attn_norm_w=get(p + "attn_norm.weight").to(dtype), attn_norm_b=maybe("attn_norm.bias", ln),
        mlp_norm_w=get(p + "mlp_norm.weight").to(dtype), mlp_norm_b=maybe("mlp_norm.bias", ln),
        qkv_w=qkv_w, qkv_b=qkv_b, o_w=o_w, o_b=maybe("o.bias", cfg.o_bias),
        up_w=up_w, up_b=up_b, down_w=down_w, down_b=maybe("down.bias", cfg.mlp_bias),
    )

