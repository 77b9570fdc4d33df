"""Per-block SPD sensitivity: perplexity deltas on calibration windows (docs/methods.md, sensitivity profiling).

Two definitions, both computed in one run (L = number of blocks, ``ppl(D)`` = perplexity with
the attention sync of the blocks in ``D`` dropped, SPD block, all other blocks full):

* progressive (the paper's, from the last block backwards):
  ``s_i = ppl({i..L-1}) - ppl({i+1..L-1})``, with ``ppl({}) = baseline``; the deltas telescope,
  so ``sum_{j>=i} s_j = ppl({i..L-1}) - baseline`` exactly;
* isolated: ``s_i = ppl({i}) - baseline``.

Calibration windows follow :mod:`syncdrop.eval.perplexity` exactly (text tokenized once without
special tokens, the first K non-overlapping windows of L tokens, every token after the first
scored), so ``baseline_ppl`` equals ``syncdrop ppl --plan none --dataset D --seq-len L
--max-windows K`` at the same ``--tp`` and dtype.

Cached block inputs. In both definitions every block before ``i`` runs unchanged (full), so its
output is the reference's. One plan-``none`` forward per window batch records the residual entering
every block (rank axis 1, ``(1, B*S, h)``) and gives the baseline NLL; every later evaluation
starts at block ``i`` from that cache and runs only blocks ``i..L-1``. Block forwards: L per
window for the reference pass, ``L - i`` per window for each of the 2L evaluations (the isolated and
progressive plans for the last block coincide and run once), so ``W * (L + L(L+1) - 1)`` in all,
against ``W * L * (2L + 1)`` when each of the 2L + 1 perplexities is computed from scratch: about
half. The cache holds ``W * S * h * L`` activations in the model dtype: SmolLM2-135M, 8 windows of
512 tokens, fp32: 8 * 512 * 576 * 4 B * 30 blocks = 283 MB.

Recovered sensitivity (``donor``). The same two definitions after recovery: a dropped block runs the
weights (and head layout) of ``donor``, a model built from a ``syncdrop distill`` bank with every
block distilled, instead of the base model's; a block that is not dropped runs the base model's.
Because B2B trains each block on the original residual, block ``i``'s distilled weights do not
depend on which other blocks are dropped, so these are the perplexities of the plans
``syncdrop distill --bank`` would give. Ordering blocks by them drops the blocks that *recover*
best, where the zero-shot order drops those that hurt least before recovery: on SmolLM2 some
blocks that are harmful zero-shot become nearly free after HG+B2B and the reverse (docs/spd.md).

Profiling needs all N ranks in one process (the simulated executor); it is an accuracy tool.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.eval.perplexity import window_nll
from syncdrop.parallel.executor import TPModel
from syncdrop.plan import SyncPlan
from syncdrop.spd import PROFILE_FORMAT, PROFILE_VERSION


@dataclass
class BlockSensitivity:
    index: int
    progressive: float  # ppl({i..L-1}) - ppl({i+1..L-1})
    isolated: float  # ppl({i}) - baseline
    ppl_progressive: float  # ppl({i..L-1})
    ppl_isolated: float  # ppl({i})

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "progressive": self.progressive, "isolated": self.isolated,
                "ppl_progressive": self.ppl_progressive, "ppl_isolated": self.ppl_isolated}


@dataclass
class Profile:
    """Result of :func:`profile_sensitivity` (plus what the CLI adds: model name, calibration data)."""

    baseline_ppl: float
    blocks: list[BlockSensitivity]
    windows: int
    seq_len: int
    block_forwards_done: int
    block_forwards_naive: int
    cache_bytes: int
    elapsed_s: float
    variant: str = "drop"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def to_dict(self, model: str, tp: int, calib: dict[str, Any], **extra: Any) -> dict[str, Any]:
        from syncdrop.io_utils import provenance

        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": model,
            "tp": tp,
            "num_blocks": self.num_blocks,
            "variant": self.variant,
            "calib": {**calib, "windows": self.windows, "seq_len": self.seq_len,
                      "tokens_scored": self.windows * (self.seq_len - 1)},
            "baseline_ppl": self.baseline_ppl,
            "blocks": [b.to_dict() for b in self.blocks],
            "block_forwards": {
                "done": self.block_forwards_done,
                "naive": self.block_forwards_naive,
                "naive_definition": "2L+1 perplexities (baseline, L progressive, L isolated), each L block "
                                    "forwards per window",
            },
            "cache_bytes": self.cache_bytes,
            "elapsed_s": self.elapsed_s,
            **extra,
            "provenance": provenance(),
        }


class _StartedAt:
    """Adapter so :func:`~syncdrop.eval.perplexity.window_nll` (the one NLL definition) scores a run
    that starts at block ``start`` from a cached residual ``x`` instead of from the token ids."""

    def __init__(self, model: TPModel, x: torch.Tensor, start: int) -> None:
        self.model, self.x, self.start = model, x, start

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        B, S = ids.shape
        return self.model.run_blocks(self.x, self.start, self.model.context(B, S))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)


@contextmanager
def _blocks_from(model: TPModel, donor: TPModel | None, blocks: frozenset[int]) -> Iterator[None]:
    """``model`` runs ``donor``'s weights and per-block geometry for ``blocks`` inside the ``with``
    (nothing when ``donor`` is None); its own are put back afterwards."""
    if donor is None or not blocks:
        yield
        return
    saved = {i: (model.geos[i], model.layouts[i]) for i in blocks}
    try:
        for i in blocks:
            model.blocks[i], model.geos[i], model.layouts[i] = donor.blocks[i], donor.geos[i], donor.layouts[i]
        yield
    finally:
        for i, (g, lay) in saved.items():
            del model.blocks[i]  # the model's own block again
            model.geos[i], model.layouts[i] = g, lay


def profile_sensitivity(
    model: TPModel, windows: torch.Tensor, batch_size: int = 1, variant: str = "drop", progress: bool = True,
    donor: TPModel | None = None,
) -> Profile:
    """Progressive and isolated sensitivity of every block of ``model`` on ``windows`` ``(W, S)``.

    ``variant``: the attention mode of a dropped block (``drop`` = the SPD block). ``donor``: the
    recovered sensitivity (module docstring): a dropped block runs ``donor``'s block (same config,
    TP degree and local ranks as ``model``). The model's plan and blocks are restored afterwards.
    """
    if donor is not None and (donor.cfg != model.cfg or donor.layout.tp != model.layout.tp
                              or donor.geo.ranks != model.geo.ranks):
        raise SyncdropError("the donor model of a recovered profile must have the model's config, TP degree and ranks")

    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise SyncdropError(f"calibration windows must be (W >= 1, S >= 2), got {tuple(windows.shape)}")
    if batch_size < 1:
        raise SyncdropError(f"--batch-size must be at least 1, got {batch_size}")
    L = model.cfg.num_layers
    W, S = windows.shape
    scored = W * (S - 1)
    batches = [windows[i : i + batch_size] for i in range(0, W, batch_size)]
    saved_plan = model.plan
    t0 = time.perf_counter()
    if model.blocks.streams:
        try:
            model.plan = SyncPlan.uniform(L)  # the final norm and LM head of a dense model
            nll, done, cache_bytes = _sweep(model, batches, variant, donor, progress)
        finally:
            model.plan = saved_plan
        return _profile(nll, L, W, S, scored, done, cache_bytes, time.perf_counter() - t0, variant)

    evals = {d: (SyncPlan.dropping(L, d, variant), start) for d, start in _evaluations(L).items()}
    base, totals, done, cache_bytes = cached_nll(model, batches, evals, progress,
                                                 enter=lambda d: _blocks_from(model, donor, d))
    nll = {frozenset(): base, **totals}
    return _profile(nll, L, W, S, scored, done, cache_bytes, time.perf_counter() - t0, variant)


def cached_nll(model: TPModel, batches: list[torch.Tensor], evals: dict[Hashable, tuple[SyncPlan, int]],
               progress: bool = True, desc: str = "profiling",
               enter: Callable[[Hashable], AbstractContextManager] | None = None
               ) -> tuple[float, dict[Hashable, float], int, int]:
    """Summed token NLL of ``model`` on ``batches`` (each ``(B, S)``) under plan ``none`` and under each
    evaluation ``key -> (plan, start)``, where ``plan`` runs every block before ``start`` as the dense model
    does: those blocks are not rerun, the evaluation starts from the residual the dense pass recorded
    entering block ``start`` (module docstring). ``enter(key)``: a context the evaluation runs in (a donor's
    blocks). Returns (dense NLL, NLL per key, block forwards, cache bytes); the model's plan is restored."""
    from syncdrop.progress import progress_bar

    L = model.cfg.num_layers
    W = sum(ids.shape[0] for ids in batches)
    planned = W * (L + sum(L - start for _, start in evals.values()))
    done = 0
    nll: dict[Hashable, float] = {}
    saved_plan = model.plan
    try:
        with torch.inference_mode(), progress_bar(total=planned, desc=desc, unit="block",
                                                  disable=not progress, leave=False) as bar:
            model.plan = SyncPlan.uniform(L)
            cache: list[list[torch.Tensor]] = []  # per batch: the residual entering each block
            base = 0.0
            for ids in batches:
                rec: list[torch.Tensor] = []
                base += window_nll(_Recording(model, rec), ids).sum().item()
                cache.append(rec)
                done += ids.shape[0] * L
                bar.update(ids.shape[0] * L)
            for key, (plan, start) in evals.items():
                model.plan = plan
                total = 0.0
                with enter(key) if enter is not None else nullcontext():
                    for ids, rec in zip(batches, cache, strict=True):
                        total += window_nll(_StartedAt(model, rec[start], start), ids).sum().item()
                        done += ids.shape[0] * (L - start)
                        bar.update(ids.shape[0] * (L - start))
                nll[key] = total
        cache_bytes = sum(t.numel() * t.element_size() for rec in cache for t in rec)
    finally:
        model.plan = saved_plan
    assert done == planned, (done, planned)
    return base, nll, done, cache_bytes


