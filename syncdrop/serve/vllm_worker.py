"""The worker extension the syncdrop bench mixes into vLLM's workers (``LLM(worker_extension_cls=
WORKER_EXTENSION)``): methods called on every worker at once with ``LLM.collective_rpc("syncdrop_...")``
(plain arguments, no pickled callables). It sits above :mod:`syncdrop.serve.vllm_link` (the clock and the
emulated link) and :mod:`syncdrop.serve.vllm_models` (the served blocks), which do not import it."""

from __future__ import annotations

import time

import torch

from syncdrop.serve import vllm_link


class SyncdropWorkerExtension:
    """Mixed into vLLM's worker class (see the module docstring)."""

    def syncdrop_set_dropped(self, dropped: list[int]) -> list[int]:
        """Switch the model's SPD blocks (:func:`syncdrop.serve.vllm_models.set_dropped`; refused in an engine
        that compiles the model or captures CUDA graphs)."""
        from syncdrop.serve.vllm_models import set_dropped

        return set_dropped(self.get_model(), dropped)  # type: ignore[attr-defined]

    def syncdrop_start_recording(self) -> bool:
        """Start timing this worker's collectives; False when the clock is not installed."""
        return vllm_link.start_recording()

    def syncdrop_stop_recording(self) -> list[tuple[str, float]]:
        """Stop timing; the ``(kind, seconds)`` of every collective since the start."""
        return vllm_link.stop_recording()

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
            vllm_link.synchronize(x)
            if i >= 3:
                out.append(time.perf_counter() - t0)
        return out


WORKER_EXTENSION = f"{__name__}.SyncdropWorkerExtension"
