"""Inside vLLM's tensor-parallel collectives: the emulated link and the sync-point clock (worker side).

Installed by the plugin (:func:`syncdrop.serve.vllm_plugin.register`) in every vLLM process, and only when
the environment asks for it, so that a production server runs vLLM's collectives untouched:

* ``SYNCDROP_LINK_BANDWIDTH_BPS`` / ``SYNCDROP_LINK_LATENCY_S``: after each all-reduce (and logits gather)
  of the tensor-parallel group, the device is synchronised and the worker waits (spinning when every rank
  has a core of its own, as :mod:`syncdrop.bench.link` does) what a ring over N ranks costs on that link:
  :func:`syncdrop.bench.ring.ring_all_reduce_s` / ``ring_all_gather_s``, the same
  functions syncdrop's own emulation (:mod:`syncdrop.bench.link`) and the cost model use.
* ``SYNCDROP_VLLM_INSTRUMENT=1`` (the bench's diagnostic run): while recording is on, each such collective
  is timed from its call to its end (device synchronised, emulated wait included), so a rank's time also
  holds its wait for the slowest rank. The bench switches recording on and off and collects the times with
  ``collective_rpc`` through the worker extension (:mod:`syncdrop.serve.vllm_worker`). With recording off
  nothing is synchronised: only the link, when there is one, costs a synchronisation per collective.

The wrapped methods are ``GroupCoordinator``'s public ``all_reduce``, ``all_gather`` and ``gather``
(what ``tensor_model_parallel_all_reduce`` and the logits processor call). **Under vLLM's compilation**
(Dynamo traces the model's forward once, ``fullgraph``) the all-reduce and all-gather of the
tensor-parallel group go through custom ops, ``syncdrop::tp_all_reduce_`` and ``syncdrop::tp_all_gather``
(:func:`torch.library.custom_op`), as vLLM's own collectives go through ``vllm::all_reduce``: Dynamo
puts one opaque call in the graph and the clock and the wait run at every call, compiled or eager.
``tp_all_reduce_`` works in place, as vLLM's CPU all-reduce does (its CUDA all-reduce is out of place:
the result is copied back), so that Inductor reuses the buffer instead of copying it. The logits gather
runs outside the compiled forward. vLLM's compile cache does not know about the wrapper, so installing it
turns the cache off in that process (``VLLM_DISABLE_COMPILE_CACHE=1``): an engine with the wrapper neither
loads a graph traced without it nor saves one for an engine without it. **CUDA graphs** replay kernels
without the host, so neither the clock nor the wait can run inside one: capturing one of these ops raises
:data:`GRAPH_REFUSAL` (one line). The bench turns CUDA graphs off in every engine that emulates a link or
clocks (``cudagraph_mode: NONE``; Dynamo compilation stays on).
"""

from __future__ import annotations

import os
import time

import torch

from syncdrop.bench.link import ranks_have_own_cores, wait
from syncdrop.bench.ring import ring_all_gather_s, ring_all_reduce_s

ENV_BANDWIDTH = "SYNCDROP_LINK_BANDWIDTH_BPS"
ENV_LATENCY = "SYNCDROP_LINK_LATENCY_S"
ENV_INSTRUMENT = "SYNCDROP_VLLM_INSTRUMENT"
ENV_NO_COMPILE_CACHE = "VLLM_DISABLE_COMPILE_CACHE"
GRAPH_REFUSAL = ("syncdrop: the emulated link and the sync-point clock (SYNCDROP_LINK_*, SYNCDROP_VLLM_INSTRUMENT) "
                 "wait on the host and cannot run inside a CUDA graph: start vLLM with CUDA graphs off "
                 "(compilation_config={\"cudagraph_mode\": \"NONE\"}, or enforce_eager=True)")

_recording: list[tuple[str, float]] | None = None  # (kind, seconds) per collective while recording
_link: tuple[float, float | None] | None = None
_installed = False


def link_from_env() -> tuple[float, float | None] | None:
    """``(latency_s, bandwidth_Bps)`` of the emulated link, or None when none is set."""
    bw, lat = os.environ.get(ENV_BANDWIDTH), os.environ.get(ENV_LATENCY)
    if bw is None and lat is None:
        return None
    return float(lat or 0.0), (float(bw) if bw else None)


