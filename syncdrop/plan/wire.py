"""Low-bit wire formats for an all-reduce, and the two-step all-reduce that carries them.

A :class:`WireFormat` encodes float values in groups of ``G`` contiguous channels of one token into
bytes and decodes them back to float32:

========= ============================================================ ===================
format    one group of ``G`` values on the wire                          bytes per group
========= ============================================================ ===================
``bf16``  the values in bfloat16 (no scale)                              ``2 G``
``fp8``   ``x / s`` in float8 e4m3, ``s = max|x| / 448`` in bfloat16      ``G + 2``
``int8``  ``round(x / s)`` in ``[-127, 127]``, ``s = max|x| / 127``       ``G + 2``
``int4``  ``round(x / s)`` in ``[-7, 7]``, two per byte, ``s = max|x|/7`` ``G / 2 + 2``
========= ============================================================ ===================

``int8h`` and ``int4h`` rotate each group by the normalised ``G``-point Hadamard matrix before quantising
(``H x``, ``H = H_G / sqrt(G)`` of Sylvester's construction, orthonormal and its own inverse) and back after
dequantising: the rotation spreads a group's outliers over all its values, so the scale follows the group's
norm instead of its largest value (QuaRot, arXiv:2404.00456; used for low-bit all-reduce in arXiv:2411.09510).
The same bytes as ``int8`` / ``int4``; ``G`` a power of two. The rotation is a fast Walsh-Hadamard transform of
``log2 G`` add/subtract stages, elementwise, so its bits do not depend on how many groups are transformed at
once (the simulated and the distributed executor agree bit for bit).

Scales are symmetric, one per group, stored in bfloat16 (float32's range: no overflow or underflow
of the scale); the values are quantised with the stored (rounded) scale and clamped, so that
``decode(encode(x))`` is what the receiver sees. An all-zero group has scale 1.

**The two-step all-reduce** (arXiv:2412.04964) of row-parallel partials ``y_r`` ``(M, h)`` over ``N``
ranks, its groups split into ``N`` chunks of ``k`` groups (zero-padded to ``N k``)::

    1. every rank encodes its y_r and sends chunk c to rank c         (all-to-all, N - 1 steps)
    2. rank c decodes the N chunks c and sums them in rank order:      s_c = D(E(y_0)_c) + ... + D(E(y_{N-1})_c)
    3. rank c encodes s_c and every rank gathers all chunks           (all-gather, N - 1 steps)
    4. every rank decodes:                                            out = concat_c D(E(s_c))

Sums are in float32 and in rank order, and quantisation is local to a group, so the result does not
depend on how groups fall into chunks: the simulated executor (all ranks on one rank axis) and the
distributed runtime (one rank per process) give the same bits. Each rank hands ``E``'s bytes of its
``(M, h)`` partial to step 1 and of the sum to step 3: the ring all-reduce's ``2 (N - 1)`` steps and
``2 (N - 1) / N`` of the encoded bytes (:func:`syncdrop.bench.ring.ring_all_reduce_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from syncdrop.errors import SyncdropError

if TYPE_CHECKING:
    import torch

WIRE_FORMATS = ("bf16", "fp8", "int8", "int4", "int8h", "int4h")
DEFAULT_GROUP = 64
_QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
_ROTATED = {"int8h": "int8", "int4h": "int4"}  # a Hadamard-rotated format -> the format of its values


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``(..., G)`` -> ``(..., G)``: each group times ``H_G / sqrt(G)`` (Sylvester's Hadamard matrix, symmetric,
    so the map is its own inverse), by ``log2 G`` butterfly stages: stage ``h`` replaces each pair
    ``(a, b)`` of values ``h`` apart within a block of ``2h`` by ``(a + b, a - b)``.

    The stages run on the groups transposed, ``(G, n)`` for ``n`` groups, so that each add and subtract
    sweeps ``h n`` contiguous values instead of ``h`` (long vector operations rather than short strided ones);
    every value sees the same float32 operations either way, so the bits do not depend on the layout."""
    import torch

    G = x.shape[-1]
    n = x.numel() // G
    t = x.reshape(n, G).t().clone(memory_format=torch.contiguous_format)  # (G, n): a copy, never the caller's
    out = torch.empty_like(t)  # the stages write into it, then the two buffers swap
    h = 1
    while h < G:
        y, o = t.view(G // (2 * h), 2, h, n), out.view(G // (2 * h), 2, h, n)  # (blocks, 2, h, n)
        torch.add(y[:, 0], y[:, 1], out=o[:, 0])
        torch.sub(y[:, 0], y[:, 1], out=o[:, 1])
        t, out = out, t
        h *= 2
    return (t * (1.0 / math.sqrt(G))).t().reshape(x.shape)  # (G, n) -> (..., G)


_SCALE_BYTES = 2  # bfloat16


class Exchanges(Protocol):
    """What the two-step all-reduce needs of a communicator (:class:`syncdrop.parallel.comm.Communicator`)."""

    tp: int

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class WireFormat:
    """A wire format (one of :data:`WIRE_FORMATS`) with groups of ``group`` channels (see the module docstring)."""

    fmt: str
    group: int = DEFAULT_GROUP
    formats: ClassVar[tuple[str, ...]] = WIRE_FORMATS

    def __post_init__(self) -> None:
        if self.fmt not in WIRE_FORMATS:
            raise SyncdropError(f"wire format must be one of {', '.join(WIRE_FORMATS)}, got {self.fmt!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 2 or self.group % 2:
            raise SyncdropError(f"wire group size must be an even integer of at least 2, got {self.group!r}")
        if self.rotated and self.group & (self.group - 1):
            raise SyncdropError(f"wire format {self.fmt} rotates groups by a Hadamard matrix: the group size must be "
                                f"a power of two, got {self.group}")

    @property
    def rotated(self) -> bool:
        """True for the Hadamard-rotated formats (``int8h``, ``int4h``)."""
        return self.fmt in _ROTATED

    @property
    def values(self) -> str:
        """The format of the values on the wire: ``int4`` for ``int4h``, else the format itself."""
        return _ROTATED.get(self.fmt, self.fmt)

    @property
    def bits(self) -> int:
        return 16 if self.values == "bf16" else 4 if self.values == "int4" else 8

    @property
    def group_bytes(self) -> int:
        """Bytes of one encoded group: values plus its scale."""
        return self.group * self.bits // 8 + (0 if self.fmt == "bf16" else _SCALE_BYTES)

    def encoded_bytes(self, elements: int) -> int:
        """Bytes of ``elements`` values (a multiple of the group size) on the wire."""
        return elements // self.group * self.group_bytes

    def two_step_bytes(self, elements: int, ranks: int) -> int:
        """Bytes one rank hands to the two-step's exchange (and the gathered result's size) for an
        ``elements``-value partial: its groups padded to a multiple of ``ranks``."""
        groups = -(-elements // self.group)
        return -(-groups // ranks) * ranks * self.group_bytes

    def check(self, hidden: int) -> None:
        """Refuse a group size that does not divide the hidden size, or a format this torch lacks."""
        if hidden % self.group:
            raise SyncdropError(f"wire group size {self.group} does not divide the hidden size {hidden}; "
                                f"use a divisor, e.g. {math.gcd(hidden, DEFAULT_GROUP)}")
        if self.fmt == "fp8":
            import torch

            if not hasattr(torch, "float8_e4m3fn"):
                raise SyncdropError(f"wire format fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")

    def __str__(self) -> str:
        return self.fmt if self.group == DEFAULT_GROUP else f"{self.fmt}:g{self.group}"

    # ---- codec ----
    def encode(self, g: torch.Tensor) -> torch.Tensor:
        """``(..., G)`` float groups -> ``(..., group_bytes)`` uint8."""
        import torch

        if self.fmt == "bf16":
            return g.to(torch.bfloat16).contiguous().view(torch.uint8)  # (..., 2G)
        if self.rotated:  # the bytes carry no gradient (a straight-through caller adds the plain sum's)
            g = hadamard(g.detach().float())
        fmt = self.values
        qmax = _QMAX[fmt]
        amax = g.abs().amax(-1, keepdim=True).float()  # (..., 1)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).to(torch.bfloat16)  # stored scale
        x = (g.float() / scale.float()).clamp(-qmax, qmax)  # (..., G)
        if fmt == "fp8":
            vals = x.to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            q = torch.round(x).to(torch.int8)  # half to even
            if fmt == "int8":
                vals = q.view(torch.uint8)
            else:  # int4: q + 8 in [1, 15], two per byte, even index in the low nibble
                u = (q + 8).to(torch.uint8).reshape(*q.shape[:-1], -1, 2)  # (..., G/2, 2)
                vals = u[..., 0] | (u[..., 1] << 4)  # (..., G/2)
        return torch.cat([vals, scale.view(torch.uint8)], dim=-1)  # (..., group_bytes)

    def decode(self, b: torch.Tensor) -> torch.Tensor:
        """``(..., group_bytes)`` uint8 -> ``(..., G)`` float32."""
        import torch

        if self.fmt == "bf16":
            return b.contiguous().view(torch.bfloat16).float()
        n = self.group_bytes - _SCALE_BYTES
        scale = b[..., n:].contiguous().view(torch.bfloat16).float()  # (..., 1)
        vals = b[..., :n].contiguous()
        fmt = self.values
        if fmt == "fp8":
            x = vals.view(torch.float8_e4m3fn).float()
        elif fmt == "int8":
            x = vals.view(torch.int8).float()
        else:
            pair = torch.stack([vals & 15, vals >> 4], dim=-1)  # (..., G/2, 2)
            x = pair.reshape(*vals.shape[:-1], self.group).to(torch.int8).float() - 8.0
        return hadamard(x * scale) if self.rotated else x * scale

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``D(E(x))`` of ``(..., h)`` values (``h`` a multiple of the group), in float32."""
        g = x.reshape(*x.shape[:-1], -1, self.group)  # (..., h / G, G)
        return self.decode(self.encode(g)).reshape(x.shape)

    # ---- the collective ----
    def two_step(self, comm: Exchanges, y: torch.Tensor) -> torch.Tensor:
        """The two-step all-reduce (module docstring) of partials ``y`` ``(R, M, h)`` (R = local ranks)
        -> ``(1, M, h)`` in ``y``'s dtype."""
        import torch

        R, M, h = y.shape
        n = comm.tp
        if n == 1:
            return y
        if h % self.group:
            self.check(h)
        groups = M * h // self.group
        k = -(-groups // n)  # groups per chunk
        g = y.reshape(R, groups, self.group)  # (R, groups, G)
        if n * k > groups:
            g = torch.nn.functional.pad(g, (0, 0, 0, n * k - groups))  # (R, N k, G)
        B = self.group_bytes
        recv = comm.all_to_all(self.encode(g).reshape(R, n, k * B))  # (R, N, k B): chunk c of every rank
        parts = self.decode(recv.reshape(R, n, k, B))  # (R, N, k, G)
        s = parts[:, 0]
        for r in range(1, n):  # rank order, float32
            s = s + parts[:, r]  # (R, k, G)
        every = comm.all_gather(self.encode(s).reshape(R, k * B))  # (1, N, k B)
        out = self.decode(every.reshape(1, n * k, B))[:, :groups]  # (1, groups, G)
        return out.reshape(1, M, h).to(y.dtype)


def parse_wire(text: str, where: str = "wire") -> WireFormat:
    """``int8``, ``int4:g32``, ``fp8``, ``bf16`` -> a :class:`WireFormat`."""
    fmt, _, rest = text.strip().partition(":")
    group = DEFAULT_GROUP
    if rest:
        if not (rest.startswith("g") and rest[1:].isdigit()):
            raise SyncdropError(f"{where} {text!r}: expected FORMAT or FORMAT:gG, e.g. int4:g32")
        group = int(rest[1:])
    try:
        return WireFormat(fmt, group)
    except SyncdropError as e:
        raise SyncdropError(f"{where} {text!r}: {e.message}") from None
