"""Megatron-style sharding: which heads and MLP channels each tensor-parallel rank owns.

Column-parallel layers (q, k, v, gate, up) split their *output* features across ranks: rank r
owns some query heads (and the KV heads they read) and some intermediate channels. Row-parallel
layers (o, down) split their *input* features the same way, so each rank produces a partial
``(.., h)`` output that the sync point sums.

The one rule used for every TP degree N (this is the only place it is written):

* Query heads are split into N contiguous groups as evenly as possible (sizes differ by at most
  one), unless an explicit ``head_order`` permutation is given (head grouping).
* Each rank owns exactly the KV heads its query heads read, so a query head always stays with its
  KV head. When N divides the KV-head count this is plain GQA sharding; when a KV group straddles
  two ranks (uneven splits) or N exceeds the KV-head count, that KV head is *replicated* on every
  rank that needs it (its K/V projections are computed redundantly, as in vLLM).
* Intermediate (MLP) channels are split into N contiguous, near-equal ranges, unless an explicit
  ``ffn_order`` permutation is given.

Example, SmolLM2 (9 heads, 3 KV heads, group 3) at N=2: rank 0 owns q heads 0-4 and KV heads
{0, 1}; rank 1 owns q heads 5-8 and KV heads {1, 2}; KV head 1 is replicated. That layout is
syncdrop's own: Megatron-LM and vLLM require N to divide the head count and cannot serve it; a split
by KV group (6 + 3 q heads) is another layout, which this rule does not build.

:func:`distilled_layouts` turns the head-grouping permutations of a ``syncdrop distill`` directory
(:mod:`syncdrop.models.distilled`) into per-block layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig
from syncdrop.models.distilled import SPDCheckpoint


@dataclass(frozen=True)
class RankSlice:
    """What one rank owns. Head and channel indices are global (dense model) indices."""

    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_of_q: tuple[int, ...]  # for each local q head, the *local* index of its KV head
    ffn: tuple[int, ...]  # intermediate channels


def _even_split(n_items: int, n_parts: int) -> list[range]:
    """Contiguous near-equal parts; the first ``n_items % n_parts`` parts get one extra item."""
    base, extra = divmod(n_items, n_parts)
    out, start = [], 0
    for r in range(n_parts):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise a :class:`SyncdropError` if ``tp`` ranks cannot serve this model."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise SyncdropError(f"--tp must be a positive integer, got {tp!r}")
    if tp > cfg.num_heads:
        raise SyncdropError(
            f"--tp {tp} exceeds the model's {cfg.num_heads} query heads; every rank needs at least one head"
        )
    if tp > cfg.intermediate_size:
        raise SyncdropError(f"--tp {tp} exceeds the MLP width {cfg.intermediate_size}")


@dataclass(frozen=True)
class ShardLayout:
    """The slices of all N ranks (identical for every block)."""

    tp: int
    ranks: tuple[RankSlice, ...]

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        tp: int,
        head_order: Sequence[int] | None = None,
        ffn_order: Sequence[int] | None = None,
    ) -> ShardLayout:
        """Layout for ``tp`` ranks; ``head_order``/``ffn_order`` permute heads/channels first."""
        check_tp(cfg, tp)
        heads = list(head_order) if head_order is not None else list(range(cfg.num_heads))
        chans = list(ffn_order) if ffn_order is not None else list(range(cfg.intermediate_size))
        if sorted(heads) != list(range(cfg.num_heads)):
            raise ValueError("head_order must be a permutation of the query heads")
        if sorted(chans) != list(range(cfg.intermediate_size)):
            raise ValueError("ffn_order must be a permutation of the MLP channels")
        g = cfg.group_size
        ranks = []
        for hr, fr in zip(_even_split(len(heads), tp), _even_split(len(chans), tp), strict=True):
            q = tuple(heads[i] for i in hr)
            kv = tuple(sorted({h // g for h in q}))
            ranks.append(
                RankSlice(q_heads=q, kv_heads=kv, kv_of_q=tuple(kv.index(h // g) for h in q),
                          ffn=tuple(chans[i] for i in fr))
            )
        return cls(tp=tp, ranks=tuple(ranks))

    @property
    def max_q(self) -> int:
        return max(len(r.q_heads) for r in self.ranks)

    @property
    def max_kv(self) -> int:
        return max(len(r.kv_heads) for r in self.ranks)

    @property
    def max_ffn(self) -> int:
        return max(len(r.ffn) for r in self.ranks)

    @property
    def is_even(self) -> bool:
        """True when no rank needs padding in the simulated executor."""
        return all(
            (len(r.q_heads), len(r.kv_heads), len(r.ffn)) == (self.max_q, self.max_kv, self.max_ffn)
            for r in self.ranks
        )

    def describe(self) -> str:
        parts = [f"rank {i}: q{list(r.q_heads)} kv{list(r.kv_heads)} ffn[{len(r.ffn)}]"
                 for i, r in enumerate(self.ranks)]
        return "; ".join(parts)


def distilled_layouts(spd: SPDCheckpoint, cfg: ModelConfig) -> dict[int, ShardLayout]:
    """``{block: ShardLayout}`` of a ``syncdrop distill`` directory's blocks that carry a head-grouping
    permutation (``head_order`` and/or ``ffn_order`` in the manifest), built for the degree ``spd.tp``
    the blocks were distilled for; blocks without one keep the default layout and are left out.

    A permutation that does not fit ``cfg`` (not a permutation of its heads / MLP channels) raises a
    :class:`SyncdropError` naming the directory and the block.
    """
    out = {}
    for i, b in spd.blocks.items():
        if b.get("head_order") is not None or b.get("ffn_order") is not None:
            try:
                out[i] = ShardLayout.build(cfg, spd.tp, b.get("head_order"), b.get("ffn_order"))
            except ValueError as e:
                raise SyncdropError(f"model {spd.path}: block {i}: {e}") from e
    return out


def head_rows(heads: Sequence[int], head_dim: int) -> torch.Tensor:
    """Row indices of the given heads in a ``(n_heads * head_dim, h)`` projection weight."""
    idx = torch.tensor(list(heads), dtype=torch.long)
    return (idx[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)  # (len(heads)*d,)


def rank_indices(cfg: ModelConfig, rs: RankSlice) -> dict[str, torch.Tensor]:
    """Index tensors selecting one rank's slice of each sharded dense weight.

    ``q`` rows of q.weight, ``kv`` rows of k/v.weight, ``o`` columns of o.weight (= ``q``),
    ``ffn`` rows of gate/up.weight and columns of down.weight.
    """
    q = head_rows(rs.q_heads, cfg.head_dim)
    return {
        "q": q,
        "kv": head_rows(rs.kv_heads, cfg.head_dim),
        "o": q,
        "ffn": torch.tensor(list(rs.ffn), dtype=torch.long),
    }


def contiguous_orders(cfg: ModelConfig, layout: ShardLayout) -> tuple[list[int], list[int], list[int]]:
    """The query-head, KV-head and MLP-channel orders after which a *contiguous, even* split over
    ``layout.tp`` ranks -- the split Megatron-LM and vLLM make -- gives every rank exactly the heads and
    channels ``layout`` gives it (ranks renumbered where needed: ranks are interchangeable).

    Permuting q/k/v rows, o columns, gate/up rows and down columns of a block by these orders is an
    exact re-parameterisation of the dense block (RoPE acts within a head), so the permutation can be
    baked into the weights. Requires, as vLLM does, an even split (N divides the query heads and the
    MLP width, and N divides the KV heads or the KV heads divide N) and, after the permutation, query
    head ``n`` reading KV head ``n // group``: every KV group a rank reads lies on that rank alone, or
    (N > KV heads) each rank reads one replicated KV head. Raises :class:`SyncdropError` with the
    reason otherwise.
    """
    n, H, K, g, ffn = layout.tp, cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.intermediate_size
    if H % n or ffn % n or (K % n and n % K):
        raise SyncdropError(f"a contiguous split over {n} ranks (Megatron-LM, vLLM) needs {n} to divide the "
                            f"{H} query heads and the MLP width {ffn}, and {n} to divide the {K} KV heads or "
                            f"the KV heads to divide {n}; this model cannot be sharded that way at TP={n}")
    ranks = sorted(layout.ranks, key=lambda r: r.kv_heads)  # ranks that share a replicated KV head side by side
    if any(len(r.q_heads) != H // n or len(r.ffn) != ffn // n for r in ranks):
        raise SyncdropError(f"the layout gives ranks unequal numbers of heads or MLP channels ({layout.describe()})")
    q_order = [h for r in ranks for h in sorted(r.q_heads, key=lambda h: (h // g, h))]
    kv_order: list[int] = []
    for r in ranks:
        kv_order += [k for k in r.kv_heads if not kv_order or kv_order[-1] != k]
    if sorted(kv_order) != list(range(K)) or any(kv_order[i // g] != q_order[i] // g for i in range(H)):
        raise SyncdropError("the layout puts query heads of one KV group on different ranks together with other "
                            f"groups ({layout.describe()}); a contiguous split cannot reproduce it")
    return q_order, kv_order, [c for r in ranks for c in r.ffn]
