"""The sync-mode protocol: what one sync point of a block does (:class:`SyncMode`), and the small
helpers the modes share. The modes themselves are in :mod:`syncdrop.plan.modes` (and
:mod:`syncdrop.plan.partial`); the maths of each is in its class docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from syncdrop.errors import SyncdropError

if TYPE_CHECKING:  # torch-free at import: the CLI parses plans before it loads torch
    import torch

    from syncdrop.plan.wire import WireFormat

ATTN, MLP = "attn", "mlp"


class Collectives(Protocol):
    """What a sync mode needs of a communicator (:class:`syncdrop.parallel.comm.Communicator`)."""

    tp: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def generator(self, device: torch.device) -> torch.Generator: ...

    def compressed_all_reduce(self, y: torch.Tensor, wire: Any) -> torch.Tensor: ...


def add_bias(x: torch.Tensor, *biases: torch.Tensor | None) -> torch.Tensor:
    """``x + b_1 + b_2 + ...``, left to right, skipping absent biases."""
    for b in biases:
        if b is not None:
            x = x + b
    return x


def sum_bias(*biases: torch.Tensor | None) -> torch.Tensor | None:
    """One bias for several added after the same sum (``b_o + b_down``), or None when there is none."""
    present = [b for b in biases if b is not None]
    if not present:
        return None
    out = present[0]
    for b in present[1:]:
        out = out + b
    return out


class SyncMode:
    """One sync point's behaviour (see the module docstring). Subclasses are frozen dataclasses:
    equal modes compare equal and hash alike."""

    name: ClassVar[str]
    points: ClassVar[tuple[str, ...]] = (ATTN, MLP)  # where in a block the mode may stand
    drops: ClassVar[bool] = False  # the attention sync point is removed (an SPD-style block)

    # ---- facts the plan, the cost model and the serving engines ask ----
    def payload(self, hidden: int) -> float:
        """What this sync point sends, as a fraction of a full ``(M, h)`` all-reduce (0: nothing)."""
        raise NotImplementedError

    def wire_bytes(self, tokens: int, hidden: int, element_size: int) -> int:
        """Bytes each rank hands to the all-reduce at this point for ``tokens`` tokens (the ring then
        moves ``2 (N - 1) / N`` of them, :mod:`syncdrop.bench.ring`)."""
        return round(self.payload(hidden) * hidden) * tokens * element_size

    @property
    def issues_collective(self) -> bool:
        """True when this sync point issues a collective (whatever its payload; ``partial: 0`` none)."""
        return not self.drops

    @property
    def diverges(self) -> bool:
        """True when ranks' residual streams may differ after this point."""
        return False

    @property
    def codec(self) -> WireFormat | None:
        """The wire format this sync point's collective carries (:mod:`syncdrop.plan.wire`), or None: the
        values travel in the model's dtype (a plain all-reduce, or no collective at all)."""
        return None

    @property
    def private_channels(self) -> bool:
        """True when each rank keeps channels of its own (the LM head then becomes vocab-parallel)."""
        return False

    def check(self, hidden: int) -> None:
        """Raise :class:`SyncdropError` when this mode cannot run on a model of this hidden size."""

    def vllm_blocker(self) -> str | None:
        """Why vLLM's plugin (one replicated residual per token, :mod:`syncdrop.serve.vllm_models`)
        cannot serve this mode, or None when it can."""
        return None

    def combines_with(self, mlp: SyncMode) -> bool:
        """Whether this attention mode can be followed by ``mlp`` at the block's MLP point."""
        return True

    def to_json(self) -> Any:
        return self.name

    def __str__(self) -> str:
        return self.name

    # ---- block math ----
    def reduce(self, comm: Collectives, y: torch.Tensor, x: torch.Tensor, *biases: torch.Tensor | None) -> torch.Tensor:
        """``x + Sync(y) + biases`` for row-parallel partials ``y`` ``(R, M, h)``; modes that remove
        their sync point have none."""
        raise SyncdropError(f"sync mode {self.name!r} removes its sync point: it reduces nothing")

    def mlp_input(self, comm: Collectives, x: torch.Tensor, p: torch.Tensor, b_o: torch.Tensor | None) -> torch.Tensor:
        """The residual the MLP reads, ``H``, from the attention partials ``p`` ``(R, M, h)``."""
        return self.reduce(comm, p, x, b_o)

    def block_output(self, comm: Collectives, x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, z: torch.Tensor,
                     b_o: torch.Tensor | None, b_down: torch.Tensor | None, mlp: SyncMode) -> torch.Tensor:
        """``X_out`` from the block input ``x``, the MLP input ``h``, and the partials ``p``, ``z``."""
        return mlp.reduce(comm, z, h, b_down)
