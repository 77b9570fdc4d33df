"""Per-sync-point sensitivity to compression: perplexity deltas on calibration windows.

The sync points of an L-block model, in forward order, are ``k = 0 .. 2L-1``: point ``2i`` is block ``i``'s
attention all-reduce, ``2i + 1`` its MLP all-reduce. With ``ppl(C)`` the perplexity when the points in
``C`` travel in wire format ``W`` (the two-step low-bit all-reduce, :mod:`syncdrop.plan.wire`) and every
other point is a plain all-reduce, as :mod:`syncdrop.spd.profile` defines them for SPD:

* progressive, from the last point backwards: ``s_k = ppl({k..2L-1}) - ppl({k+1..2L-1})``; the deltas
  telescope, ``sum_{j>=k} s_j = ppl({k..2L-1}) - baseline`` exactly, and ``ppl({0..2L-1})`` is the plan
  ``W`` (every point compressed);
* isolated: ``s_k = ppl({k}) - baseline``.

Both come from one dense pass that records the residual entering every block
(:func:`syncdrop.spd.profile.cached_nll`): an evaluation whose first compressed point is in block ``i``
starts there, so the ``4L - 1`` distinct evaluations (the last point's two coincide) cost
``W (L + 2 L (L + 1) - 1)`` block forwards, about ``2 W L^2``.
Profiling runs all N ranks in one process (the simulated executor, exact two-step sums); at N = 1 a
compressed all-reduce is the identity and every delta is 0.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.parallel.executor import TPModel
from syncdrop.plan import FULL, BlockSync, SyncPlan
from syncdrop.plan.compressed import Compressed
from syncdrop.plan.wire import WireFormat
from syncdrop.spd.profile import cached_nll

PROFILE_KIND = "compression"
POINTS = ("attn", "mlp")


def compressing(num_blocks: int, points: frozenset[int], wire: WireFormat) -> SyncPlan:
    """The plan whose sync points ``points`` (``2i``: block ``i``'s attention, ``2i + 1``: its MLP) travel in
    ``wire`` and whose other points are plain all-reduces."""
    mode = Compressed(wire.fmt, wire.group)
    return SyncPlan([BlockSync(mode if 2 * i in points else FULL, mode if 2 * i + 1 in points else FULL)
                     for i in range(num_blocks)])


@dataclass
class PointSensitivity:
    index: int  # k: 2i attention, 2i + 1 MLP of block i
    progressive: float  # ppl({k..2L-1}) - ppl({k+1..2L-1})
    isolated: float  # ppl({k}) - baseline
    ppl_progressive: float
    ppl_isolated: float

    @property
    def block(self) -> int:
        return self.index // 2

    @property
    def point(self) -> str:
        return POINTS[self.index % 2]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "block": self.block, "point": self.point, "progressive": self.progressive,
                "isolated": self.isolated, "ppl_progressive": self.ppl_progressive, "ppl_isolated": self.ppl_isolated}


@dataclass
class CompressionProfile:
    """Result of :func:`profile_compression`."""

    wire: str
    baseline_ppl: float
    points: list[PointSensitivity]
    windows: int
    seq_len: int
    block_forwards: int
    cache_bytes: int
    elapsed_s: float

    @property
    def all_compressed_ppl(self) -> float:
        return self.points[0].ppl_progressive

    def to_dict(self, model: str, tp: int, calib: dict[str, Any], **extra: Any) -> dict[str, Any]:
        from syncdrop.io_utils import provenance

        return {"kind": PROFILE_KIND, "model": model, "tp": tp, "wire": self.wire,
                "num_blocks": len(self.points) // 2,
                "calib": {**calib, "windows": self.windows, "seq_len": self.seq_len,
                          "tokens_scored": self.windows * (self.seq_len - 1)},
                "baseline_ppl": self.baseline_ppl, "all_compressed_ppl": self.all_compressed_ppl,
                "points": [p.to_dict() for p in self.points], "block_forwards": self.block_forwards,
                "cache_bytes": self.cache_bytes, "elapsed_s": self.elapsed_s, **extra, "provenance": provenance()}


def _evaluations(L: int) -> dict[frozenset[int], int]:
    """Compressed point sets (progressive and isolated) -> the block each evaluation starts at; the two sets
    of the last point coincide and run once."""
    evals: dict[frozenset[int], int] = {}
    for k in reversed(range(2 * L)):
        evals.setdefault(frozenset(range(k, 2 * L)), k // 2)
        evals.setdefault(frozenset({k}), k // 2)
    return evals


def profile_compression(model: TPModel, windows: torch.Tensor, wire: WireFormat, batch_size: int = 1,
                        progress: bool = True) -> CompressionProfile:
    """Progressive and isolated sensitivity of every sync point of ``model`` to ``wire`` on ``windows``
    ``(W, S)`` (module docstring). The model's plan is restored afterwards."""
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise SyncdropError(f"calibration windows must be (W >= 1, S >= 2), got {tuple(windows.shape)}")
    if batch_size < 1:
        raise SyncdropError(f"--batch-size must be at least 1, got {batch_size}")
    if model.blocks.streams:
        raise SyncdropError("a compression profile holds every block's input: it cannot run with --stream")
    wire.check(model.cfg.hidden_size)
    L = model.cfg.num_layers
    W, S = windows.shape
    scored = W * (S - 1)
    batches = [windows[i : i + batch_size] for i in range(0, W, batch_size)]
    t0 = time.perf_counter()
    evals = {c: (compressing(L, c, wire), start) for c, start in _evaluations(L).items()}
    base, nll, done, cache_bytes = cached_nll(model, batches, evals, progress, desc=f"profiling {wire}")
    nll[frozenset()] = base
    baseline = math.exp(base / scored)

    def ppl(points: frozenset[int]) -> float:
        return math.exp(nll[points] / scored)

    points = []
    for k in range(2 * L):
        p_prog, p_next = ppl(frozenset(range(k, 2 * L))), ppl(frozenset(range(k + 1, 2 * L)))
        p_iso = ppl(frozenset({k}))
        points.append(PointSensitivity(k, p_prog - p_next, p_iso - baseline, p_prog, p_iso))
    return CompressionProfile(str(wire), baseline, points, W, S, done, cache_bytes, time.perf_counter() - t0)
