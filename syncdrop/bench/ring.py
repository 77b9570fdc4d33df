"""The link facts without torch: ring collective times, the emulated :class:`Link`, and flag parsing.

A ring over ``N`` ranks joined by a link of per-step latency ``alpha`` and bandwidth ``beta``::

    all-reduce of n bytes (each rank's tensor):   T_ar(n, N) = 2 (N - 1) alpha + 2 (N - 1) / N * n / beta
    all-gather of N slices of s bytes (n = N s):  T_ag(n, N) = (N - 1) alpha + (N - 1) / N * n / beta

(a ring all-reduce is a reduce-scatter and an all-gather, ``N - 1`` steps each, every step moving
``n / N`` bytes; one rank: 0). The link emulation (:mod:`syncdrop.bench.link`) waits these on the
emulated link and the cost model (:mod:`syncdrop.bench.cost.comm`) predicts with them, on the real
link and the emulated one, so the two cannot drift apart. Kept free of torch so that the CLI's
parser and the cost model import it cheaply.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from syncdrop.errors import SyncdropError

_UNITS_BYTES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_UNITS_BITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_UNITS_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


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


def parse_link(text: str) -> Link:
    """One link of ``--links``: ``none`` (no emulation), ``BANDWIDTH``, ``BANDWIDTH+LATENCY`` or
    ``inf+LATENCY`` (e.g. ``100MB/s+50us``)."""
    t = text.strip()
    if t.lower() == "none":
        return Link()
    bw_text, _, lat_text = t.partition("+")
    try:
        bw = None if bw_text.strip().lower() == "inf" else parse_bandwidth(bw_text)
        lat = parse_latency(lat_text) if lat_text.strip() else 0.0
    except SyncdropError:
        raise SyncdropError(f"--links {text!r}: expected none, BANDWIDTH, BANDWIDTH+LATENCY or inf+LATENCY "
                            "(e.g. 100MB/s+50us)") from None
    return Link(bw, lat)


def parse_links(text: str) -> list[tuple[str, Link]]:
    """``--links none,inf+50us,100MB/s+50us`` -> ``[(label, Link), ...]`` (labels as given, distinct)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SyncdropError("--links: expected a comma-separated list like none,100MB/s+50us, got nothing")
    out = [(t, parse_link(t)) for t in items]
    for i, (label, link) in enumerate(out):
        for other, prev in out[:i]:
            if _same(link, prev):
                raise SyncdropError(f"--links: {label!r} is the same link as {other!r}")
    return out


def _same(a: Link, b: Link) -> bool:
    return (a.bandwidth is None) == (b.bandwidth is None) and math.isclose(a.bandwidth or 0, b.bandwidth or 0) \
        and math.isclose(a.latency, b.latency, abs_tol=1e-12)


def link_slug(label: str) -> str:
    """A file-name part for a ``--links`` label: ``100MB/s+50us`` -> ``100MBps+50us``."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "", label.replace("/s", "ps"))


def check_within_timeout(link: Link, n_bytes: float, n_ranks: int, timeout_s: float) -> None:
    """Refuse a link on which one all-reduce of ``n_bytes`` per rank would be emulated as taking at
    least the collective timeout: every such wait is a rank that looks dead to the others."""
    delay = link.all_reduce_s(n_bytes, n_ranks)
    if delay >= timeout_s:
        raise SyncdropError(f"--link-bandwidth/--link-latency: one all-reduce of {n_bytes:.0f} bytes over {n_ranks} "
                            f"ranks would wait {delay:.3g} s on this link, not less than --dist-timeout "
                            f"{timeout_s:g} s; use a faster link, a shorter prompt or a longer --dist-timeout")
