"""Communicators: the one protocol through which tensor-parallel ranks talk, and the only thing that
differs between the simulated and the distributed executor.

Every communicator is a :class:`Communicator`:

* ``all_reduce(x)``: rank partials ``(R, M, h)`` (R = local ranks) -> their sum over all N ranks,
  ``(1, M, h)``;
* ``all_gather_last(x, sizes)``: the local ranks' slices ``(..., sum of local sizes)`` ->
  every rank's slice concatenated in rank order ``(..., sum(sizes))`` (vocab-parallel logits);
* ``broadcast(x)``: rank 0's ``x`` on every rank;
* ``all_to_all(x)``: ``(R, N, X)`` -> ``(R, N, X)``, entry ``r`` of rank ``c``'s result is entry ``c``
  of rank ``r``'s input;
* ``all_gather(x)``: ``(R, X)`` -> ``(1, N, X)``, every rank's ``x`` in rank order;
* ``compressed_all_reduce(y, wire)``: ``(R, M, h)`` -> ``(1, M, h)``, the two-step all-reduce of a
  :class:`~syncdrop.plan.wire.WireFormat` (written with the two collectives above), as one sync point;
* ``barrier()``: wait for every rank;
* ``generator(device)``: a random generator on ``device`` that every rank seeds and advances
  identically (the random channel masks of the ``mask: random`` ablation).

What a sync point sends is decided by its sync mode (:mod:`syncdrop.plan.modes`), written in terms of
``all_reduce`` and ``generator`` alone, so a wrapper that delays or differentiates the all-reduce
changes every mode alike.

Implementations: :class:`SimulatedComm` (all N ranks in this process on a leading rank axis),
:class:`syncdrop.parallel.dist.DistComm` (one rank per process, ``torch.distributed``), and the
wrappers :class:`syncdrop.bench.link.EmulatedLinkComm` (slow-link emulation) and
:class:`syncdrop.caat.grad_comm.GradComm` (differentiable collectives), which derive from
:class:`CommWrapper`. Nothing outside them asks whether the ranks are simulated.
"""

from __future__ import annotations

import torch

MASK_SEED = 0  # seed of the random-mask generator (the same on every rank)


class Communicator:
    """The collective operations of ``tp`` tensor-parallel ranks (see the module docstring)."""

    tp: int
    calls: int  # all-reduces issued (for accounting in tests and benchmarks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, M, h)`` local partials -> ``(1, M, h)`` sum over all N ranks."""
        raise NotImplementedError

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The local ranks' slices ``(..., sum of local sizes)`` -> all ranks' ``(..., sum(sizes))``."""
        raise NotImplementedError

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (e.g. sampled tokens, so every rank continues identically)."""
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, N, X)`` -> ``(R, N, X)``: rank ``c`` receives entry ``c`` of every rank, in rank order."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, X)`` -> ``(1, N, X)``: every rank's ``x``, in rank order, on every rank."""
        raise NotImplementedError

    def compressed_all_reduce(self, y: torch.Tensor, wire) -> torch.Tensor:
        """``(R, M, h)`` partials -> ``(1, M, h)``: the two-step all-reduce with ``wire``'s format
        (:meth:`syncdrop.plan.wire.WireFormat.two_step`), counted as one call."""
        self.calls += 1
        return wire.two_step(self, y)

    def barrier(self) -> None:
        """Return once every rank has called it."""
        raise NotImplementedError

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``x`` over the ranks (bookkeeping, e.g. the slowest rank's time
        of each sync point; not model traffic, so no link emulation delays it)."""
        raise NotImplementedError

    def generator(self, device: torch.device) -> torch.Generator:
        """This communicator's random generator on ``device``, seeded with :data:`MASK_SEED` at first
        use; every rank draws the same numbers from it as long as every rank draws alike."""
        gens = self.__dict__.setdefault("_generators", {})
        key = str(torch.device(device))
        if key not in gens:
            gens[key] = torch.Generator(device=device).manual_seed(MASK_SEED)
        return gens[key]


class SimulatedComm(Communicator):
    """All N ranks live in this process on a leading rank axis; all-reduce is a sum over it."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, M, h)`` partials -> ``(1, M, h)``."""
        self.calls += 1
        if x.shape[0] == 1 and self.tp > 1:
            raise ValueError("all_reduce got a replicated tensor; partials must carry all N ranks")
        return x.sum(0, keepdim=True)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's slice is already here, in rank order."""
        if x.shape[-1] != sum(sizes):
            raise ValueError(f"all_gather_last: the simulated ranks hold {x.shape[-1]} columns, not {sum(sizes)}")
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return x  # one process: rank 0's value is the value

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous()  # (N_src, N_dst, X) -> (N_dst, N_src, X)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.tp:
            raise ValueError(f"all_gather: the simulated ranks hold {x.shape[0]} rows, not {self.tp}")
        return x.unsqueeze(0)  # (N, X) -> (1, N, X)

    def compressed_all_reduce(self, y: torch.Tensor, wire) -> torch.Tensor:
        """The two-step all-reduce; under autograd its gradient is the plain sum's (straight-through:
        the value is the compressed sum's, bit for bit)."""
        if y.shape[0] != self.tp:
            raise ValueError("compressed_all_reduce got a replicated tensor; partials must carry all N ranks")
        out = super().compressed_all_reduce(y, wire)
        if y.requires_grad and torch.is_grad_enabled():
            s = y.sum(0, keepdim=True)
            out = out.detach() + (s - s.detach())
        return out

    def barrier(self) -> None:
        return None

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return x  # one process holds every rank: what it measured is the whole


class CommWrapper(Communicator):
    """A communicator that adds behaviour to ``inner``'s collectives; by default it forwards all of
    them. Every sync mode goes through this wrapper's ``all_reduce``; the random-mask
    generator is ``inner``'s, so wrapping never changes which channels are drawn."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.tp = inner.tp

    @property
    def calls(self) -> int:  # type: ignore[override]
        return self.inner.calls

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.all_reduce(x)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self.inner.all_gather_last(x, sizes)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.broadcast(x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.all_to_all(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.all_gather(x)

    def compressed_all_reduce(self, y: torch.Tensor, wire) -> torch.Tensor:
        return self.inner.compressed_all_reduce(y, wire)

    def barrier(self) -> None:
        self.inner.barrier()

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.max_over_ranks(x)

    def generator(self, device: torch.device) -> torch.Generator:
        return self.inner.generator(device)
