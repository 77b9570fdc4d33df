"""Sync modes: what one sync point of a transformer block does, one class per mode.

A block has two sync points, after attention (``attn``) and after the MLP (``mlp``). On rank ``r``
the row-parallel layers give bias-free partials ``P_r`` (o_proj, ``(R, M, h)``) and ``Z_r`` (down,
``(R, M, h)``); the block is (docs/methods.md)::

    H     = mlp_input(X, P_r, b_o)                 the residual the MLP reads
    Z_r   = MLP_r(norm(H))
    X_out = block_output(X, H, P_r, Z_r, b_o, b_down)

and the *attention* mode decides both lines. A mode that keeps its sync point (:class:`Full`,
:class:`Partial`) is a *reduce* ``X + Sync(Y_r) + b`` and may stand at either point; the drop
modes (:class:`Drop` and its ablations) remove the attention sync point and stand there only:

=============== ============================================ =============================================
mode            ``H`` (MLP input)                             ``X_out``
=============== ============================================ =============================================
``full``        ``X + AllReduce(P_r) + b_o``                  ``H + Sync_mlp(Z_r) + b_down``
partial ``p``   ``X + PartialReduce_k(P_r, b_o)``             ``H + Sync_mlp(Z_r) + b_down``
``drop`` (SPD)  ``X + P_r + b_o`` (rank-local)                ``X + Sync_mlp(P_r + Z_r) + b_o + b_down``
``naive``       ``X + P_r + b_o``                             ``H_r + AllReduce(Z_r) + b_down`` (ranks diverge)
``desync``      ``X + P_r + b_o``                             ``AllReduce(Z_r + H_r / N) + b_down``
``bias-in-sum`` ``X + P_r + b_o``                             ``X + AllReduce(P_r + b_o + Z_r + b_down)``
compressed      ``X + TwoStep(P_r) + b_o``                    ``H + Sync_mlp(Z_r) + b_down``
=============== ============================================ =============================================

``TwoStep`` is an all-reduce with a low-bit wire format (:mod:`syncdrop.plan.compressed`,
:mod:`syncdrop.plan.wire`); as the MLP sync point of a ``drop`` block it compresses the SPD block's one
all-reduce. Each mode also states its payload (what its sync point sends, as a fraction of a full ``(M, h)``
all-reduce, and in bytes), whether ranks' residual streams may differ after it, and whether vLLM's
plugin serves it (and why not). Adding a mode is one class here, registered with :func:`register`,
plus its tests: the plan, the block, the cost model and the CLI ask the mode, never its name.

The modes only use a communicator's ``tp``, ``all_reduce`` and ``generator`` (:class:`Collectives`);
they import nothing from :mod:`syncdrop.parallel`, so the plan stays below the executors, and the
package imports no torch until a mode computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from syncdrop.errors import SyncdropError
from syncdrop.plan.base import ATTN, MLP, Collectives, SyncMode, add_bias
from syncdrop.plan.compressed import Compressed, parse_compressed
from syncdrop.plan.partial import PARTIAL_MASKS, Partial, partial_channel_reduce
from syncdrop.plan.wire import DEFAULT_GROUP

if TYPE_CHECKING:
    import torch

__all__ = ["ATTN", "DROP", "FULL", "MLP", "PARTIAL_MASKS", "BiasInSum", "Collectives", "Compressed", "Desync", "Drop",
           "DropMode", "Full", "Naive", "Partial", "SyncMode", "add_bias", "drop_variants", "mode_named", "named_modes",
           "parse_mode", "partial_channel_reduce", "register"]

_REGISTRY: dict[str, SyncMode] = {}


def register(cls: type[SyncMode]) -> type[SyncMode]:
    """Make a named mode (one without settings) known to plans by its name."""
    _REGISTRY[cls.name] = cls()
    return cls


@register
@dataclass(frozen=True)
class Full(SyncMode):
    """The standard sync point: ``X + AllReduce(Y_r) + b``."""

    name: ClassVar[str] = "full"

    def payload(self, hidden: int) -> float:
        return 1.0

    def reduce(self, comm: Collectives, y: torch.Tensor, x: torch.Tensor, *biases: torch.Tensor | None) -> torch.Tensor:
        return add_bias(x + comm.all_reduce(y), *biases)


class DropMode(SyncMode):
    """A mode that removes the attention sync point: each rank's MLP reads its own ``H_r = X + P_r + b_o``
    and the block's one remaining collective (at the MLP point) carries what the mode sends."""

    points: ClassVar[tuple[str, ...]] = (ATTN,)
    drops: ClassVar[bool] = True

    def payload(self, hidden: int) -> float:
        return 0.0

    def mlp_input(self, comm: Collectives, x: torch.Tensor, p: torch.Tensor, b_o: torch.Tensor | None) -> torch.Tensor:
        return add_bias(x + p, b_o)  # (R, M, h): each rank's MLP sees only its own heads

    def combines_with(self, mlp: SyncMode) -> bool:
        return isinstance(mlp, Full)  # the ablations keep a full MLP all-reduce

    def vllm_blocker(self) -> str | None:
        return f"only the SPD drop block is served; {self.name!r} is an ablation variant"


