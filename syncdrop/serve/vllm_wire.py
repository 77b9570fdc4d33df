"""The compressed sync point inside vLLM: the two-step low-bit all-reduce on vLLM's tensor-parallel group.

:func:`compressed_all_reduce` sums this rank's partial ``(T, h)`` over the tensor-parallel ranks with
:meth:`syncdrop.plan.wire.WireFormat.two_step`, the same code syncdrop's executors run (so the served sum
is the simulated executor's, bit for bit given the same partials). Its two exchanges, an all-to-all of
the encoded chunks and an all-gather of the encoded sums, are ``torch.distributed``'s
``all_to_all_single`` and ``all_gather_into_tensor`` on the group's ``device_group``, the process group
vLLM's own device collectives use (gloo on the CPU backend, NCCL on CUDA).

**Under vLLM's compilation** (Dynamo traces the forward once, ``fullgraph``) the sync point is one custom
op, ``syncdrop::tp_compressed_all_reduce(x, fmt, group)`` (:func:`torch.library.custom_op`, as
:mod:`syncdrop.serve.vllm_link` defines its collectives and vLLM its ``vllm::all_reduce``): Dynamo puts one
opaque call in the graph, its fake implementation gives the output's shape and dtype (``x``'s), and the
encode, exchange, decode and sum run eagerly inside it at every call. The op is defined when
:mod:`syncdrop.serve.vllm_models` is imported, in every vLLM worker.

**The emulated link and the sync clock** (:mod:`syncdrop.serve.vllm_link`, when the environment asks for
them) see the op as one all-reduce whose payload is the encoded partial, padded to N chunks
(:meth:`WireFormat.two_step_bytes`): the link waits the ring all-reduce time of those bytes (the two-step
moves the same bytes in the same ``2 (N - 1)`` steps), and the clock times encode, both exchanges, decode
and sum together, as syncdrop's own runtime does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from syncdrop.plan.wire import WireFormat
from syncdrop.serve import vllm_link

OP = "syncdrop::tp_compressed_all_reduce"


class GroupExchanges:
    """The two exchanges :meth:`WireFormat.two_step` needs (:class:`syncdrop.plan.wire.Exchanges`), on a vLLM
    ``GroupCoordinator``'s ``device_group``; this process is one rank (``R = 1``)."""

    def __init__(self, group) -> None:
        self.group = group.device_group
        self.tp = group.world_size

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``(1, N, X)`` -> ``(1, N, X)``: entry ``r`` of the result is entry ``rank`` of rank ``r``'s ``x``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out.view(-1), x.view(-1), group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(1, X)`` -> ``(1, N, X)``: every rank's ``x`` in rank order."""
        x = x.contiguous().reshape(1, -1)
        parts = x.new_empty((self.tp, x.shape[1]))  # (N, X)
        dist.all_gather_into_tensor(parts, x, group=self.group)
        return parts.unsqueeze(0)


@torch.library.custom_op(OP, mutates_args=())
def tp_compressed_all_reduce(x: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """``x`` ``(..., h)``, this rank's partial, summed over vLLM's tensor-parallel group by the two-step all-reduce
    in wire format ``fmt`` with groups of ``group`` channels; a new tensor of ``x``'s shape and dtype."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    wire = WireFormat(fmt, group)
    t0 = vllm_link.begin(x) if vllm_link.watched() else None
    y = x.reshape(1, -1, x.shape[-1])  # (1, M, h): one local rank
    out = wire.two_step(GroupExchanges(tp), y)[0].reshape(x.shape)
    if t0 is not None:
        vllm_link.end("all_reduce", x, tp.world_size, t0, nbytes=wire.two_step_bytes(x.numel(), tp.world_size))
    return out.clone() if out.data_ptr() == x.data_ptr() else out  # (one rank: two_step returns its input)


@tp_compressed_all_reduce.register_fake
def _(x: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    return torch.empty_like(x)


def compressed_all_reduce(x: torch.Tensor, wire: WireFormat) -> torch.Tensor:
    """The sum over vLLM's tensor-parallel ranks of this rank's partial ``x``, on ``wire``'s format: ``x`` itself
    on one rank (as vLLM's all-reduce), else the custom op."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() == 1:
        return x
    return torch.ops.syncdrop.tp_compressed_all_reduce(x, wire.fmt, wire.group)
