"""Per-rank weights of each block, stacked along a leading rank axis for batched execution.

A process holds R *local* ranks: all N in the simulated executor, one in the distributed runtime.
Ranks with fewer heads or channels than the largest rank are zero-padded (exact: a padded
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
* ``q_norm_w``, ``k_norm_w`` ``(d,)`` replicated (Qwen3, else None): the per-head RMSNorm gains on q and k,
  one vector that every head of every rank uses, so no rank needs a slice of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from syncdrop.models.config import ModelConfig
from syncdrop.parallel.sharding import ShardLayout, rank_indices

# Reads one dense canonical tensor by name (lazily, from a checkpoint or a dict).
TensorGetter = Callable[[str], torch.Tensor]


class TensorSource:
    """Reads canonical tensors, or only some rows/columns of them when the checkpoint reader can
    (``get_rows``/``get_cols``: each rank of the distributed runtime reads only its own slices).

    Built from a checkpoint reader or from a plain ``name -> tensor`` callable (a dict's
    ``__getitem__``), for which slices are cut from the full tensor.
    """

    def __init__(self, src: object) -> None:
        if isinstance(src, dict):
            self.get: TensorGetter = src.__getitem__
        elif hasattr(src, "get"):
            self.get = src.get
        elif callable(src):
            self.get = src
        else:
            raise TypeError(f"weights must be a checkpoint reader, a dict or a callable, got {type(src).__name__}")
        self._rows = getattr(src, "get_rows", None)
        self._cols = getattr(src, "get_cols", None)
        self._shape = getattr(src, "shape", None)

    def read(self, name: str, dtype: torch.dtype, rows_per_read: int = 4096) -> torch.Tensor:
        """``get(name).to(dtype)``, the same values, without the reader's float32 copy of the whole tensor: a
        reader that reads rows gives a 2-D tensor ``rows_per_read`` rows at a time, each chunk converted
        (float32, then ``dtype``) into the result as it comes. For a bfloat16 embedding or LM head the transient
        is one chunk instead of twice the tensor."""
        shape = tuple(self._shape(name)) if self._rows is not None and self._shape is not None else ()
        if len(shape) != 2 or shape[0] <= rows_per_read:
            return self.get(name).to(dtype)
        out = torch.empty(shape, dtype=dtype)  # (rows, cols)
        for lo in range(0, shape[0], rows_per_read):
            hi = min(lo + rows_per_read, shape[0])
            out[lo:hi] = self._rows(name, torch.arange(lo, hi)).to(dtype)
        return out

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self._rows(name, index) if self._rows else self.get(name)[index]

    def cols(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self._cols(name, index) if self._cols else self.get(name)[:, index]


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
    q_norm_w: torch.Tensor | None = None
    k_norm_w: torch.Tensor | None = None

    def _fields(self) -> list[torch.Tensor | None]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]  # (astuple would deep-copy)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self._fields() if t is not None]

    def to(self, device: torch.device) -> BlockWeights:
        return BlockWeights(*(t.to(device) if t is not None else None for t in self._fields()))


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

    def to(self, device: torch.device) -> LocalGeometry:
        kv_map = self.kv_map.to(device) if self.kv_map is not None else None
        return dataclasses.replace(self, kv_map=kv_map)


def local_geometry(cfg: ModelConfig, layout: ShardLayout, ranks: Sequence[int],
                   device: torch.device | str = "cpu") -> LocalGeometry:
    """Shapes for the local ranks, padded to the largest rank of the *whole* layout; the q -> KV map
    is built on the host and placed on ``device`` (where the attention that indexes with it runs).

    Padding to the global maximum (not just the local one) gives every rank the same GEMM shapes
    in both executors, so the distributed runtime reproduces the simulation bit for bit; it costs
    no latency, since the step waits for the largest rank anyway.
    """
    sl = [layout.ranks[r] for r in ranks]
    Q, K, F = layout.max_q, layout.max_kv, layout.max_ffn
    kv_map = torch.zeros(len(sl) * Q, dtype=torch.long)
    for i, s in enumerate(sl):
        for j, kv in enumerate(s.kv_of_q):
            kv_map[i * Q + j] = i * K + kv
    regular = Q % K == 0 and all(
        len(s.q_heads) == Q and list(s.kv_of_q) == [j // (Q // K) for j in range(Q)] for s in sl
    )
    return LocalGeometry(tuple(ranks), Q, K, F, cfg.head_dim, None if regular else kv_map.to(device))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _column_weight(parts: list[list[torch.Tensor]], sizes: Sequence[int]) -> torch.Tensor:
    """Stack per-rank row slices ``parts[r][k]`` (each padded to ``sizes[k]`` rows) into ``(h, R*out)``."""
    # one copy: column block r holds rank r's slices side by side, each transposed to (h, rows) and followed by
    # its zero padding; the same values as stacking the padded (out_r, h) slices to (R, out_r, h) and
    # permuting to (h, R*out_r), without the two intermediate copies (a block's weights are built on every
    # training step)
    pieces = []
    for ps in parts:
        for p, n in zip(ps, sizes, strict=True):
            pieces.append(p.t())  # (h, rows)
            if n > p.shape[0]:
                pieces.append(p.new_zeros((p.shape[1], n - p.shape[0])))  # (h, n - rows)
    return torch.cat(pieces, dim=1)  # (h, R*out_r)


def _column_bias(parts: list[list[torch.Tensor]], sizes: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.cat([_pad_rows(p, n) for p, n in zip(ps, sizes, strict=True)]) for ps in parts])


def _row_weight(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """Stack per-rank column slices (h, in_r) into ``(R, in, h)``, zero-padding ``in``."""
    return torch.stack([_pad_rows(p.t(), rows) for p in parts], 0).contiguous()


def block_weights(
    src: TensorSource, cfg: ModelConfig, geo: LocalGeometry, layout: ShardLayout, layer: int,
    dtype: torch.dtype = torch.float32,
) -> BlockWeights:
    """Read, pad and stack block ``layer``'s slices for the local ranks (only those slices are read
    when the source supports it), cast to ``dtype`` on the device the source holds them on (the
    executor moves the result; training passes parameters that already live on the device)."""
    p = f"layers.{layer}."
    get = src.get

    def rows(name: str, key: str) -> list[torch.Tensor]:
        return [src.rows(p + name, i[key]).to(dtype) for i in idx]

    def cols(name: str, key: str) -> list[torch.Tensor]:
        return [src.cols(p + name, i[key]).to(dtype) for i in idx]

    idx = [rank_indices(cfg, layout.ranks[r]) for r in geo.ranks]
    d = cfg.head_dim
    qkv_sizes = (geo.q * d, geo.kv * d, geo.kv * d)

    def maybe(name: str, present: bool) -> torch.Tensor | None:
        return get(p + name).to(dtype) if present else None

    def qkv(kind: str) -> list[list[torch.Tensor]]:
        return [list(t) for t in zip(rows(f"q.{kind}", "q"), rows(f"k.{kind}", "kv"), rows(f"v.{kind}", "kv"),
                                     strict=True)]

    qkv_w = _column_weight(qkv("weight"), qkv_sizes)
    qkv_b = _column_bias(qkv("bias"), qkv_sizes) if cfg.qkv_bias else None
    o_w = _row_weight(cols("o.weight", "o"), geo.q * d)

    up_names = ("gate", "up") if cfg.gated_mlp else ("up",)
    up_sizes = (geo.ffn,) * len(up_names)

    def ups(kind: str) -> list[list[torch.Tensor]]:
        return [list(t) for t in zip(*(rows(f"{n}.{kind}", "ffn") for n in up_names), strict=True)]

    up_w = _column_weight(ups("weight"), up_sizes)
    up_b = _column_bias(ups("bias"), up_sizes) if cfg.mlp_bias else None
    down_w = _row_weight(cols("down.weight", "ffn"), geo.ffn)

    ln = cfg.norm == "layer"
    return BlockWeights(
        attn_norm_w=get(p + "attn_norm.weight").to(dtype), attn_norm_b=maybe("attn_norm.bias", ln),
        mlp_norm_w=get(p + "mlp_norm.weight").to(dtype), mlp_norm_b=maybe("mlp_norm.bias", ln),
        qkv_w=qkv_w, qkv_b=qkv_b, o_w=o_w, o_b=maybe("o.bias", cfg.o_bias),
        up_w=up_w, up_b=up_b, down_w=down_w, down_b=maybe("down.bias", cfg.mlp_bias),
        q_norm_w=maybe("q_norm.weight", cfg.qk_norm), k_norm_w=maybe("k_norm.weight", cfg.qk_norm),
    )

