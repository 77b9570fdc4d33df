"""Recovery within a time budget: which method each SPD candidate gets, from measured step times.

Methods, best first (measured on SmolLM2, docs/spd.md "Recovery beyond the paper"):

* ``b2b+e2e``: the block stage (B2B / HG+B2B, :mod:`syncdrop.spd.distill`), then end-to-end KL
  distillation of the candidate's dropped blocks (:mod:`syncdrop.spd.e2e`);
* ``e2e``: end-to-end distillation from the zero-shot blocks (a candidate with no block tiered for B2B);
* ``b2b``: the block stage only (the paper's recipe);
* ``zs``: nothing trained (zero-shot SPD blocks).

The block stage is shared: it trains every tiered block of the largest candidate once (blocks are
independent), costing ``blocks x samples x epochs`` steps of one block. End-to-end distillation is
per candidate, ``samples x epochs`` steps of the whole model plus two held-out passes. Both step times
are *measured* on this machine before anything is trained (:func:`probe_block_step_s`,
:func:`probe_e2e_step_s`), and :func:`allocate` spends the budget: the block stage first (else every
candidate stays zero-shot), then end-to-end distillation for the candidates that drop the most blocks
first (they lose the most), while the predicted total fits.

**How many end-to-end windows.** A fixed number per candidate, or (the default of ``syncdrop auto``) as many
as the budget left after the block stage pays for: on SmolLM2 at SPD 50% the end-to-end stage on 64, 128
and 512 WikiText-2 valid windows gave +3.53%, +2.47% and +1.47% test perplexity over dense, while a second
epoch over 64 windows gave nothing (docs/spd.md), so spare time is worth most as more windows, not more
epochs. The candidates that get the stage (the most dropped first, each at least ``min_windows``) share the
time left equally, each capped at the calibration windows there are.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from syncdrop.errors import SyncdropError

MIN_E2E_WINDOWS = 8  # fewer end-to-end windows than this are not worth a candidate's stage (auto windows)
METHODS = ("b2b+e2e", "e2e", "b2b", "zs")  # best first; e2e: end to end from the zero-shot blocks (none tiered)
_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, flag: str = "--recovery-budget") -> float:
    """``'30m'``, ``'90s'``, ``'1.5h'``, ``'0'`` -> seconds (``0``: no training, every candidate zero-shot)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise SyncdropError(f"{flag} {text!r}: expected a duration like 30m, 90s, 1.5h or 0")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class Candidate:
    """An SPD candidate as :func:`allocate` sees it: its key, its dropped blocks, and how many of them
    the block stage trains (tier b2b / hg+b2b)."""

    key: str
    dropped: int
    trained: int


@dataclass(frozen=True)
class E2ECost:
    """One candidate's end-to-end stage on ``n`` windows: ``n * epochs`` training steps and ``held * (epochs
    + 1)`` held-out forwards (before training and after each epoch), each counted as a step of ``step_s``
    seconds (a small over-estimate: a forward is cheaper than a step)."""

    step_s: float
    epochs: int = 1
    held: int = 1

    def seconds(self, windows: int) -> float:
        return (windows * self.epochs + self.held * (self.epochs + 1)) * self.step_s

    def windows_within(self, seconds: float) -> int:
        """The most windows whose stage fits in ``seconds`` (0 when not even one does)."""
        if self.step_s <= 0:
            return 0
        return max(0, math.floor((seconds / self.step_s - self.held * (self.epochs + 1)) / self.epochs))


@dataclass
class RecoveryPlan:
    """What :func:`allocate` decided: the method of each candidate, and the predicted seconds."""

    budget_s: float
    block_stage: bool
    block_stage_s: float
    methods: dict[str, str] = field(default_factory=dict)
    predicted_s: dict[str, float] = field(default_factory=dict)  # per candidate: its end-to-end stage
    e2e_windows: dict[str, int] = field(default_factory=dict)  # per candidate given the stage: its windows
    notes: list[str] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return (self.block_stage_s if self.block_stage else 0.0) + sum(self.predicted_s.values())

    def to_dict(self) -> dict[str, Any]:
        return {"budget_s": self.budget_s, "block_stage": self.block_stage, "block_stage_s": self.block_stage_s,
                "methods": self.methods, "predicted_s": self.predicted_s, "e2e_windows": self.e2e_windows,
                "predicted_total_s": self.total_s, "notes": self.notes}


