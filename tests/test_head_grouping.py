"""Head grouping's searches against brute force (docs/methods.md, head grouping; :mod:`syncdrop.spd.head_grouping`).

Every reference here enumerates all assignments in the test itself: of heads (or KV groups) to
ranks, maximising the summed within-rank distance ``sum_r sum_{a<b on r} D[a, b]``, and of MLP
channels to ranks (counts fixed), maximising the summed score. Hand-built matrices have a planted
optimum that is not the default (identity) split; the end-to-end checks compute the distance of
the attention maps and the channel scores from transformers' own modules.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch

from syncdrop.models.config import layer_names
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.spd.head_grouping import _best_order, _channel_assignment, group_heads

Partition = tuple[frozenset[int], ...]


def _assignments(items: Sequence[int], sizes: Sequence[int]) -> Iterator[Partition]:
    """Every split of ``items`` into consecutive ranks of the given sizes (rank order kept)."""
    if not sizes:
        yield ()
        return
    for first in itertools.combinations(items, sizes[0]):
        rest = [x for x in items if x not in first]
        for tail in _assignments(rest, sizes[1:]):
            yield (frozenset(first), *tail)


def _within(D: torch.Tensor | list[list[float]], part: Partition) -> float:
    """Summed within-rank distance of a partition of the heads."""
    rows = D.tolist() if isinstance(D, torch.Tensor) else D
    return sum(rows[a][b] for rank in part for a, b in itertools.combinations(sorted(rank), 2))


def _brute_force(D: torch.Tensor, units: list[tuple[int, ...]], unit_sizes: list[int]) -> tuple[float, set]:
    """Best value over all assignments of ``units`` (``unit_sizes`` units per rank) and the set of
    optimal head partitions (unordered: the objective ignores which rank is which)."""
    best, arg, rows = -1.0, set(), D.tolist()
    for part in _assignments(range(len(units)), unit_sizes):
        heads = tuple(frozenset(h for u in rank for h in units[u]) for rank in part)
        v = _within(rows, heads)
        if v > best + 1e-9:
            best, arg = v, {frozenset(heads)}
        elif v > best - 1e-9:
            arg.add(frozenset(heads))
    return best, arg


def _ranks_of(order: list[int], sizes: list[int]) -> Partition:
    out, start = [], 0
    for n in sizes:
        out.append(frozenset(order[start : start + n]))
        start += n
    return tuple(out)


def _planted(n: int, clusters: list[list[int]], seed: int, strength: float = 5.0) -> torch.Tensor:
    """Symmetric, zero diagonal: noise in [0, 1), plus ``strength`` within each planted cluster."""
    g = torch.Generator().manual_seed(seed)
    D = torch.rand(n, n, generator=g, dtype=torch.float64)
    for c in clusters:
        for a, b in itertools.permutations(c, 2):
            D[a, b] += strength
    D = (D + D.t()) / 2
    D.fill_diagonal_(0)
    return D


def _heads(units: list[tuple[int, ...]]) -> int:
    return sum(len(u) for u in units)


def _planted_case(units: list[tuple[int, ...]], sizes: list[int], clusters: list[list[int]], seed: int):
    """A distance matrix with ``clusters`` planted, checked by brute force to be its unique optimum;
    returns (D, the optimum as a set of rank sets, the identity order, units per rank)."""
    unit_sizes = [s // len(units[0]) for s in sizes]
    D = _planted(_heads(units), clusters, seed=seed)
    _, arg = _brute_force(D, units, unit_sizes)
    want = frozenset(frozenset(c) for c in clusters)
    assert arg == {want}
    return D, want, list(range(_heads(units))), unit_sizes


@pytest.mark.parametrize("units,sizes,clusters", [
    ([(a,) for a in range(6)], [3, 3], [[0, 3, 5], [1, 2, 4]]),
    ([(a,) for a in range(6)], [2, 2, 2], [[0, 4], [1, 3], [2, 5]]),
    ([(a,) for a in range(7)], [3, 2, 2], [[1, 4, 6], [0, 5], [2, 3]]),  # uneven split
    ([(0, 1), (2, 3), (4, 5), (6, 7)], [4, 4], [[0, 1, 6, 7], [2, 3, 4, 5]]),  # whole KV groups
])
def test_exhaustive_order_is_the_brute_force_optimum(units, sizes, clusters) -> None:
    """At most 8 units: the order found is optimal (the planted, non-identity assignment, which
    brute force confirms is the unique optimum); on seeded random matrices its value equals the
    brute-force maximum."""
    D, want, identity, unit_sizes = _planted_case(units, sizes, clusters, seed=1)
    assert frozenset(_ranks_of(identity, sizes)) != want
    order = _best_order(D, units, sizes, seed=0)
    assert sorted(order) == identity
    assert frozenset(_ranks_of(order, sizes)) == want
    for seed in range(3):
        R = _planted(_heads(units), [], seed=10 + seed)
        got = _within(R, _ranks_of(_best_order(R, units, sizes, seed=0), sizes))
        assert got == pytest.approx(_brute_force(R, units, unit_sizes)[0], abs=1e-9), seed


def _swap_improves(D: torch.Tensor, order: list[int], units: list[tuple[int, ...]], sizes: list[int]) -> bool:
    """Whether exchanging two units on different ranks raises the within-rank distance."""
    G = len(units[0])
    perm = [units.index(tuple(order[i : i + G])) for i in range(0, len(order), G)]
    rows = D.tolist()
    base = _within(rows, _ranks_of(order, sizes))
    for a, b in itertools.combinations(range(len(perm)), 2):
        p = list(perm)
        p[a], p[b] = p[b], p[a]
        if _within(rows, _ranks_of([h for u in p for h in units[u]], sizes)) > base + 1e-9:
            return True
    return False


@pytest.mark.parametrize("units,sizes,clusters", [
    ([(a,) for a in range(10)], [4, 3, 3], [[0, 5, 7, 9], [1, 4, 8], [2, 3, 6]]),
    ([(a,) for a in range(11)], [4, 4, 3], [[0, 6, 9, 10], [1, 4, 7, 8], [2, 3, 5]]),
    ([(2 * g, 2 * g + 1) for g in range(9)], [6, 6, 6],  # 9 KV groups of 2 heads
     [[0, 1, 8, 9, 14, 15], [2, 3, 6, 7, 16, 17], [4, 5, 10, 11, 12, 13]]),
])
def test_swap_search_reaches_the_optimum_beyond_8_units(units, sizes, clusters) -> None:
    """More than 8 units: swap search from seeded starts. Its result is a local optimum (no
    exchange of two units improves it; checked on random matrices too) and, on a planted case
    whose identity start is not a local optimum, the brute-force optimum."""
    D, want, identity, unit_sizes = _planted_case(units, sizes, clusters, seed=2)
    assert _swap_improves(D, identity, units, sizes)  # the search has work to do
    order = _best_order(D, units, sizes, seed=0)
    assert sorted(order) == identity
    assert frozenset(_ranks_of(order, sizes)) == want
    assert _within(D, _ranks_of(order, sizes)) == pytest.approx(_brute_force(D, units, unit_sizes)[0], abs=1e-9)
    for seed in range(3):
        R = _planted(_heads(units), [], seed=20 + seed)
        got = _best_order(R, units, sizes, seed=seed)
        assert sorted(got) == identity and not _swap_improves(R, got, units, sizes), seed


def _channel_params(cfg, S: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Block-0 MLP weights and per-rank inputs whose channel scores are ``silu(10) * S[r, c]``:
    rank r's input is the unit vector e_r (one token), gate[c, r] = 10, down column c has norm
    n_c (varied, so the score needs its down-projection factor) and up[c, r] = S[r, c] / n_c."""
    tp, F_ = S.shape
    h = cfg.hidden_size
    n = torch.tensor([0.25, 4.0, 1.0, 0.5, 2.0, 3.0, 0.75, 1.5, 0.3])[:F_]
    gate = torch.zeros(F_, h)
    gate[:, :tp] = 10.0
    up = torch.zeros(F_, h)
    up[:, :tp] = S.t().float() / n[:, None]
    down = torch.zeros(h, F_)
    down[0], down[1] = 0.6 * n, 0.8 * n
    hn = torch.zeros(tp, 1, h)
    hn[torch.arange(tp), 0, torch.arange(tp)] = 1.0
    return {"layers.0.gate.weight": gate, "layers.0.up.weight": up, "layers.0.down.weight": down}, [hn]


