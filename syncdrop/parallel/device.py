"""Device facts and clocks that hold on CUDA as on CPU.

CUDA kernels and NCCL collectives return as soon as they are queued, so a wall-clock reading taken
right after them measures the queueing, not the work. :func:`synchronize` waits for the device;
:func:`device_clock` is a ``perf_counter`` that synchronises ``device`` before every reading, which
is what every timing in syncdrop uses (the latency bench, generation's time to first token, the
link emulation's wait). On CPU both are plain.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait until every queued kernel on ``device`` has finished (no-op off CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device | str | None) -> Callable[[], float]:
    """A ``perf_counter`` clock that first synchronises ``device``."""
    if device is None or torch.device(device).type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def cuda_memory_mb(device: torch.device | str | None) -> dict[str, float] | None:
    """``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of ``device`` in MiB, or None off CUDA."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return {"max_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "max_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}


def pin_cpu_threads(threads: int | None, local_rank: int, local_world: int) -> dict:
    """Give this process ``threads`` intra-op threads (default: the usable cores // ``local_world``,
    at least 1) and, on Linux, bind it to its own contiguous block of ``threads`` cores (local rank
    ``r`` takes block ``r``), so that ranks sharing a machine do not steal each other's cores. When the
    blocks do not fit in the usable cores the affinity is left alone. Returns what was set:
    ``{"threads": t, "cores": [...] or None}``."""
    import os

    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    t = threads or max(1, len(usable) // max(1, local_world))
    torch.set_num_threads(t)
    cores = None
    if hasattr(os, "sched_setaffinity") and (local_rank + 1) * t <= len(usable):
        cores = usable[local_rank * t : (local_rank + 1) * t]
        os.sched_setaffinity(0, cores)
    return {"threads": t, "cores": cores}
