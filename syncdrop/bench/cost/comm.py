"""Cost of the sync points of one forward: a ring all-reduce on the real link, plus an emulated one.

One all-reduce of ``n`` bytes per rank over ``N`` ranks (ring algorithm, alpha-beta model)::

    T_ring(n, N) = 2 (N - 1) * alpha + 2 (N - 1) / N * n / beta      (N = 1: 0)

``alpha`` = per-step latency (s), ``beta`` = link bandwidth (bytes/s). A ring all-reduce is a
reduce-scatter plus an all-gather, ``N - 1`` steps each, every step moving ``n / N`` bytes. An
*emulated* slow link (:mod:`syncdrop.bench.link`) adds, after the real collective, the same ring
formula on the emulated link (``alpha`` = ``--link-latency``, ``beta`` = ``--link-bandwidth``; one
function, :func:`syncdrop.bench.ring.ring_all_reduce_s`, serves both, and
:class:`syncdrop.bench.ring.Link` also reads the ``flat`` formula of files from before the ring)::

    T_emu(n, N) = 2 (N - 1) * latency + 2 (N - 1) / N * n / bandwidth

A sync point inside a forward can cost more than an isolated all-reduce: ranks drift apart between
sync points (uneven shards, OS scheduling on a shared CPU) and the early rank waits. The model
carries that as a fixed ``t_sync`` per sync point (0 for clusters)::

    T_ar = T_ring + T_emu + t_sync

A forward's ``n_ar`` collectives (the plan's ``collectives_per_forward``; a partial sync is one
collective) carry ``u`` full payloads (``comm_units(h)``: ``k/h`` per partial sync). ``T_ar`` is
affine in the payload, so they cost ``n_ar * T_ar(0) + u * (T_ar(n) - T_ar(0))``, which is
``n_ar * T_ar(n)`` when no sync is partial (``u = n_ar``).

A sync point with a low-bit wire format (:mod:`syncdrop.plan.wire`) also encodes and decodes its payload on
the ranks' own cores: ``c`` payloads of ``n`` bytes per forward (``SyncPlan.codec_units(h)``) cost
``c * (t_codec0 + n * t_codec)`` more (a fixed cost per encoded point, and seconds per payload byte), both
fitted on un-emulated runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from syncdrop.bench.ring import Link, ring_all_reduce_s


@dataclass(frozen=True)
class CommModel:
    """Ring all-reduce over a link (``alpha`` s per step, ``beta`` bytes/s), an optional emulated
    link, and ``sync_s``: a fixed extra cost per sync point *inside a forward* (ranks that drift
    apart between sync points wait for each other there; 0 on a cluster, fitted on a loaded CPU)."""

    alpha: float
    beta: float
    emu_bandwidth: float | None = None
    emu_latency: float = 0.0
    sync_s: float = 0.0
    emu_formula: str = "ring"
    codec_s: float = 0.0  # encode + decode of a compressed sync point: fixed part
    codec_s_per_byte: float = 0.0  # and per byte of its payload

    @property
    def emulated_link(self) -> Link:
        """The emulated link: exactly what :class:`~syncdrop.bench.link.EmulatedLinkComm` waits
        (``emu_formula="flat"``: files written before the ring emulation)."""
        return Link(self.emu_bandwidth, self.emu_latency, self.emu_formula)

    def collective(self, n_bytes: float, n_ranks: int) -> float:
        """One isolated all-reduce: ``T_ring + T_emu`` (what the bench's all-reduce timing measures)."""
        t = ring_all_reduce_s(n_bytes, n_ranks, self.alpha, self.beta)
        if n_ranks > 1:
            t += self.emulated_link.all_reduce_s(n_bytes, n_ranks)
        return t

    def allreduce(self, n_bytes: float, n_ranks: int) -> float:
        """One sync point of a forward: ``T_ring + T_emu + sync_s`` (0 for one rank)."""
        return self.collective(n_bytes, n_ranks) + (self.sync_s if n_ranks > 1 else 0.0)

    def forward(self, n_bytes: float, n_ranks: int, collectives: int, units: float | None = None,
                in_forward: bool = True, codec_units: float = 0.0) -> float:
        """The collectives of one forward: ``collectives`` sync points whose payloads sum to ``units``
        full payloads of ``n_bytes`` (default ``units = collectives``: none partial). ``T_ar`` is
        affine in bytes, so this is ``collectives * T(0) + units * (T(n) - T(0))`` with ``T`` =
        :meth:`allreduce` (or :meth:`collective`, without the per-sync cost, when not ``in_forward``);
        plus ``codec_units * (codec_s + n_bytes * codec_s_per_byte)`` in a forward with ``n_ranks > 1``."""
        t = self.allreduce if in_forward else self.collective
        codec = codec_units * (self.codec_s + n_bytes * self.codec_s_per_byte) if in_forward and n_ranks > 1 else 0.0
        if units is None or units == collectives:
            return collectives * t(n_bytes, n_ranks) + codec
        fixed = t(0.0, n_ranks)
        return collectives * fixed + units * (t(n_bytes, n_ranks) - fixed) + codec

    def with_emulation(self, bandwidth: float | None, latency: float, formula: str = "ring") -> CommModel:
        """This model with the emulated link ``bandwidth``/``latency`` (a bench file's ``settings.link``)."""
        return dataclasses.replace(self, emu_bandwidth=bandwidth, emu_latency=latency, emu_formula=formula)
