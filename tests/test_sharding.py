"""The sharding rule: every head and channel owned once, query heads stay with their KV head."""

from __future__ import annotations

import pytest
import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig
from syncdrop.parallel.sharding import ShardLayout, check_tp

SMOL = ModelConfig(family="llama", arch="LlamaForCausalLM", vocab_size=49152, hidden_size=576, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)


@pytest.mark.parametrize("n", range(1, 10))
def test_partition_invariants(n: int) -> None:
    lay = ShardLayout.build(SMOL, n)
    qs = [h for r in lay.ranks for h in r.q_heads]
    assert sorted(qs) == list(range(9))
    assert sorted(c for r in lay.ranks for c in r.ffn) == list(range(1536))
    sizes = [len(r.q_heads) for r in lay.ranks]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    for r in lay.ranks:
        assert set(r.kv_heads) == {h // 3 for h in r.q_heads}
        assert [r.kv_heads[j] for j in r.kv_of_q] == [h // 3 for h in r.q_heads]


def test_smollm2_tp2_is_uneven_with_one_replicated_kv_head() -> None:
    lay = ShardLayout.build(SMOL, 2)
    assert [r.q_heads for r in lay.ranks] == [(0, 1, 2, 3, 4), (5, 6, 7, 8)]
    assert [r.kv_heads for r in lay.ranks] == [(0, 1), (1, 2)]
    assert not lay.is_even


def test_tp3_is_plain_gqa_sharding() -> None:
    lay = ShardLayout.build(SMOL, 3)
    assert [r.kv_heads for r in lay.ranks] == [(0,), (1,), (2,)]
    assert lay.is_even


def test_more_ranks_than_kv_heads_replicates_kv() -> None:
    lay = ShardLayout.build(SMOL, 9)
    owners = {kv: sum(kv in r.kv_heads for r in lay.ranks) for kv in range(3)}
    assert owners == {0: 3, 1: 3, 2: 3}


def test_head_order_permutes_heads() -> None:
    lay = ShardLayout.build(SMOL, 3, head_order=[0, 3, 6, 1, 4, 7, 2, 5, 8])
    assert lay.ranks[0].q_heads == (0, 3, 6) and lay.ranks[0].kv_heads == (0, 1, 2)


@pytest.mark.parametrize("n, message", [(0, "positive"), (-1, "positive"), (10, "exceeds the model's 9 query heads")])
def test_unservable_tp(n: int, message: str) -> None:
    with pytest.raises(SyncdropError, match=message):
        check_tp(SMOL, n)


def test_column_weight_is_the_stacked_padded_slices_permuted() -> None:
    """The fused-QKV / gate-up layout built with one copy equals its definition: every rank's slices padded to
    their sizes, stacked to (R, out_r, h) and permuted to (h, R*out_r); padding is zero."""
    from syncdrop.parallel.weights import _column_weight

    g = torch.Generator().manual_seed(0)
    h, sizes = 7, (5, 3, 3)
    parts = [[torch.randn(n, h, generator=g) for n in rows] for rows in ((5, 3, 2), (4, 1, 3), (5, 3, 3))]
    padded = [torch.cat([torch.cat([p, torch.zeros(n - p.shape[0], h)]) for p, n in zip(ps, sizes, strict=True)])
              for ps in parts]
    expected = torch.stack(padded).permute(2, 0, 1).reshape(h, -1)  # (h, R*out_r)
    got = _column_weight(parts, sizes)
    assert got.is_contiguous() and torch.equal(got, expected)
