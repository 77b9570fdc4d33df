"""Communicators: the only thing that differs between the simulated and distributed executors."""

from __future__ import annotations

import torch


class SimulatedComm:
    """All N ranks live in this process on a leading rank axis; all-reduce is a sum over it."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.calls = 0  # all-reduces issued (for accounting in tests and benchmarks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, M, h)`` partials -> ``(1, M, h)``."""
        self.calls += 1
        if x.shape[0] == 1 and self.tp > 1:
            raise ValueError("all_reduce got a replicated tensor; partials must carry all N ranks")
        return x.sum(0, keepdim=True)
