"""Calibration of the CPU cost model on ``syncdrop bench`` files run *without* link emulation.

1. ``alpha, beta`` from the all-reduce medians (``(bytes, N, seconds)`` of every payload timed). With
   ``x1 = 2(N-1)``, ``x2 = 2(N-1)/N * bytes`` the ring model is linear, ``T = alpha x1 + x2 / beta``;
   each row is divided by its measured time so small and large payloads weigh alike, and the
   coefficients are non-negative least squares, clamped to :data:`ALPHA_BOUNDS` / :data:`BETA_BOUNDS`.
2. ``1 / F_eff``, ``t_layer`` and ``t_sync`` by non-negative relative least squares over every plan's
   TTFT and decode step of those files::

       T_measured - n_ar * T_ring = FLOPs / F_eff + L t_layer + n_ar t_sync + c (t_codec0 + n t_codec)

   (``c``: the payloads a plan's compressed sync points encode, ``SyncPlan.codec_units``, ``n`` the payload
   bytes; the two codec terms are fitted only when some plan compresses)

   (``n_ar * T_ring`` becomes the plan's collectives at their ring cost when some syncs are partial;
   plans differ in ``n_ar``, prefill and decode in FLOPs, which is what separates the three).

Predictions for emulated-link files (:mod:`.check`) then add ``T_emu`` per all-reduce; nothing is
fitted on the emulated runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from syncdrop.bench.cost.bench_files import BenchRun
from syncdrop.bench.cost.comm import CommModel
from syncdrop.bench.cost.compute import ComputeModel, Work, decode_work, prefill_work
from syncdrop.errors import SyncdropError


def _nnls(X: list[list[float]], y: list[float]) -> list[float]:
    """``argmin ||X c - y||^2`` subject to ``c >= 0`` (exhaustive over the sets of free coefficients;
    fine for the 2-3 unknowns here)."""
    import numpy as np

    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    k = A.shape[1]
    best, best_sse = np.zeros(k), float(b @ b)
    for mask in range(1, 2**k):
        idx = [j for j in range(k) if mask >> j & 1]
        sub = A[:, idx]
        if np.linalg.matrix_rank(sub) < len(idx):
            continue
        c = np.linalg.lstsq(sub, b, rcond=None)[0]
        if (c < 0).any():
            continue
        full = np.zeros(k)
        full[idx] = c
        sse = float(((A @ full - b) ** 2).sum())
        if sse < best_sse * (1 - 1e-12):
            best, best_sse = full, sse
    return [float(v) for v in best]


ALPHA_BOUNDS = (0.0, 0.1)  # seconds per ring step
BETA_BOUNDS = (1e5, 1e13)  # bytes per second: 100 kB/s to 10 TB/s
MIN_PAYLOAD_SIZES = 3


def fit_alpha_beta(points: list[tuple[float, int, float]]) -> tuple[float, float, list[str]]:
    """``alpha, beta`` of the ring model from ``(bytes, N, seconds)`` samples, relative least squares,
    within :data:`ALPHA_BOUNDS` / :data:`BETA_BOUNDS`, and the notes that say when the fit degenerates.

    At least :data:`MIN_PAYLOAD_SIZES` distinct payloads are needed to test the line (two determine it
    exactly, whatever the truth); a time that does not grow with the payload puts everything into
    alpha (``1 / beta`` fitted as 0: beta at its upper bound), and one that is all bandwidth puts
    alpha at 0. Each of these is a note, not an error: the caller reports them.
    """
    rows = [(2 * (n - 1) / t, 2 * (n - 1) / n * b / t) for b, n, t in points if n > 1 and t > 0]
    if not rows:
        raise SyncdropError("--calibrate: no all-reduce timings with more than one rank to fit alpha/beta")
    notes = []
    sizes = len({b for b, n, _ in points if n > 1})
    if sizes < MIN_PAYLOAD_SIZES:
        notes.append(f"alpha/beta from {sizes} payload size(s): fewer than {MIN_PAYLOAD_SIZES}, so the fit cannot "
                     "be checked (bench files from before the payload sweep)")
    alpha, inv_beta = _nnls([list(r) for r in rows], [1.0] * len(rows))
    beta = 1.0 / inv_beta if inv_beta > 0 else math.inf
    if not beta <= BETA_BOUNDS[1]:
        notes.append(f"the all-reduce time does not grow with the payload: beta is set to its bound "
                     f"{BETA_BOUNDS[1]:.0e} B/s and alpha carries all of it (degenerate fit)")
        beta = BETA_BOUNDS[1]
    elif beta < BETA_BOUNDS[0]:
        notes.append(f"beta {beta:.3g} B/s is below its bound {BETA_BOUNDS[0]:.0e} B/s (degenerate fit)")
        beta = BETA_BOUNDS[0]
    if alpha <= ALPHA_BOUNDS[0]:
        notes.append("alpha is 0: the all-reduce time is all bandwidth (degenerate fit)")
    elif alpha > ALPHA_BOUNDS[1]:
        notes.append(f"alpha {alpha:.3g} s is above its bound {ALPHA_BOUNDS[1]} s (degenerate fit)")
        alpha = ALPHA_BOUNDS[1]
    return alpha, beta, notes


@dataclass(frozen=True)
class ComputePoint:
    """One measured forward: its work, its sync points, the ring time of one full-payload one, the
    seconds; ``comm_s``: the ring time of all its collectives when some are partial (default
    ``n_allreduce * ring_s``)."""

    work: Work
    n_allreduce: int
    ring_s: float
    measured_s: float
    comm_s: float | None = None
    codec_units: float = 0.0  # payloads encoded per forward (compressed sync points)
    payload_bytes: float = 0.0  # bytes of one full sync-point payload

    @property
    def ring_total_s(self) -> float:
        return self.n_allreduce * self.ring_s if self.comm_s is None else self.comm_s


def fit_compute(points: list[ComputePoint], fit_overhead: bool = True,
                fit_sync: bool = True) -> tuple[ComputeModel, float, tuple[float, float]]:
    """``(ComputeModel(F_eff, t_layer), sync_s, (codec_s, codec_s_per_byte))`` by relative non-negative
    least squares on

    ``T_measured - n_ar * T_ring = FLOPs * (1/F_eff) + L * t_layer + n_ar * sync_s
    + c * (codec_s + n * codec_s_per_byte)``.

    ``t_layer`` is fitted only when the FLOP counts differ (prefill and decode points, or several
    prompt lengths) and ``fit_overhead``; ``sync_s`` only when the sync-point counts differ (several
    plans) and ``fit_sync``; the codec terms only when some point encodes (``c > 0``): when points without a
    codec are there too, the other terms are fitted on those alone and the codec terms on what the compressed
    points' times leave (a joint fit can trade the compute rate for the codec's per-byte term, which grows
    with the payload as FLOPs do).
    """
    pts = [p for p in points if p.measured_s > 0]
    if not pts:
        raise SyncdropError("--calibrate: no measured forwards to fit the compute rate")
    plain = [p for p in pts if p.codec_units == 0]
    coded = [p for p in pts if p.codec_units > 0]
    if coded and plain:  # compute and sync on the plans without a codec, then the codec on what is left
        compute, sync, _ = fit_compute(plain, fit_overhead, fit_sync)
        rest = [(p, p.measured_s - p.ring_total_s - compute.time(p.work) - p.n_allreduce * sync) for p in coded]
        codec = _nnls([[p.codec_units / p.measured_s, p.codec_units * p.payload_bytes / p.measured_s]
                       for p, _ in rest], [r / p.measured_s for p, r in rest])
        return compute, sync, (codec[0], codec[1])
    use_o = fit_overhead and len({round(p.work.flops) for p in pts}) > 1
    use_s = fit_sync and len({p.n_allreduce for p in pts}) > 1
    X = [[p.work.flops / p.measured_s, (p.work.layers if use_o else 0.0) / p.measured_s,
          (p.n_allreduce if use_s else 0.0) / p.measured_s,
          *([p.codec_units / p.measured_s, p.codec_units * p.payload_bytes / p.measured_s] if coded else [])]
         for p in pts]
    y = [(p.measured_s - p.ring_total_s) / p.measured_s for p in pts]
    inv_f, o, sync, *codec = _nnls(X, y)
    if inv_f <= 0:
        raise SyncdropError("--calibrate: could not fit a positive compute rate (all-reduces explain "
                            "all the measured time?)")
    return ComputeModel(1.0 / inv_f, o), sync, (codec[0], codec[1]) if codec else (0.0, 0.0)


@dataclass(frozen=True)
class Calibration:
    """A CPU cost model fitted to bench files without link emulation."""

    alpha: float
    beta: float
    sync_s: float
    compute: ComputeModel
    files: tuple[str, ...]
    allreduce_points: int
    compute_points: int
    fit_notes: tuple[str, ...] = ()
    codec_s: float = 0.0  # per compressed sync point (encode + decode), fixed part
    codec_s_per_byte: float = 0.0  # and per byte of its payload

    @property
    def comm(self) -> CommModel:
        return CommModel(self.alpha, self.beta, sync_s=self.sync_s, codec_s=self.codec_s,
                         codec_s_per_byte=self.codec_s_per_byte)

    def to_dict(self) -> dict[str, Any]:
        return {"files": list(self.files), "alpha_s": self.alpha, "beta_Bps": self.beta,
                "sync_overhead_s": self.sync_s, "flops_per_s": self.compute.flops_per_s,
                "layer_overhead_s": self.compute.layer_overhead_s,
                "allreduce_points": self.allreduce_points, "compute_points": self.compute_points,
                "codec_s": self.codec_s, "codec_s_per_byte": self.codec_s_per_byte,
                "fit_notes": list(self.fit_notes)}


def calibrate(runs: list[BenchRun], fit_overhead: bool = True, fit_sync: bool = True,
              use_decode: bool = True) -> Calibration:
    """Fit ``alpha, beta`` then the compute model (and per-sync-point overhead) to un-emulated runs:
    every plan's TTFT, and its decode step when ``use_decode`` (see the module docstring)."""
    if not runs:
        raise SyncdropError("--calibrate: give at least one bench file")
    for r in runs:
        if r.emulated:
            raise SyncdropError(f"--calibrate {r.path!r}: was run with link emulation ({r.link_label}); "
                                "calibrate on runs without --link-bandwidth/--link-latency")
    ar_pts = [(b, r.tp, t) for r in runs for b, t in r.allreduce_sizes]
    alpha, beta, notes = fit_alpha_beta(ar_pts)
    comm = CommModel(alpha, beta)
    pts: list[ComputePoint] = []
    for r in runs:
        b_pre = r.batch * r.prompt_len * r.cfg.hidden_size * r.dtype_bytes
        b_dec = r.batch * r.cfg.hidden_size * r.dtype_bytes
        t_pre, t_dec = comm.collective(b_pre, r.tp), comm.collective(b_dec, r.tp)
        for p in r.plans:
            n, u, vp, c = p["allreduces_per_forward"], p["comm_units"], p["vocab_gather"], p["codec_units"]
            pre = prefill_work(r.cfg, r.tp, r.prompt_len, r.batch, r.dtype_bytes, vp)
            pts.append(ComputePoint(pre, n, t_pre, p["ttft_s"], comm.forward(b_pre, r.tp, n, u, in_forward=False),
                                    c, b_pre))
            if use_decode and r.decode_tokens >= 1:
                dec = decode_work(r.cfg, r.tp, round(r.decode_context), r.batch, r.dtype_bytes, vp)
                pts.append(ComputePoint(dec, n, t_dec, p["decode_s"],
                                        comm.forward(b_dec, r.tp, n, u, in_forward=False), c, b_dec))
    compute, sync, (codec_s, codec_b) = fit_compute(pts, fit_overhead, fit_sync)
    return Calibration(alpha, beta, sync, compute, tuple(r.path for r in runs), len(ar_pts), len(pts), tuple(notes),
                       codec_s, codec_b)
