"""A differentiable communicator for training in the distributed runtime.

``torch.distributed`` collectives are not recorded by autograd. These wrappers give the two the
block and the LM head use their exact backward (one process = one rank, residual streams may
differ per rank):

* all-reduce (a full sync point, or the shared channels of a partial one): ``out = sum_r y_r`` is
  read by every rank's own stream, so ``dL/dy_r = sum_r' dL/dout_r'``: the backward is an
  all-reduce of the output gradient. For a partial reduce the block all-reduces only
  ``y[..., :k]``, so only the shared channels' gradient travels; private channels stay local.
  Gradients are reduced in fp32.
* all-gather of vocab-parallel logits: every rank computes the same loss from the gathered
  logits, and rank r's parameters reach the loss only through its own slice, so the backward
  keeps this rank's slice of the gradient.

The simulated executor needs none of this: its collectives are sums over the rank axis, which
autograd differentiates exactly.
"""

from __future__ import annotations

import torch

from syncdrop.parallel.comm import CommWrapper


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return comm.all_reduce(x.clone())  # torch.distributed reduces in place

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        # a copy: autograd may hand the same gradient tensor to other branches (x + AllReduce(y))
        out = ctx.comm.all_reduce(g.to(torch.float32, copy=True).contiguous()).to(g.dtype)
        return out, None


class _CompressedAllReduce(torch.autograd.Function):
    """The two-step compressed all-reduce, differentiated straight through: the backward is the plain
    all-reduce's (an all-reduce of the output gradient, in fp32), as if the rounding were the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, wire) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return comm.compressed_all_reduce(x, wire)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        out = ctx.comm.all_reduce(g.to(torch.float32, copy=True).contiguous()).to(g.dtype)
        return out, None, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, sizes: list[int], rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.start, ctx.n = sum(sizes[:rank]), sizes[rank]
        return comm.all_gather_last(x, sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g[..., ctx.start : ctx.start + ctx.n], None, None, None


class GradComm(CommWrapper):
    """Wraps a :class:`~syncdrop.parallel.dist.DistComm` (one local rank) for training: its all-reduce
    and logits all-gather are differentiable; the partial reduce (inherited) uses that all-reduce."""

    def __init__(self, inner, rank: int) -> None:
        super().__init__(inner)
        self.rank = rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduce.apply(x, self.inner)

    def compressed_all_reduce(self, y: torch.Tensor, wire) -> torch.Tensor:
        return _CompressedAllReduce.apply(y, self.inner, wire)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return _GatherLast.apply(x, self.inner, sizes, self.rank)
