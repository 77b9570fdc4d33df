"""Latency of one forward: the slowest rank's compute plus the collectives it waits at.

::

    T_forward = T_compute(work) + n_ar * T_ar(0) + u * (T_ar(n) - T_ar(0))      (:meth:`CommModel.forward`)

with the payload ``n = B * S * h * bytes_per_element`` in prefill (TTFT) and ``B * h *
bytes_per_element`` per decode step. The counts come from the plan
(:class:`~syncdrop.plan.SyncPlan`): ``n_ar`` = ``collectives_per_forward``, ``u`` = ``comm_units(h)``
(default ``u = n_ar``: no partial sync). ``comm_units(h, dtype_bytes)`` counts bytes, so a compressed
sync point (:class:`~syncdrop.plan.Compressed`) weighs its encoded bytes (values and scales) over the
dtype's; its encode and decode compute is not modelled (the bench's sync clock measures it).
Each block all-reduces after attention and after the MLP and
an SPD block drops the first, so an SPD fraction ``f`` of ``L`` blocks has ``n_ar = 2 L - round(f L)``.
"""

from __future__ import annotations

from syncdrop.bench.cost.comm import CommModel
from syncdrop.bench.cost.compute import ComputeModel, decode_work, prefill_work
from syncdrop.models.config import ModelConfig


def predict_ttft(cfg: ModelConfig, n_ranks: int, seq: int, n_allreduce: int, compute: ComputeModel,
                 comm: CommModel, batch: int = 1, dtype_bytes: int = 4, lm_head_parallel: bool = False,
                 comm_units: float | None = None, codec_units: float = 0.0) -> float:
    """Seconds to first token: prefill compute + ``n_allreduce`` all-reduces of ``(B*S, h)`` whose
    payloads sum to ``comm_units`` full ones (default: ``n_allreduce``, no partial sync), ``codec_units`` of
    them encoded (:meth:`CommModel.forward`)."""
    work = prefill_work(cfg, n_ranks, seq, batch, dtype_bytes, lm_head_parallel)
    payload = batch * seq * cfg.hidden_size * dtype_bytes
    return compute.time(work) + comm.forward(payload, n_ranks, n_allreduce, comm_units, codec_units=codec_units)


def predict_decode(cfg: ModelConfig, n_ranks: int, context: int, n_allreduce: int, compute: ComputeModel,
                   comm: CommModel, batch: int = 1, dtype_bytes: int = 4, lm_head_parallel: bool = False,
                   comm_units: float | None = None, codec_units: float = 0.0) -> float:
    """Seconds per decode step at ``context`` keys: compute + ``n_allreduce`` all-reduces of ``(B, h)``
    whose payloads sum to ``comm_units`` full ones (default: ``n_allreduce``)."""
    work = decode_work(cfg, n_ranks, context, batch, dtype_bytes, lm_head_parallel)
    payload = batch * cfg.hidden_size * dtype_bytes
    return compute.time(work) + comm.forward(payload, n_ranks, n_allreduce, comm_units, codec_units=codec_units)
