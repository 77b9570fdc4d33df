"""Slow-link *emulation*: make every collective cost what a ring over ``N`` ranks costs on a link.

This is emulation, not a network simulator: after the real collective returns (the device
synchronised first), the caller waits what the collective would take on a ring of ``N`` ranks
joined by a link of per-step latency ``alpha`` (``--link-latency``) and bandwidth ``beta``
(``--link-bandwidth``)::

    all-reduce of n bytes (each rank's tensor):   T_ar(n, N) = 2 (N - 1) alpha + 2 (N - 1) / N * n / beta
    all-gather of N slices of s bytes (n = N s):  T_ag(n, N) = (N - 1) alpha + (N - 1) / N * n / beta

(a ring all-reduce is a reduce-scatter and an all-gather, ``N - 1`` steps each, every step moving
``n / N`` bytes; one rank: 0). :func:`ring_all_reduce_s` and :func:`ring_all_gather_s` are the
only place these formulas live: the cost model (:mod:`syncdrop.bench.cost_model`) uses them for
the real link and for the emulated one, so prediction and emulation cannot drift apart.

The wait sleeps until ~0.2 ms before the deadline, then spins, which is accurate to a few
microseconds on an idle core (plain ``time.sleep`` overshoots by 50-100 us). Use it to ask "what
if our ranks talked over a link of this speed?" on one machine.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch

from syncdrop.errors import SyncdropError
from syncdrop.parallel.comm import CommWrapper
from syncdrop.parallel.device import synchronize

_UNITS_BYTES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_UNITS_BITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_UNITS_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
SPIN_S = 2e-4


def parse_bandwidth(text: str) -> float:
    """``'1GB/s'``, ``'250MB/s'``, ``'10Gbit/s'``, ``'1.5GiB/s'`` -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([a-zA-Zµ]+)(?:/s|ps)?\s*", text)
    unit = m.group(2).lower() if m else ""
    scale = _UNITS_BYTES.get(unit) or _UNITS_BITS.get(unit)
    if not m or scale is None or float(m.group(1)) <= 0:
        raise SyncdropError(f"--link-bandwidth {text!r}: expected a positive rate like 1GB/s, 250MB/s or 10Gbit/s")
    return float(m.group(1)) * scale


def parse_latency(text: str) -> float:
    """``'50us'``, ``'1ms'``, ``'0'`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([a-zA-Zµ]*)\s*", text)
    unit = (m.group(2) or "s").lower() if m else ""
    if not m or unit not in _UNITS_TIME:
        raise SyncdropError(f"--link-latency {text!r}: expected a duration like 50us, 1ms or 0")
    return float(m.group(1)) * _UNITS_TIME[unit]


def ring_all_reduce_s(n_bytes: float, n_ranks: int, alpha: float, beta: float | None) -> float:
    """``2(N-1) alpha + 2(N-1)/N * n_bytes / beta`` seconds (``beta`` None or inf: no bandwidth term);
    0 for one rank. ``n_bytes``: the tensor each rank hands to the all-reduce."""
    if n_ranks <= 1:
        return 0.0
    steps = n_ranks - 1
    return 2 * steps * alpha + (2 * steps / n_ranks * n_bytes / beta if beta and math.isfinite(beta) else 0.0)


def ring_all_gather_s(n_bytes: float, n_ranks: int, alpha: float, beta: float | None) -> float:
    """``(N-1) alpha + (N-1)/N * n_bytes / beta`` seconds, ``n_bytes`` = the gathered result (``N``
    slices); 0 for one rank."""
    if n_ranks <= 1:
        return 0.0
    steps = n_ranks - 1
    return steps * alpha + (steps / n_ranks * n_bytes / beta if beta and math.isfinite(beta) else 0.0)


FORMULAS = ("ring", "flat")


@dataclass(frozen=True)
class Link:
    """An emulated link: ``bandwidth`` in bytes/s (None = infinite), ``latency`` = the per-step
    latency ``alpha`` of the ring, in seconds.

    ``formula``: ``ring`` (the emulation: the formulas of the module docstring); ``flat`` only reads
    result files written before the ring emulation existed (their ``link`` has no ``formula``), which
    waited ``latency + one rank's bytes / bandwidth`` per all-reduce whatever ``N``, so that their
    predictions stay comparable with what they measured."""

    bandwidth: float | None = None
    latency: float = 0.0
    formula: str = "ring"

    def __post_init__(self) -> None:
        if self.formula not in FORMULAS:
            raise SyncdropError(f"link formula must be one of {', '.join(FORMULAS)}, got {self.formula!r}")

    @classmethod
    def from_dict(cls, d: dict | None) -> Link:
        """The link a result file's ``settings.link`` records (``{}`` or None: no emulation)."""
        d = d or {}
        bw = d.get("bandwidth_Bps")
        return cls(float(bw) if bw else None, float(d.get("latency_s") or 0.0), d.get("formula", "flat"))

    def all_reduce_s(self, n_bytes: float, n_ranks: int) -> float:
        """The emulated time of one all-reduce of ``n_bytes`` per rank over ``n_ranks``."""
        if self.formula == "flat":
            return 0.0 if n_ranks <= 1 else self.latency + (n_bytes / self.bandwidth if self.bandwidth else 0.0)
        return ring_all_reduce_s(n_bytes, n_ranks, self.latency, self.bandwidth)

    def all_gather_s(self, n_bytes: float, n_ranks: int) -> float:
        """The emulated time of one all-gather whose result is ``n_bytes`` (``n_ranks`` slices)."""
        if self.formula == "flat":
            return 0.0 if n_ranks <= 1 else self.latency + (n_bytes / n_ranks / self.bandwidth if self.bandwidth
                                                             else 0.0)
        return ring_all_gather_s(n_bytes, n_ranks, self.latency, self.bandwidth)

    @property
    def active(self) -> bool:
        return self.bandwidth is not None or self.latency > 0

    def describe(self) -> str:
        if not self.active:
            return "no emulation"
        bw = f"{self.bandwidth / 1e6:.0f} MB/s" if self.bandwidth else "inf bandwidth"
        return f"{bw}, {self.latency * 1e6:.0f} us"

    def to_dict(self) -> dict:
        return {"bandwidth_Bps": self.bandwidth, "latency_s": self.latency, "formula": self.formula}


def check_within_timeout(link: Link, n_bytes: float, n_ranks: int, timeout_s: float) -> None:
    """Refuse a link on which one all-reduce of ``n_bytes`` per rank would be emulated as taking at
    least the collective timeout: every such wait is a rank that looks dead to the others."""
    delay = link.all_reduce_s(n_bytes, n_ranks)
    if delay >= timeout_s:
        raise SyncdropError(f"--link-bandwidth/--link-latency: one all-reduce of {n_bytes:.0f} bytes over {n_ranks} "
                            f"ranks would wait {delay:.3g} s on this link, not less than --dist-timeout "
                            f"{timeout_s:g} s; use a faster link, a shorter prompt or a longer --dist-timeout")


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