def _evaluations(L: int) -> dict[frozenset[int], int]:
    """The dropped sets a profile evaluates after the reference pass, with the block each starts at
    (every block before it runs as in the reference); the progressive and isolated plans of the last
    block are the same set and run once."""
    evals: dict[frozenset[int], int] = {}
    for i in reversed(range(L)):
        evals.setdefault(frozenset(range(i, L)), i)
        evals.setdefault(frozenset({i}), i)
    return evals


def _sweep(model: TPModel, batches: list[torch.Tensor], variant: str, donor: TPModel | None,
           progress: bool) -> tuple[dict[frozenset[int], float], int, int]:
    """Every evaluation of a profile in one pass over the blocks, each block read once (a model that
    streams its blocks): the reference stream and every started evaluation's stream go through block
    ``j`` before block ``j + 1`` is read; an evaluation starting at block ``i`` starts from the
    reference stream entering block ``i``. The same block calls on the same inputs as the cached
    path, so the same NLLs, bit for bit. Holds ``(1 + evaluations started)`` streams of every batch:
    up to ``2 L`` at the last block. Returns (NLL per dropped set, block forwards, peak stream bytes)."""
    from syncdrop.eval.perplexity import nll_of_hidden
    from syncdrop.parallel.block import block_forward
    from syncdrop.plan import FULL, BlockSync, mode_named
    from syncdrop.progress import progress_bar

    cfg, L = model.cfg, model.cfg.num_layers
    dense, dropped_block = BlockSync(FULL), BlockSync(mode_named(variant))
    evals = _evaluations(L)
    ctxs = [model.context(*ids.shape) for ids in batches]
    ref = [model.embed_tokens(ids) for ids in batches]  # per batch (1, B*S, h)
    streams: dict[frozenset[int], list[torch.Tensor]] = {}
    done, peak = 0, 0
    with torch.inference_mode(), progress_bar(range(L), desc="profiling (streamed)", unit="block",
                                              disable=not progress, leave=False) as layers:
        for j in layers:
            streams |= {d: list(ref) for d, start in evals.items() if start == j}
            peak = max(peak, sum(x.numel() * x.element_size() for xs in (ref, *streams.values()) for x in xs))
            w, geo = model.blocks[j], model.geos[j]
            ref = [block_forward(x, w, geo, cfg, model.comm, c, dense) for x, c in zip(ref, ctxs, strict=True)]
            for d, xs in streams.items():
                drops = j in d
                wj, gj = (donor.blocks[j], donor.geos[j]) if drops and donor is not None else (w, geo)
                sync = dropped_block if drops else dense
                streams[d] = [block_forward(x, wj, gj, cfg, model.comm, c, sync) for x, c in zip(xs, ctxs, strict=True)]
            done += sum(ids.shape[0] for ids in batches) * (1 + len(streams))
        nll = {d: sum(nll_of_hidden(model, model._final(x, c), ids).sum().item()
                      for x, c, ids in zip(xs, ctxs, batches, strict=True))
               for d, xs in [(frozenset(), ref), *streams.items()]}
    return nll, done, peak


