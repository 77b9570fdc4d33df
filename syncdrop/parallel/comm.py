"""Communicators: the one protocol through which tensor-parallel ranks talk, and the only thing that
differs between the simulated and the distributed executor.

Every communicator is a :class:`Communicator`:

* ``all_reduce(x)``: rank partials ``(R, M, h)`` (R = local ranks) -> their sum over all N ranks,
  ``(1, M, h)``;
* ``partial_reduce(y, k, b, scale, mask)``: CAAT-Net's partial channel reduce, written once here
  in terms of ``all_reduce`` and ``generator`` (so a wrapper that delays or differentiates the
  all-reduce changes the partial reduce alike);
* ``all_gather_last(x, sizes)``: the local ranks' slices ``(..., sum of local sizes)`` ->
  every rank's slice concatenated in rank order ``(..., sum(sizes))`` (vocab-parallel logits);
* ``broadcast(x)``: rank 0's ``x`` on every rank;
* ``barrier()``: wait for every rank;
* ``generator(device)``: a random generator on ``device`` that every rank seeds and advances
  identically (the random channel masks of the ``mask: random`` ablation).

Implementations: :class:`SimulatedComm` (all N ranks in this process on a leading rank axis),
:class:`syncdrop.parallel.dist.DistComm` (one rank per process, ``torch.distributed``), and the
wrappers :class:`syncdrop.bench.link.EmulatedLinkComm` (slow-link emulation) and
:class:`syncdrop.caat.grad_comm.GradComm` (differentiable collectives), which derive from
:class:`CommWrapper`. Nothing outside them asks whether the ranks are simulated.
"""

from __future__ import annotations

import math

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

    def partial_reduce(self, y: torch.Tensor, k: int, b: torch.Tensor | None, scale: bool = True,
                       mask: str = "fixed") -> torch.Tensor:
        """CAAT-Net's partial channel reduce of row-parallel partials ``y`` ``(R, M, h)`` (docs/methods.md):

        ``out_r = concat(AllReduce(y[..., :k]) + b[:k],  sqrt(N) * (y_r[..., k:] + b[k:]))``

        The first ``k`` channels are shared (summed over all N ranks, so equal everywhere), the others
        private: each rank keeps its own, scaled by sqrt(N). The bias is added once, after the sum and
        before the scaling. Returns ``(R, M, h)`` (``(1, M, h)`` when ``k == h``: an ordinary all-reduce).
        Only ``k`` channels travel: the all-reduce payload is ``k / h`` of a full one.

        Ablations (:class:`~syncdrop.plan.Partial`): ``scale=False`` keeps private channels unscaled;
        ``mask="random"`` shares a fresh random set of ``k`` channels per call (drawn on ``y``'s device
        from :meth:`generator`, so every rank draws the same set); ``mask="topk"`` lets each rank
        share, per token, its own ``k`` largest-magnitude channels (a masked all-reduce of all ``h``
        channels; a channel's sum holds only the ranks that chose it).
        """
        h = y.shape[-1]
        s = math.sqrt(self.tp) if scale else 1.0
        if mask == "fixed" and k >= h:
            return _add(self.all_reduce(y), b)
        yb = _add(y, b)  # each rank's value with the bias; private channels are these, scaled
        if mask == "topk":
            if k == 0:
                return yb * s
            m = torch.zeros_like(y, dtype=torch.bool).scatter_(-1, yb.abs().topk(k, dim=-1).indices, True)
            shared = _add(self.all_reduce(torch.where(m, y, torch.zeros_like(y))), b)  # bias once, after the sum
            return torch.where(m, shared.expand_as(y), yb * s)
        out = yb * s
        if k == 0:
            return out
        if mask == "fixed":  # the first k channels: slices, no index tensors
            shared = _add(self.all_reduce(y[..., :k]), None if b is None else b[:k])  # (1, M, k): only k travel
            return torch.cat([shared.expand(y.shape[0], -1, -1), out[..., k:]], dim=-1)
        if mask != "random":
            raise ValueError(f"unknown partial-sync mask {mask!r}")
        idx = torch.randperm(h, generator=self.generator(y.device), device=y.device)[:k]  # (k,) on y's device
        shared = self.all_reduce(y.index_select(-1, idx))  # (1, M, k): only k channels travel
        if b is not None:
            shared = shared + b[idx]
        return out.index_copy(-1, idx, shared.expand(y.shape[0], -1, -1))


def _add(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x if b is None else x + b


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

    def barrier(self) -> None:
        return None

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return x  # one process holds every rank: what it measured is the whole


class CommWrapper(Communicator):
    """A communicator that adds behaviour to ``inner``'s collectives; by default it forwards all of
    them. ``partial_reduce`` (inherited) goes through this wrapper's ``all_reduce``; the random-mask
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

    def barrier(self) -> None:
        self.inner.barrier()

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.max_over_ranks(x)

    def generator(self, device: torch.device) -> torch.Generator:
        return self.inner.generator(device)
