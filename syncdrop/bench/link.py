"""Slow-link *emulation*: make every collective cost ``latency + bytes / bandwidth`` extra.

This is emulation, not a network simulator: after the real collective returns, the caller waits
``latency + payload_bytes / bandwidth`` more, where the payload is the tensor handed to the
all-reduce on this rank. The wait sleeps until ~0.2 ms before the deadline, then spins, which is
accurate to a few microseconds on an idle core (plain ``time.sleep`` overshoots by 50-100 us).
Use it to ask "what if our ranks talked over a link of this speed?" on one machine; the cost
model (:mod:`syncdrop.bench.cost_model`) answers the same question for clusters analytically.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Link:
    """An emulated link: ``bandwidth`` in bytes/s (None = infinite), ``latency`` in seconds."""

    bandwidth: float | None = None
    latency: float = 0.0

    def delay(self, nbytes: int) -> float:
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)

    @property
    def active(self) -> bool:
        return self.bandwidth is not None or self.latency > 0

    def describe(self) -> str:
        if not self.active:
            return "no emulation"
        bw = f"{self.bandwidth / 1e6:.0f} MB/s" if self.bandwidth else "inf bandwidth"
        return f"{bw}, {self.latency * 1e6:.0f} us"

    def to_dict(self) -> dict:
        return {"bandwidth_Bps": self.bandwidth, "latency_s": self.latency}


def wait(seconds: float) -> None:
    """Wait precisely: sleep until ``SPIN_S`` before the deadline, then spin."""
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class EmulatedLinkComm(CommWrapper):
    """Wraps a communicator; each all-reduce and logits all-gather then waits ``link.delay(payload
    bytes)`` more, where the payload is one rank's share of the tensor handed to it. The device is
    synchronised first, so that the wait starts when the collective has really finished (on CUDA
    the call returns as soon as it is queued). Partial reduces and broadcasts go through the inner
    communicator's path; a partial reduce pays for the ``k`` channels it sends, through
    :meth:`all_reduce`."""

    def __init__(self, inner, link: Link) -> None:
        super().__init__(inner)
        self.link = link
        self.waited_s = 0.0

    def _delay(self, out: torch.Tensor, nbytes: int) -> None:
        synchronize(out.device)
        d = self.link.delay(nbytes)
        wait(d)
        self.waited_s += d

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Vocab-parallel logits gather (partial-sync plans), delayed by the payload one rank sends: its
        slice padded to the largest, ``rows x max(sizes)`` elements (what :class:`DistComm` gathers)."""
        out = self.inner.all_gather_last(x, sizes)
        rows = x.numel() // max(1, x.shape[-1])  # (..., n) -> rows of the gathered matrix
        self._delay(out, rows * max(sizes) * x.element_size())
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.all_reduce(x)
        self._delay(out, x.numel() * x.element_size() // max(1, x.shape[0]))  # one rank's payload
        return out