def _synchronize(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    elif t.device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize()


def _begin(t: torch.Tensor) -> float:
    """The clock's start; refuses CUDA-graph capture (the host work below would not be replayed)."""
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(GRAPH_REFUSAL)
    return time.perf_counter()


def _end(kind: str, t: torch.Tensor, n: int, t0: float, nbytes: int | None = None) -> None:
    """After a collective of ``t`` (this rank's input) over ``n`` ranks: the link's wait, then the clock.
    ``nbytes``: what one rank's input weighs on the wire, when not ``t``'s own bytes (a compressed sync
    point's encoded partial)."""
    if _link is None and _recording is None:
        return
    _synchronize(t)
    if _link is not None:
        nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
        wait(ring_all_reduce_s(nbytes, n, *_link) if kind == "all_reduce"
             else ring_all_gather_s(nbytes * n, n, *_link), spin=ranks_have_own_cores(n))
    if _recording is not None:
        _recording.append((kind, time.perf_counter() - t0))


def watched() -> bool:
    """True when the wrapper is installed (a link is emulated or the clock may record): a collective the
    wrapper does not route, syncdrop's compressed all-reduce (:mod:`syncdrop.serve.vllm_wire`), then
    brackets itself with :func:`begin` and :func:`end`."""
    return _installed


begin, end = _begin, _end  # for collectives outside vLLM's GroupCoordinator (syncdrop.serve.vllm_wire)


def _is_tp(group) -> bool:
    return group.world_size > 1 and group.unique_name.startswith("tp")


def _install_ops(coordinator: type) -> None:
    """Define the custom ops around ``coordinator``'s stock methods and route the TP group's calls to them."""
    from vllm.distributed import get_tp_group

    stock_all_reduce, stock_all_gather, stock_gather = (coordinator.all_reduce, coordinator.all_gather,
                                                        coordinator.gather)

    @torch.library.custom_op("syncdrop::tp_all_reduce_", mutates_args=("x",))
    def tp_all_reduce_(x: torch.Tensor) -> None:
        group = get_tp_group()
        t0 = _begin(x)
        out = stock_all_reduce(group, x)
        if out is not x:  # vLLM's CUDA all-reduce is out of place
            x.copy_(out)
        _end("all_reduce", x, group.world_size, t0)

    @tp_all_reduce_.register_fake
    def _(x: torch.Tensor) -> None:
        return None

    @torch.library.custom_op("syncdrop::tp_all_gather", mutates_args=())
    def tp_all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
        group = get_tp_group()
        t0 = _begin(x)
        out = stock_all_gather(group, x, dim).contiguous()
        _end("gather", x, group.world_size, t0)
        return out

    @tp_all_gather.register_fake
    def _(x: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] *= get_tp_group().world_size
        return x.new_empty(shape)

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if not _is_tp(self):
            return stock_all_reduce(self, input_)
        torch.ops.syncdrop.tp_all_reduce_(input_)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if not _is_tp(self):
            return stock_all_gather(self, input_, dim)
        return torch.ops.syncdrop.tp_all_gather(input_, dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """The logits gather (outside the compiled forward: a plain wrapper; it returns None off ``dst``)."""
        if not _is_tp(self):
            return stock_gather(self, input_, dst, dim)
        t0 = _begin(input_)
        out = stock_gather(self, input_, dst, dim)
        _end("gather", input_, self.world_size, t0)
        return out

    coordinator.all_reduce, coordinator.all_gather, coordinator.gather = all_reduce, all_gather, gather


def install() -> bool:
    """Wrap vLLM's group collectives when the environment asks for it (idempotent); True when wrapped."""
    global _installed, _link
    link = link_from_env()
    if _installed or (link is None and os.environ.get(ENV_INSTRUMENT) != "1"):
        return _installed
    from vllm.distributed import GroupCoordinator

    # vLLM's compile cache is keyed by its config and vLLM's environment, not by this wrapper: an artifact traced
    # without it (or with it) must not be loaded here (or elsewhere), or the link's wait would silently vanish
    os.environ[ENV_NO_COMPILE_CACHE] = "1"
    _link = link
    _install_ops(GroupCoordinator)
    _installed = True
    return True


def start_recording() -> bool:
    """Start timing this process's collectives; False when the clock is not installed."""
    global _recording
    _recording = []
    return _installed


def stop_recording() -> list[tuple[str, float]]:
    """Stop timing; the ``(kind, seconds)`` of every collective since the start."""
    global _recording
    out, _recording = _recording or [], None
    return out


def synchronize(t: torch.Tensor) -> None:
    """Wait for ``t``'s device (a no-op on CPU) before reading a clock."""
    _synchronize(t)
