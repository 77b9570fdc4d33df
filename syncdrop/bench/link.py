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
only place these formulas live: the cost model (:mod:`syncdrop.bench.cost.comm`) uses them for
the real link and for the emulated one, so prediction and emulation cannot drift apart.

**How a rank waits.** When every local rank has a core of its own (:func:`ranks_have_own_cores`), the
wait spins: the rank holds its core as a rank whose peer is sending holds its device, and its next
compute starts on a warm core. Otherwise (more ranks than cores, e.g. TP=3 on 2 cores) spinning would
take the core from the rank that shares it, so the wait sleeps until ~0.2 ms before the deadline, then
spins; both are accurate to a few microseconds (plain ``time.sleep`` overshoots by 50-100 us). Sleeping
has a cost of its own that a link does not have: measured at TP=2 on a 136 MB/s link, each sync point
took 0.4 ms more than the un-emulated one plus the wait, and the compute between them 40 ms more per prefill
(``results/operating_point/tp2_sleep_wait/``, docs/cost_model.md), which the cost model, calibrated
without emulation, cannot predict. Use the emulation to ask "what if our ranks talked over a
link of this speed?" on one machine.
"""

from __future__ import annotations

import os
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


def wait(seconds: float, spin: bool = False) -> None:
    """Wait precisely: spin throughout (``spin``), or sleep until ``SPIN_S`` before the deadline, then spin."""
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_S and not spin:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        pass


def ranks_have_own_cores(local_ranks: int) -> bool:
    """True when this node's ``local_ranks`` processes can each have a core of their own."""
    return local_ranks <= (os.cpu_count() or 1)


class EmulatedLinkComm(CommWrapper):
    """Wraps a communicator of ``N = inner.tp`` ranks; each all-reduce then waits
    :meth:`Link.all_reduce_s` of one rank's tensor and each logits all-gather :meth:`Link.all_gather_s`
    of the gathered result (``N`` slices padded to the largest, as :class:`DistComm` gathers). The
    device is synchronised first, so that the wait starts when the collective has really finished
    (on CUDA the call returns as soon as it is queued). Partial reduces go through :meth:`all_reduce`
    and pay for the ``k`` channels they send; broadcasts (tokens) are not delayed. ``spin``: how the
    rank waits (see the module docstring)."""

    def __init__(self, inner, link: Link, spin: bool = False) -> None:
        super().__init__(inner)
        self.link, self.spin = link, spin
        self.waited_s = 0.0

    def _delay(self, out: torch.Tensor, seconds: float) -> None:
        if not self.link.active:  # switched off (``syncdrop bench --links none,...``): the bare collective
            return
        synchronize(out.device)
        wait(seconds, self.spin)
        self.waited_s += seconds

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        out = self.inner.all_gather_last(x, sizes)
        rows = x.numel() // max(1, x.shape[-1])  # (..., n) -> rows of the gathered matrix
        self._delay(out, self.link.all_gather_s(rows * max(sizes) * len(sizes) * x.element_size(), self.tp))
        return out

    def compressed_all_reduce(self, y: torch.Tensor, wire) -> torch.Tensor:
        """The two-step all-reduce, then the ring all-reduce's wait for its encoded bytes: the exchange
        and the gather are the reduce-scatter and all-gather halves, ``N - 1`` steps each, each moving
        ``(N - 1) / N`` of one rank's encoded partial (:meth:`~syncdrop.plan.wire.WireFormat.two_step_bytes`)."""
        out = self.inner.compressed_all_reduce(y, wire)
        per_rank = wire.two_step_bytes(y.numel() // max(1, y.shape[0]), self.tp)
        self._delay(out, self.link.all_reduce_s(per_rank, self.tp))
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.all_reduce(x)
        per_rank = x.numel() * x.element_size() // max(1, x.shape[0])  # (R, M, h): one rank's (M, h)
        self._delay(out, self.link.all_reduce_s(per_rank, self.tp))
        return out
