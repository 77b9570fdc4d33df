"""Inside vLLM's tensor-parallel collectives: the emulated link and the sync-point clock (worker side).

Installed by the plugin (:func:`syncdrop.serve.vllm_plugin.register`) in every vLLM process, and only when
the environment asks for it, so that a production server runs vLLM's collectives untouched:

* ``SYNCDROP_LINK_BANDWIDTH_BPS`` / ``SYNCDROP_LINK_LATENCY_S``: after each all-reduce (and logits gather)
  of the tensor-parallel group, the device is synchronised and the worker waits (spinning when every rank
  has a core of its own, as :mod:`syncdrop.bench.link` does) what a ring over N ranks costs on that link:
  :func:`syncdrop.bench.ring.ring_all_reduce_s` / ``ring_all_gather_s``, the same
  functions syncdrop's own emulation (:mod:`syncdrop.bench.link`) and the cost model use.
* ``SYNCDROP_VLLM_INSTRUMENT=1`` (implied by a link): each such collective is timed from its call to its
  end, emulated wait included, so a rank's time also holds its wait for the slowest rank. The bench
  switches recording on and off and collects the times with ``collective_rpc`` through the worker
  extension :class:`SyncdropWorkerExtension`.
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

_recording: list[tuple[str, float]] | None = None  # (kind, seconds) per collective while recording
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


def _wrap(fn, kind: str, link: tuple[float, float | None] | None):
    def timed(self, input_: torch.Tensor, *args, **kwargs):
        if not self.unique_name.startswith("tp") or self.world_size == 1:
            return fn(self, input_, *args, **kwargs)
        t0 = time.perf_counter()
        out = fn(self, input_, *args, **kwargs)
        _synchronize(input_)
        if link is not None:
            n, nbytes = self.world_size, input_.numel() * input_.element_size()
            wait(ring_all_reduce_s(nbytes, n, *link) if kind == "all_reduce"
                 else ring_all_gather_s(nbytes * n, n, *link), spin=ranks_have_own_cores(n))
        if _recording is not None:
            _recording.append((kind, time.perf_counter() - t0))
        return out

    return timed


def install() -> bool:
    """Wrap vLLM's group collectives when the environment asks for it (idempotent); True when wrapped."""
    global _installed
    link = link_from_env()
    if _installed or (link is None and os.environ.get(ENV_INSTRUMENT) != "1"):
        return _installed
    from vllm.distributed.parallel_state import GroupCoordinator

    GroupCoordinator._all_reduce_out_place = _wrap(GroupCoordinator._all_reduce_out_place, "all_reduce", link)
    GroupCoordinator._all_gather_out_place = _wrap(GroupCoordinator._all_gather_out_place, "gather", link)
    GroupCoordinator.gather = _wrap(GroupCoordinator.gather, "gather", link)
    _installed = True
    return True


class SyncdropWorkerExtension:
    """Mixed into vLLM's worker class by ``LLM(worker_extension_cls=WORKER_EXTENSION)``; the bench calls these
    methods on every worker at once with ``LLM.collective_rpc("syncdrop_...")`` (plain arguments, no
    pickled callables)."""

    def syncdrop_set_dropped(self, dropped: list[int]) -> list[int]:
        """Switch the model's SPD blocks (:func:`syncdrop.serve.vllm_models.set_dropped`)."""
        from syncdrop.serve.vllm_models import set_dropped

        return set_dropped(self.get_model(), dropped)

    def syncdrop_start_recording(self) -> bool:
        """Start timing this worker's collectives."""
        global _recording
        _recording = []
        return _installed

    def syncdrop_stop_recording(self) -> list[tuple[str, float]]:
        """Stop timing; the ``(kind, seconds)`` of every collective since the start."""
        global _recording
        out, _recording = _recording or [], None
        return out

    def syncdrop_time_all_reduce(self, tokens: int, hidden: int, dtype: str, reps: int) -> list[float]:
        """Seconds per all-reduce of ``(tokens, hidden)`` zeros on the tensor-parallel group (emulated link
        included), each after a barrier, 3 warm-ups first; every worker runs it at once."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        x = torch.zeros((tokens, hidden), dtype=getattr(torch, dtype), device=device)
        out = []
        for i in range(3 + reps):
            group.barrier()
            t0 = time.perf_counter()
            group.all_reduce(x)
            _synchronize(x)
            if i >= 3:
                out.append(time.perf_counter() - t0)
        return out


WORKER_EXTENSION = f"{__name__}.SyncdropWorkerExtension"