def _profile(nll: dict[frozenset[int], float], L: int, W: int, S: int, scored: int, done: int, cache_bytes: int,
             elapsed: float, variant: str) -> Profile:
    """The :class:`Profile` of the NLL sums of the baseline (the empty set) and every evaluated dropped set."""
    baseline = math.exp(nll[frozenset()] / scored)

    def ppl(dropped: frozenset[int]) -> float:
        return math.exp(nll[dropped] / scored)

    blocks = []
    for i in range(L):
        p_prog, p_next = ppl(frozenset(range(i, L))), ppl(frozenset(range(i + 1, L)))
        p_iso = ppl(frozenset({i}))
        blocks.append(BlockSensitivity(i, p_prog - p_next, p_iso - baseline, p_prog, p_iso))
    return Profile(baseline, blocks, W, S, done, W * L * (2 * L + 1), cache_bytes, elapsed, variant)


class _Recording:
    """Adapter: the full forward from the token ids under the model's plan, recording block inputs."""

    def __init__(self, model: TPModel, record: list[torch.Tensor]) -> None:
        self.model, self.record = model, record

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        B, S = ids.shape
        return self.model.run_blocks(self.model.embed_tokens(ids), 0, self.model.context(B, S), record=self.record)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)


def plot_profile(d: dict[str, Any], path: str | Path) -> None:
    """Bar chart of both sensitivities per block (from a profile dict) as a PNG, written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from syncdrop.io_utils import atomic_write_png

    idx = [b["index"] for b in d["blocks"]]
    fig = Figure(figsize=(max(6.0, 0.32 * len(idx) + 2), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    w = 0.4
    ax.bar([i - w / 2 for i in idx], [b["progressive"] for b in d["blocks"]], w, label="progressive")
    ax.bar([i + w / 2 for i in idx], [b["isolated"] for b in d["blocks"]], w, label="isolated")
    ax.axhline(0.0, color="black", linewidth=0.6)
    vals = sorted(abs(b[k]) for b in d["blocks"] for k in ("progressive", "isolated"))
    typical = vals[len(vals) // 2] if vals else 0.0
    if vals and typical > 0 and vals[-1] > 30 * typical:  # a few dominant blocks would flatten the rest
        ax.set_yscale("symlog", linthresh=typical)
        low = min(b[k] for b in d["blocks"] for k in ("progressive", "isolated"))
        ax.set_ylim(bottom=1.5 * low if low < 0 else 0.0)
        ax.text(0.01, 0.97, f"symmetric log scale (linear below {typical:.2g})", transform=ax.transAxes, fontsize=7,
                va="top")
    ax.set_xlabel("block")
    ax.set_ylabel("perplexity increase (SPD on the block)")
    if len(idx) <= 40:
        ax.set_xticks(idx)
    calib = d.get("calib", {})
    ax.set_title(f"{d.get('model')} TP={d.get('tp')}: SPD sensitivity\nbaseline ppl {d['baseline_ppl']:.3f} "
                 f"({calib.get('dataset')}, {calib.get('windows')} x {calib.get('seq_len')} tokens)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    atomic_write_png(path, fig)
