"""Time every sync point inside a forward: the saving a plan can at most realise, measured where it happens.

An isolated all-reduce timed right after a barrier is the cheapest a collective can be. A sync
point inside a forward also pays for the ranks arriving at different times (uneven shards, OS
scheduling) and for waking up the communication; dropping it saves all of that. So the ideal
saving of a plan is measured inside the baseline's own forward:

* :class:`SyncTimer` wraps the model's communicator for one instrumented generation and records,
  per collective on this rank, ``t_out - t_in`` (the device synchronised at both ends, so queued
  kernels are not counted and the collective has really finished): the time this rank spent in
  it, waiting for the slowest rank included;
* :func:`slowest_rank` takes, per collective, the maximum over the ranks (a sync point costs the
  forward what it costs its slowest participant);
* :func:`saving_weights` says how much of each baseline sync point a plan removes: 1 for a
  dropped one, ``1 - k/h`` for a partial one that sends ``k`` of ``h`` channels (a payload-weighted
  share), 0 for one it keeps. ``ideal saving = sum_j weight_j * t_j``.
"""

from __future__ import annotations

import time

import torch

from syncdrop.parallel.comm import Communicator, CommWrapper
from syncdrop.parallel.device import synchronize
from syncdrop.plan import SyncPlan


class SyncTimer(CommWrapper):
    """Records the seconds of every all-reduce (``"sync"``) and logits all-gather (``"gather"``)
    issued through it, in issue order, on this rank (``times``, ``kinds``)."""

    def __init__(self, inner: Communicator, device: torch.device) -> None:
        super().__init__(inner)
        self.device = device
        self.times: list[float] = []
        self.kinds: list[str] = []

    def _timed(self, kind: str, fn, *args):
        synchronize(self.device)
        t0 = time.perf_counter()
        out = fn(*args)
        synchronize(self.device)
        self.times.append(time.perf_counter() - t0)
        self.kinds.append(kind)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed("sync", self.inner.all_reduce, x)

    def compressed_all_reduce(self, y: torch.Tensor, wire) -> torch.Tensor:
        """Timed as one sync point: encoding, both exchanges, decoding and the sum."""
        return self._timed("sync", self.inner.compressed_all_reduce, y, wire)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self._timed("gather", self.inner.all_gather_last, x, sizes)


def slowest_rank(comm: Communicator, times: list[float], device: torch.device) -> list[float]:
    """Per entry, the maximum of ``times`` over the ranks (every rank passes the same length)."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    return comm.max_over_ranks(t).tolist()


def saving_weights(baseline: SyncPlan, plan: SyncPlan, hidden: int, element_size: int | None = None) -> list[float]:
    """Per sync point of ``baseline`` (its :meth:`~syncdrop.plan.SyncPlan.sync_points` order), the share
    of its time that ``plan`` saves at most: ``1 - payload_plan / payload_baseline``, clipped to [0, 1] (a
    point ``plan`` does not issue has payload 0). With ``element_size`` the payloads are bytes
    (:meth:`~syncdrop.plan.SyncPlan.point_bytes`), so a compressed point saves the share of bytes it does
    not send: an upper bound, since the link's per-step latency and the encoding do not shrink."""
    if element_size is None:
        kept = {(p.block, p.where): p.payload for p in plan.sync_points(hidden)}
        base = {(p.block, p.where): p.payload for p in baseline.sync_points(hidden)}
    else:
        kept, base = plan.point_bytes(hidden, element_size), baseline.point_bytes(hidden, element_size)
    return [min(1.0, max(0.0, 1.0 - kept.get(key, 0.0) / base[key])) for key in
            ((p.block, p.where) for p in baseline.sync_points(hidden))]