@register
@dataclass(frozen=True)
class Drop(DropMode):
    """The SPD block: the attention partials ride in the MLP sync point, biases added once after it:
    ``X_out = X + Sync_mlp(P_r + Z_r) + b_o + b_down``. :meth:`fused` is that combination, the one
    definition vLLM's plugin uses too."""

    name: ClassVar[str] = "drop"

    @staticmethod
    def fused(p: torch.Tensor, z: torch.Tensor, b_o: torch.Tensor | None,
              b_down: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """What the SPD block's one sync point sums, ``P_r + Z_r``, and the biases added after it."""
        return p + z, (b_o, b_down)

    def combines_with(self, mlp: SyncMode) -> bool:
        return True  # any mode that may stand at the MLP point keeps that sync point

    def vllm_blocker(self) -> str | None:
        return None

    def block_output(self, comm: Collectives, x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, z: torch.Tensor,
                     b_o: torch.Tensor | None, b_down: torch.Tensor | None, mlp: SyncMode) -> torch.Tensor:
        y, biases = self.fused(p, z, b_o, b_down)
        return mlp.reduce(comm, y, x, *biases)


@register
@dataclass(frozen=True)
class Naive(DropMode):
    """Ablation: the attention partial is kept local, never summed: ``X_out_r = H_r + AllReduce(Z_r) + b_down``."""

    name: ClassVar[str] = "naive"

    @property
    def diverges(self) -> bool:
        return True

    def block_output(self, comm: Collectives, x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, z: torch.Tensor,
                     b_o: torch.Tensor | None, b_down: torch.Tensor | None, mlp: SyncMode) -> torch.Tensor:
        return mlp.reduce(comm, z, h, b_down)


@register
@dataclass(frozen=True)
class Desync(DropMode):
    """Ablation (Ladder-Residual's code): ``X_out = AllReduce(Z_r + H_r / N) + b_down``
    ``= X + (sum_r P_r) / N + b_o + sum_r Z_r + b_down``; re-syncs streams that differed before it."""

    name: ClassVar[str] = "desync"

    def block_output(self, comm: Collectives, x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, z: torch.Tensor,
                     b_o: torch.Tensor | None, b_down: torch.Tensor | None, mlp: SyncMode) -> torch.Tensor:
        return add_bias(comm.all_reduce(z + h / comm.tp), b_down)


@register
@dataclass(frozen=True)
class BiasInSum(DropMode):
    """Ablation: like ``drop`` with the biases inside the sum (counted N times):
    ``X_out = X + AllReduce(P_r + b_o + Z_r + b_down)``."""

    name: ClassVar[str] = "bias-in-sum"

    def block_output(self, comm: Collectives, x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, z: torch.Tensor,
                     b_o: torch.Tensor | None, b_down: torch.Tensor | None, mlp: SyncMode) -> torch.Tensor:
        return x + comm.all_reduce(add_bias(add_bias(p, b_o) + z, b_down))


FULL = _REGISTRY["full"]
DROP = _REGISTRY["drop"]


def named_modes(point: str | None = None) -> tuple[str, ...]:
    """The registered modes' names, those allowed at ``point`` when given."""
    return tuple(n for n, m in _REGISTRY.items() if point is None or point in m.points)


def drop_variants() -> tuple[str, ...]:
    """Names of the modes that remove the attention sync point (``drop`` and the ablations)."""
    return tuple(n for n, m in _REGISTRY.items() if m.drops)


def mode_named(name: str) -> SyncMode:
    """The registered mode called ``name``."""
    if name not in _REGISTRY:
        raise SyncdropError(f"unknown sync mode {name!r}; expected one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


MODE_FORMS = '{"partial": p} or {"wire": "int8"|"int4"|"int8h"|"int4h"|"fp8"|"bf16", "group": G}'


def parse_mode(v: Any, point: str, where: str) -> SyncMode:
    """A mode from its JSON form (a name, ``{"partial": p, "scale": bool, "mask": str}`` or ``{"wire": fmt,
    "group": G}``), checked to
    be allowed at ``point`` (``attn`` or ``mlp``); ``where`` names it in errors."""
    if isinstance(v, SyncMode):
        mode = v
    elif isinstance(v, str) and v in _REGISTRY:
        mode = _REGISTRY[v]
    elif isinstance(v, dict) and "partial" in v and set(v) <= {"partial", "scale", "mask", "wire", "group"}:
        try:
            mode = Partial(v["partial"], v.get("scale", True), v.get("mask", "fixed"), v.get("wire"),
                           v.get("group", DEFAULT_GROUP))
        except SyncdropError as e:
            raise SyncdropError(f"{where}: {e.message}") from None
    elif isinstance(v, dict) and "wire" in v and set(v) <= {"wire", "group"}:
        mode = parse_compressed(v, where)
    else:
        raise SyncdropError(f"{where}={v!r}; expected one of {', '.join(named_modes(point))}, {MODE_FORMS}")
    if point not in mode.points:
        raise SyncdropError(f"{where}={mode.to_json()!r}; expected one of {', '.join(named_modes(point))}, "
                            f"{MODE_FORMS}")
    return mode