def allocate(budget_s: float, candidates: list[Candidate], block_steps: int, block_step_s: float, e2e: E2ECost,
             windows: int | None, available: int, min_windows: int = MIN_E2E_WINDOWS) -> RecoveryPlan:
    """Spend ``budget_s`` seconds (see the module docstring). ``block_steps``: the block stage's steps
    (blocks x samples x epochs, for the largest candidate); ``e2e``: what one candidate's end-to-end stage
    costs; ``windows``: its windows, or None to share the time left among the candidates (the most
    dropped first, each at least ``min_windows``, at most ``available``)."""
    block_s = block_steps * block_step_s
    plan = RecoveryPlan(budget_s, False, block_s)
    trainable = [c for c in candidates if c.dropped]
    for c in candidates:
        plan.methods[c.key] = "zs"
    if not trainable:
        return plan
    if budget_s <= 0:
        plan.notes.append("no recovery budget: every candidate stays zero-shot")
        return plan
    if block_steps and block_s > budget_s:
        plan.notes.append(f"the block stage needs about {block_s / 60:.1f} min, over the "
                          f"{budget_s / 60:.1f} min budget: every candidate stays zero-shot")
        return plan
    plan.block_stage = block_steps > 0
    left = budget_s - (block_s if plan.block_stage else 0.0)
    for c in trainable:
        plan.methods[c.key] = "b2b" if c.trained else "zs"
    order = sorted(trainable, key=lambda c: -c.dropped)
    least = windows if windows is not None else min(min_windows, available)
    if least < 1:
        plan.notes.append("no calibration windows left for end-to-end distillation")
        return plan
    fit = math.floor(left / e2e.seconds(least)) if e2e.step_s > 0 else len(order)  # candidates whose least fits
    chosen = order[: min(len(order), fit)]
    each = windows if windows is not None else (
        min(available, e2e.windows_within(left / len(chosen))) if chosen else 0)
    for c in chosen:
        plan.methods[c.key] = "b2b+e2e" if c.trained and plan.block_stage else "e2e"
        plan.predicted_s[c.key] = e2e.seconds(each)
        plan.e2e_windows[c.key] = each
    for c in order[len(chosen):]:
        plan.notes.append(f"candidate {c.key}: end-to-end distillation on {least} windows needs about "
                          f"{e2e.seconds(least) / 60:.1f} min, {(left - len(chosen) * e2e.seconds(each)) / 60:.1f} "
                          "min of the budget left")
    return plan


def probe_block_step_s(source, tp: int, window, device, steps: int = 2) -> float:
    """Seconds per B2B training step of one block on one window ``(1, S)``, measured on block 0:
    ``steps`` steps after an untimed warm-up call (each call also runs two held-out forwards, a small
    over-estimate)."""
    import torch

    from syncdrop.models.config import layer_names
    from syncdrop.parallel.block import block_forward
    from syncdrop.parallel.comm import SimulatedComm
    from syncdrop.parallel.executor import simulated_model
    from syncdrop.parallel.sharding import ShardLayout
    from syncdrop.spd.distill import DistillSettings, train_block

    cfg = source.config
    teacher = simulated_model(cfg, source.reader, tp, device=device)
    with torch.no_grad():
        x = teacher.embed_tokens(window.to(teacher.device))
        ctx = teacher.context(*window.shape)
        y = block_forward(x, teacher.blocks[0], teacher.geo, cfg, SimulatedComm(tp), ctx)
    params = {n: source.reader.get(n).to(torch.float32).to(teacher.device) for n in layer_names(0, cfg)}
    layout = ShardLayout.build(cfg, tp)
    batch = [(x, ctx)]
    train_block({k: v.clone() for k, v in params.items()}, 0, cfg, layout, batch, [y], batch, [y],
                DistillSettings(1e-4, 1))  # trains its tensors in place: a copy each time
    fresh = {k: v.clone() for k, v in params.items()}
    t0 = time.perf_counter()
    train_block(fresh, 0, cfg, layout, batch * steps, [y] * steps, batch, [y], DistillSettings(1e-4, 1))
    return (time.perf_counter() - t0) / steps