def _channel_brute_force(S: torch.Tensor, capacity: list[int]) -> set[Partition]:
    best, arg = -1.0, set()
    for part in _assignments(range(S.shape[1]), capacity):
        v = sum(float(S[r, c]) for r, rank in enumerate(part) for c in rank)
        if v > best + 1e-9:
            best, arg = v, {part}
        elif v > best - 1e-9:
            arg.add(part)
    return arg


@pytest.mark.parametrize("prefs", [
    # (channel -> scores per rank): tp=2, more channels prefer rank 1 than it can hold
    [(1, 9), (8, 0), (2, 7), (0, 6), (5, 4), (1, 8)],
    # tp=3: four channels prefer rank 0 (capacity 3); the one with the least regret moves
    [(0, 6, 1), (6, 5, 0), (1, 0, 7), (9, 1, 0), (0, 1, 6), (8, 0, 1), (1, 5, 0), (0, 1, 5), (7, 1, 0)],
])
def test_channel_matching_is_the_brute_force_optimum(tiny_llama_dir, prefs) -> None:
    """``--hg-mlp channel``: channels go to ranks (counts fixed at the default split) so that the
    summed output-magnitude score is the brute-force maximum, here a non-default assignment."""
    cfg = resolve_model(str(tiny_llama_dir)).config
    S = torch.tensor(prefs, dtype=torch.float64).t()  # (tp, F)
    tp, F_ = S.shape
    cfg = dataclasses.replace(cfg, intermediate_size=F_)
    capacity = [F_ // tp + (r < F_ % tp) for r in range(tp)]
    params, inputs = _channel_params(cfg, S)
    order = _channel_assignment(params, "layers.0.", cfg, inputs, capacity)
    assert sorted(order) == list(range(F_))
    got = _ranks_of(order, capacity)
    want = _channel_brute_force(S, capacity)
    assert len(want) == 1 and got in want
    assert got != _ranks_of(list(range(F_)), capacity)


# --- end to end: group_heads on a real block, references from transformers' modules -------------


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _calibration(src, hf, layer: int):
    """Two windows; the residual entering ``layer`` and its attention maps, both from transformers."""
    cfg = src.config
    ids = torch.randint(3, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(input_ids=ids, output_attentions=True, output_hidden_states=True)
    x = out.hidden_states[layer]  # (B, S, h)
    ctx = simulated_model(cfg, src.reader, 1).context(1, ids.shape[1])  # RoPE tables for one window
    batches = [(x[b : b + 1].reshape(1, -1, cfg.hidden_size), ctx) for b in range(ids.shape[0])]
    return x, out.attentions[layer], batches


@pytest.mark.parametrize("layer,tp", [(0, 3), (1, 2)])
def test_group_heads_end_to_end_against_transformers(tiny_llama_dir, hf_llama, layer, tp) -> None:
    """On the tiny Llama block: the head partition is the brute-force optimum of the distances of
    transformers' own attention maps (``D[a, b]^2 = sum_windows ||A_a - A_b||_F^2``); its report
    gives that optimum and the identity's value. With ``mlp="channel"`` at tp=2, rank 0's channels
    are the optimal ones (for two ranks the top half by ``score[0] - score[1]``, where greedy by
    regret is exact), the scores computed from transformers' attention, norm and MLP modules."""
    src = resolve_model(str(tiny_llama_dir))
    cfg = src.config
    H, d = cfg.num_heads, cfg.head_dim
    x, att, batches = _calibration(src, hf_llama, layer)
    maps = att.transpose(0, 1).reshape(H, -1).double()
    D = torch.cdist(maps, maps)
    sizes = [H // tp] * tp
    best, arg = _brute_force(D, [(a,) for a in range(H)], sizes)
    params = {n: src.reader.get(n) for n in layer_names(layer, cfg)}
    g = group_heads(params, layer, cfg, tp, batches, unit="head", mlp="channel")
    assert len(arg) == 1 and frozenset(_ranks_of(g.head_order, sizes)) in arg
    assert frozenset(_ranks_of(list(range(H)), sizes)) not in arg  # the optimum is not the default
    rep = g.report["head_distance_within_ranks"]
    assert rep["grouped"] == pytest.approx(best, rel=1e-6)
    assert rep["default"] == pytest.approx(_within(D, _ranks_of(list(range(H)), sizes)), rel=1e-6)
    F_ = cfg.intermediate_size
    assert sorted(g.ffn_order) == list(range(F_))
    if tp != 2:
        return
    blk = hf_llama.model.layers[layer]
    with torch.no_grad():
        xn = blk.input_layernorm(x)
        v = blk.self_attn.v_proj(xn).unflatten(-1, (cfg.num_kv_heads, d))  # (B, S, kv, d)
        wo = blk.self_attn.o_proj.weight
        P = [(att[:, a] @ v[:, :, a // cfg.group_size]) @ wo[:, a * d : (a + 1) * d].t() for a in range(H)]
        score = torch.zeros(tp, F_, dtype=torch.float64)
        for r, heads in enumerate(_ranks_of(g.head_order, sizes)):
            hn = blk.post_attention_layernorm(x + sum(P[a] for a in heads))
            act = blk.mlp.act_fn(blk.mlp.gate_proj(hn)) * blk.mlp.up_proj(hn)
            score[r] = (act.abs().sum((0, 1)) * blk.mlp.down_proj.weight.norm(dim=0)).double()
    diff = (score[0] - score[1]).sort(descending=True)
    assert diff.values[F_ // 2 - 1] - diff.values[F_ // 2] > 1e-3 * diff.values.abs().max()  # a clear cut
    assert set(g.ffn_order[: F_ // 2]) == set(diff.indices[: F_ // 2].tolist())
    assert set(g.ffn_order[: F_ // 2]) != set(range(F_ // 2))
