"""Partial sync (CAAT-Net): a sync point that sums only ``k = round(p h)`` channels and lets each rank
keep the others (docs/methods.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from syncdrop.errors import SyncdropError
from syncdrop.plan.base import Collectives, SyncMode, add_bias, sum_bias
from syncdrop.plan.wire import DEFAULT_GROUP, WireFormat

if TYPE_CHECKING:
    import torch

PARTIAL_MASKS = ("fixed", "random", "topk")


@dataclass(frozen=True)
class Partial(SyncMode):
    """CAAT-Net's partial channel reduce: ``k = round(p h)`` channels summed, the others kept per rank.

    ``out_r = concat(AllReduce(y[..., :k]) + b[:k],  sqrt(N) * (y_r[..., k:] + b[k:]))``

    ``mask``: which channels are shared: ``fixed`` (the first k, CAAT-Net), or the ablations
    ``random`` (a fresh random set of k per call, the same on every rank) and ``topk`` (per token,
    each rank shares its own k largest-magnitude channels). ``scale``: multiply private channels by
    sqrt(N) (CAAT-Net) or not (ablation). ``wire``: the shared channels travel compressed
    (:mod:`syncdrop.plan.wire`, groups of ``group`` channels; None: in the model's dtype). See
    :func:`partial_channel_reduce`.
    """

    p: float
    scale: bool = True
    mask: str = "fixed"
    wire: str | None = None
    group: int = DEFAULT_GROUP
    name: ClassVar[str] = "partial"

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 <= self.p <= 1:
            raise SyncdropError(f"partial fraction must be a number in [0, 1], got {self.p!r}")
        if not isinstance(self.scale, bool) or self.mask not in PARTIAL_MASKS:
            raise SyncdropError(f"partial sync: scale must be true/false and mask one of {', '.join(PARTIAL_MASKS)}")
        object.__setattr__(self, "p", float(self.p))
        if self.wire is not None:
            self.codec  # noqa: B018  (validates the format and the group size)

    @property
    def codec(self) -> WireFormat | None:
        return None if self.wire is None else WireFormat(self.wire, self.group)

    def wire_bytes(self, tokens: int, hidden: int, element_size: int) -> int:
        sent = round(self.payload(hidden) * hidden)
        return tokens * (sent * element_size if self.codec is None else self.codec.encoded_bytes(sent))

    def check(self, hidden: int) -> None:
        if self.codec is None:
            return
        self.codec.check(hidden)
        k = self.channels(hidden)
        if self.mask != "topk" and k % self.group:
            raise SyncdropError(f"wire group size {self.group} does not divide the {k} shared channels of partial "
                                f"{self.p:g} (hidden size {hidden})")

    def channels(self, hidden: int) -> int:
        return round(self.p * hidden)

    def payload(self, hidden: int) -> float:
        """``k / h``; the ``topk`` mask all-reduces all ``h`` channels (unshared ones zeroed): 1, or 0
        when ``k = 0``."""
        k = self.channels(hidden)
        return (1.0 if k > 0 else 0.0) if self.mask == "topk" else k / hidden

    @property
    def issues_collective(self) -> bool:
        return self.p > 0

    @property
    def diverges(self) -> bool:
        return self.p < 1

    @property
    def private_channels(self) -> bool:
        return True

    def vllm_blocker(self) -> str | None:
        return ("partial-sync (CAAT-Net) plans are not served: each rank carries its own residual stream "
                "(private channels) into a vocab-parallel LM head, while vLLM's layers carry one "
                "replicated residual per token")

    def to_json(self) -> Any:
        d: dict[str, Any] = {"partial": self.p}
        if not self.scale:
            d["scale"] = False
        if self.mask != "fixed":
            d["mask"] = self.mask
        if self.wire is not None:
            d["wire"] = self.wire
            if self.group != DEFAULT_GROUP:
                d["group"] = self.group
        return d

    def __str__(self) -> str:
        return f"partial:{self.p:g}" + ("" if self.codec is None else f"+{self.codec}")

    def reduce(self, comm: Collectives, y: torch.Tensor, x: torch.Tensor, *biases: torch.Tensor | None) -> torch.Tensor:
        b = sum_bias(*biases)  # one bias, added once after the sum and before the private scaling
        return x + partial_channel_reduce(comm, y, self.channels(y.shape[-1]), b, self.scale, self.mask, self.codec)


def partial_channel_reduce(comm: Collectives, y: torch.Tensor, k: int, b: torch.Tensor | None, scale: bool = True,
                           mask: str = "fixed", wire: WireFormat | None = None) -> torch.Tensor:
    """CAAT-Net's partial channel reduce of row-parallel partials ``y`` ``(R, M, h)`` (docs/methods.md):

    ``out_r = concat(AllReduce(y[..., :k]) + b[:k],  sqrt(N) * (y_r[..., k:] + b[k:]))``

    The first ``k`` channels are shared (summed over all N ranks, so equal everywhere), the others
    private: each rank keeps its own, scaled by sqrt(N). The bias is added once, after the sum and
    before the scaling. Returns ``(R, M, h)`` (``(1, M, h)`` when ``k == h``: an ordinary all-reduce).
    Only ``k`` channels travel: the all-reduce payload is ``k / h`` of a full one.

    Ablations: ``scale=False`` keeps private channels unscaled; ``mask="random"`` shares a fresh
    random set of ``k`` channels per call (drawn on ``y``'s device from ``comm.generator``, so every
    rank draws the same set); ``mask="topk"`` lets each rank share, per token, its own ``k``
    largest-magnitude channels (a masked all-reduce of all ``h`` channels; a channel's sum holds only
    the ranks that chose it). ``wire``: the shared channels' all-reduce is the two-step compressed one.
    """
    import torch

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(t) if wire is None else comm.compressed_all_reduce(t.contiguous(), wire)

    h = y.shape[-1]
    s = math.sqrt(comm.tp) if scale else 1.0
    if mask == "fixed" and k >= h:
        return add_bias(all_reduce(y), b)
    yb = add_bias(y, b)  # each rank's value with the bias; private channels are these, scaled
    if mask == "topk":
        if k == 0:
            return yb * s
        m = torch.zeros_like(y, dtype=torch.bool).scatter_(-1, yb.abs().topk(k, dim=-1).indices, True)
        shared = add_bias(all_reduce(torch.where(m, y, torch.zeros_like(y))), b)  # bias once, after the sum
        return torch.where(m, shared.expand_as(y), yb * s)
    out = yb * s
    if k == 0:
        return out
    if mask == "fixed":  # the first k channels: slices, no index tensors
        shared = add_bias(all_reduce(y[..., :k]), None if b is None else b[:k])  # (1, M, k): only k travel
        return torch.cat([shared.expand(y.shape[0], -1, -1), out[..., k:]], dim=-1)
    if mask != "random":
        raise SyncdropError(f"unknown partial-sync mask {mask!r}")
    idx = torch.randperm(h, generator=comm.generator(y.device), device=y.device)[:k]  # (k,) on y's device
    shared = all_reduce(y.index_select(-1, idx))  # (1, M, k): only k channels travel
    if b is not None:
        shared = shared + b[idx]
    return out.index_copy(-1, idx, shared.expand(y.shape[0], -1, -1))
