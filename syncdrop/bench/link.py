"""Slow-link *emulation*: make every collective cost what a ring over ``N`` ranks costs on a link.

This is emulation, not a network simulator: after the real collective returns (the device
synchronised first), the caller waits what the collective would take on a ring of ``N`` ranks
joined by a link of per-step latency ``alpha`` (``--link-latency``) and bandwidth ``beta``
(``--link-bandwidth``)::

    all-reduce of n bytes (each rank's tensor):   T_ar(n, N) = 2 (N - 1) alpha + 2 (N - 1) / N * n / beta
    all-gather of N slices of s bytes (n = N s):  T_ag(n, N) = (N - 1) alpha + (N - 1) / N * n / beta

(a ring all-reduce is a reduce-scatter and an all-gather, ``N - 1`` steps each, every step moving
``n / N`` bytes; one rank: 0). :func:`~syncdrop.bench.ring.ring_all_reduce_s` and
:func:`~syncdrop.bench.ring.ring_all_gather_s` (in the torch-free :mod:`syncdrop.bench.ring`) are the
only place these formulas live: the cost model (:mod:`syncdrop.bench.cost_model`) uses them for
the real link and for the emulated one, so prediction and emulation cannot drift apart.

The wait sleeps until ~0.2 ms before the deadline, then spins, which is accurate to a few
microseconds on an idle core (plain ``time.sleep`` overshoots by 50-100 us). Use it to ask "what
if our ranks talked over a link of this speed?" on one machine.
"""

from __future__ import annotations

import time

import torch

from syncdrop.bench.ring import (  # noqa: F401  (re-exported: the link's facts live in ring.py)
    FORMULAS,
    Link,
    check_within_timeout,
    parse_bandwidth,
    parse_latency,
    ring_all_gather_s,
    ring_all_reduce_s,
)
from syncdrop.parallel.comm import CommWrapper
from syncdrop.parallel.device import synchronize

SPIN_S = 2e-4


def wait(seconds: float) -> None:
    """Wait precisely: sleep until ``SPIN_S`` before the deadline, then spin."""
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class EmulatedLinkComm(CommWrapper):
    """Wraps a communicator of ``N = inner.tp`` ranks; each all-reduce then waits
    :meth:`Link.all_reduce_s` of one rank's tensor and each logits all-gather :meth:`Link.all_gather_s`
    of the gathered result (``N`` slices padded to the largest, as :class:`DistComm` gathers). The
    device is synchronised first, so that the wait starts when the collective has really finished
    (on CUDA the call returns as soon as it is queued). Partial reduces go through :meth:`all_reduce`
    and pay for the ``k`` channels they send; broadcasts (tokens) are not delayed."""

    def __init__(self, inner, link: Link) -> None:
        super().__init__(inner)
        self.link = link
        self.waited_s = 0.0

    def _delay(self, out: torch.Tensor, seconds: float) -> None:
        synchronize(out.device)
        wait(seconds)
        self.waited_s += seconds

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        out = self.inner.all_gather_last(x, sizes)
        rows = x.numel() // max(1, x.shape[-1])  # (..., n) -> rows of the gathered matrix
        self._delay(out, self.link.all_gather_s(rows * max(sizes) * len(sizes) * x.element_size(), self.tp))
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.all_reduce(x)
        per_rank = x.numel() * x.element_size() // max(1, x.shape[0])  # (R, M, h): one rank's (M, h)
        self._delay(out, self.link.all_reduce_s(per_rank, self.tp))
        return out
