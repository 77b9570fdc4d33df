"""End-to-end distillation: the next-token distribution of a model under a sync plan (dropped or compressed sync
points) trained towards the original model's.

Starting point ``start``: a ``syncdrop distill`` directory (block-wise B2B / sequential B2B, possibly
head-grouped) or a plain model (zero-shot SPD blocks). Under ``plan``, the student is the simulated TP
model under the plan (dropped blocks in SPD form, compressed sync points through the two-step low-bit
all-reduce, whose gradient is the plain sum's: a straight-through estimator); the teacher is the original
dense model. The plan's *changed* blocks (:attr:`SyncPlan.changed`: any block that is not the stock one)
are trained. Loss, per
calibration window ``(S)`` and averaged over its tokens::

    KL(p_teacher || p_student) = sum_v p_t(v) (log p_t(v) - log p_s(v))

Trainable (``adapter``):

* ``full``: every tensor of every changed block (norms, q/k/v, o, gate/up, down, biases);
* ``lora``: a low-rank update of each matrix of the changed blocks, ``W = W0 + (alpha / r) B A`` with
  ``A (r, in)`` drawn N(0, 1/in) and ``B (out, r)`` zero (the start is exactly ``W0``); merged into the
  weights when written, so the result is an ordinary distilled directory (the factors are kept beside,
  in ``lora_adapters.safetensors``).

Weights are dense canonical tensors; every step re-shards them differentiably (head-grouping layouts
from ``start`` are kept), so what trains is exactly what the executors run. AdamW; windows in a seeded
order per epoch; held-out KL before training and after every epoch; the epoch with the lowest held-out
KL is kept (epoch 0 = ``start`` itself).

**Resumable.** ``OUT/e2e_state.safetensors`` (trainable tensors, AdamW moments, the best tensors so far,
and in its header the step, the curves and the settings hash) is written atomically every
``ckpt_every`` steps and at each epoch end; a rerun with the same settings continues from it and ends
with the same weights as an uninterrupted run. The output is a ``syncdrop distill`` directory: every
changed block gets a block file (tier ``e2e``), the manifest is written last, the state file removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from syncdrop.errors import SyncdropError
from syncdrop.models.config import layer_names
from syncdrop.parallel.comm import SimulatedComm
from syncdrop.parallel.executor import TPModel, simulated_model
from syncdrop.parallel.sharding import ShardLayout, distilled_layouts
from syncdrop.plan import SyncPlan, resolve_plan

log = logging.getLogger(__name__)

STATE_FILE = "e2e_state.safetensors"
ADAPTER_FILE = "lora_adapters.safetensors"  # LoRA only: the factors A, B per matrix (already merged)
ADAPTERS = ("full", "lora")
LR_SCHEDULES = ("constant", "linear")


@dataclass(frozen=True)
class E2ESettings:
    lr: float = 3e-5  # the best of the scanned 1e-5, 3e-5, 1e-4 (docs/spd.md, results/recovery/)
    epochs: int = 1
    adapter: str = "full"
    rank: int = 8
    alpha: float = 16.0
    weight_decay: float = 0.0
    seed: int = 0
    ckpt_every: int = 50
    lr_schedule: str = "constant"  # or "linear": lr * (1 - step / steps), decaying to 0 at the last step

    def check(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise SyncdropError(f"must be a positive number, got {self.lr}", field="e2e_lr")
        if self.epochs < 1:
            raise SyncdropError(f"must be at least 1, got {self.epochs}", field="e2e_epochs")
        if self.adapter not in ADAPTERS:
            raise SyncdropError(f"must be one of {', '.join(ADAPTERS)}, got {self.adapter!r}", field="e2e_adapter")
        if self.rank < 1:
            raise SyncdropError(f"must be at least 1, got {self.rank}", field="lora_rank")
        if self.ckpt_every < 1:
            raise SyncdropError(f"must be at least 1, got {self.ckpt_every}", field="ckpt_every")
        if self.lr_schedule not in LR_SCHEDULES:
            raise SyncdropError(f"must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}",
                                field="e2e_lr_schedule")

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of ``steps``."""
        return self.lr if self.lr_schedule == "constant" else self.lr * (1 - step / steps)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(p_teacher || p_student)``; logits ``(..., V)``, computed in float32."""
    s = F.log_softmax(student_logits.float().flatten(0, -2), -1)
    t = F.log_softmax(teacher_logits.float().flatten(0, -2), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


class Student:
    """The trainable model under the plan: frozen base tensors, trainable tensors (or LoRA factors) of the
    changed blocks, and the forward that re-shards them on every call."""

    def __init__(self, base: dict[str, torch.Tensor], trainable: list[str], s: E2ESettings, cfg, tp: int,
                 plan: SyncPlan, layouts: dict[int, ShardLayout], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.tp, self.plan, self.layouts, self.s, self.device = cfg, tp, plan, layouts, s, device
        self.dtype = dtype  # the forward's dtype; ``base`` and ``params`` stay float32 (master copies)
        self.base = base
        self.names = trainable
        g = torch.Generator().manual_seed(s.seed)
        self.params: dict[str, torch.Tensor] = {}
        for n in trainable:
            w = base[n]
            if s.adapter == "full":
                self.params[n] = w.detach().clone().requires_grad_(True)
            elif w.dim() == 2:
                out_f, in_f = w.shape
                a = torch.randn((s.rank, in_f), generator=g) / math.sqrt(in_f)  # drawn on the host: device-free
                self.params[n + ".lora_A"] = a.to(device).requires_grad_(True)
                self.params[n + ".lora_B"] = torch.zeros((out_f, s.rank), device=device, requires_grad=True)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every canonical tensor as the student uses it (LoRA merged: ``W0 + (alpha/r) B A``)."""
        out = dict(self.base)
        scale = self.s.alpha / self.s.rank
        for n in self.names:
            if self.s.adapter == "full":
                out[n] = self.params[n]
            elif n + ".lora_A" in self.params:
                out[n] = self.base[n] + scale * (self.params[n + ".lora_B"] @ self.params[n + ".lora_A"])
        return out

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        m = TPModel(self.cfg, self.weights(), ShardLayout.build(self.cfg, self.tp), SimulatedComm(self.tp),
                    self.plan, dtype=self.dtype, device=self.device, block_layouts=self.layouts)  # cast: differentiable
        B, S = ids.shape
        return m.logits(m.forward_blocks(m.embed_tokens(ids), 0, m.context(B, S)))


def _sha(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def _save_state(path: Path, params: dict, opt: torch.optim.Optimizer, best: dict, meta: dict[str, Any]) -> None:
    from safetensors.torch import save

    from syncdrop.io_utils import atomic_write_bytes

    data = {}
    for j, (n, p) in enumerate(params.items()):
        data[f"param/{n}"] = p.detach().cpu().contiguous()
        data[f"best/{n}"] = best[n].detach().cpu().contiguous()
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                data[f"{k}/{n}"] = st[k].detach().cpu().contiguous()
        if "step" in st:
            meta.setdefault("opt_steps", {})[str(j)] = float(st["step"])
    atomic_write_bytes(path, save(data, metadata={"syncdrop": json.dumps(meta)}))


def _load_state(path: Path, params: dict, opt: torch.optim.Optimizer, best: dict, sha: str) -> dict[str, Any] | None:
    """Restore a state file written with the same settings hash; None when there is none (or another)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("syncdrop", "{}"))
        if meta.get("settings_sha") != sha:
            log.warning("%s was written with other settings; starting over", path)
            return None
        for j, (n, p) in enumerate(params.items()):
            with torch.no_grad():
                p.copy_(f.get_tensor(f"param/{n}").to(p.device))
            best[n] = f.get_tensor(f"best/{n}").to(p.device)
            if f"exp_avg/{n}" in f.keys():
                opt.state[p] = {"step": torch.tensor(meta["opt_steps"][str(j)]),
                                "exp_avg": f.get_tensor(f"exp_avg/{n}").to(p.device),
                                "exp_avg_sq": f.get_tensor(f"exp_avg_sq/{n}").to(p.device)}
    return meta


def _student_teacher(start: str, tp: int, plan: SyncPlan, settings: E2ESettings, device: torch.device,
                     dtype: torch.dtype = torch.float32):
    """``(source, source for plan, Student, teacher TPModel)`` for training ``plan``'s changed blocks (dropped or
    compressed sync points) of ``start``."""
    from syncdrop.models.config import model_names
    from syncdrop.models.loading import resolve_model
    from syncdrop.runtime import check_checkpoint_tp, for_plan

    source = resolve_model(start)
    cfg = source.config
    check_checkpoint_tp(source, tp)
    plan = resolve_plan(plan, cfg.num_layers, tp=tp)
    if not plan.changed or plan.has_partial:
        raise SyncdropError("end-to-end distillation needs a plan that drops or compresses sync points (no partial "
                            "sync)", field="plan")
    src = for_plan(source, plan, warn=False)
    layouts = distilled_layouts(src.spd, cfg) if src.spd is not None else {}
    base_reader = src.reader.base if src.spd is not None else src.reader
    tensors = {n: src.reader.get(n).to(torch.float32).to(device) for n in model_names(cfg)}
    trainable = [n for i in plan.changed for n in layer_names(i, cfg)]
    student = Student(tensors, trainable, settings, cfg, tp, plan, layouts, device, dtype)
    return source, src, student, simulated_model(cfg, base_reader, tp, dtype=dtype, device=device)


def _step(student: Student, teacher: TPModel, opt: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    """One optimizer step on window ``ids`` ``(1, S)``: the KL of the student to the teacher; returns the loss."""
    with torch.no_grad():
        target = teacher.logits(teacher.hidden_states(ids)).clone()  # a plain tensor, not an inference one
    loss = kl_to_teacher(student.logits(ids), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def probe_step_s(start: str, tp: int, plan: SyncPlan, window: torch.Tensor, settings: E2ESettings | None = None,
                 device: torch.device | str = "cpu", steps: int = 2, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per end-to-end step (one window ``(1, S)``) of ``plan``'s changed blocks, measured: ``steps``
    steps after one untimed warm-up; nothing is written."""
    s = settings or E2ESettings()
    device = torch.device(device)
    _, _, student, teacher = _student_teacher(start, tp, plan, s, device, dtype)
    opt = torch.optim.AdamW(student.params.values(), lr=s.lr)
    ids = window.to(device)
    _step(student, teacher, opt, ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(student, teacher, opt, ids).item()
    return (time.perf_counter() - t0) / steps


def e2e_distill(start: str, tp: int, plan: SyncPlan, train_windows: torch.Tensor, held_windows: torch.Tensor,
                out_dir: str | Path, settings: E2ESettings, calib: dict[str, Any], progress: bool = True,
                device: torch.device | str = "cpu", stop_after: int | None = None,
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Train ``plan``'s changed blocks of ``start`` end to end (see the module docstring) and write the
    distilled directory ``out_dir``. ``dtype``: the forward's dtype (teacher and student); the trained
    weights are float32 master copies, and the block files hold them. ``stop_after``: return after that
    many optimizer steps of this call, leaving the state file (what an interruption leaves; tests use
    it). Returns the manifest (or, when stopped early, ``{"stopped_at": step}``)."""
    from syncdrop.io_utils import atomic_write_json, provenance
    from syncdrop.progress import progress_bar
    from syncdrop.spd.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, MANIFEST, block_file, save_block
    from syncdrop.spd.distill import base_spec

    settings.check()
    device = torch.device(device)
    source, src, student, teacher = _student_teacher(start, tp, plan, settings, device, dtype)
    cfg = source.config
    base_model = src.spd.base_model if src.spd is not None else base_spec(start)
    out = Path(out_dir)
    (out / "blocks").mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    common = {"start": base_spec(start), "base_model": base_model, "tp": tp, "plan": plan.to_dict()["blocks"],
              "calib": calib, **asdict(settings), "train_windows": list(train_windows.shape),
              "held_windows": list(held_windows.shape)}
    common.pop("ckpt_every")
    if settings.lr_schedule == "constant":  # state and block files from before the option stay valid
        common.pop("lr_schedule")
    if dtype != torch.float32:  # float32 state and block files from before the option stay valid
        common["dtype"] = str(dtype).removeprefix("torch.")
    sha = _sha(common)
    params = student.params
    opt = torch.optim.AdamW(params.values(), lr=settings.lr, weight_decay=settings.weight_decay)
    best = {n: p.detach().clone() for n, p in params.items()}

    @torch.no_grad()
    def held_kl() -> float:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(held_windows.shape[0]):
            ids = held_windows[j : j + 1].to(device)
            total += kl_to_teacher(student.logits(ids), teacher.logits(teacher.hidden_states(ids))).double()
        return total.item() / held_windows.shape[0]

    meta = _load_state(state_path, params, opt, best, sha)
    if meta is None:
        meta = {"settings_sha": sha, "step": 0, "train_curve": [], "held_curve": [held_kl()], "best_epoch": 0,
                "seconds": 0.0}
    n_train = train_windows.shape[0]
    total_steps = settings.epochs * n_train
    t0, done_here = time.perf_counter(), 0
    with progress_bar(total=total_steps, initial=meta["step"], desc="e2e distillation", unit="step",
                      disable=not progress, leave=False) as bar:
        while meta["step"] < total_steps:
            epoch, pos = divmod(meta["step"], n_train)
            order = torch.randperm(n_train, generator=torch.Generator().manual_seed(settings.seed * 7919 + epoch))
            j = int(order[pos])
            for group in opt.param_groups:
                group["lr"] = settings.lr_at(meta["step"], total_steps)
            loss = _step(student, teacher, opt, train_windows[j : j + 1].to(device))
            meta["train_curve"].append(loss.item())
            meta["step"] += 1
            done_here += 1
            bar.update(1)
            if meta["step"] % n_train == 0:  # epoch end: held-out KL, keep the best epoch
                meta["held_curve"].append(held_kl())
                if meta["held_curve"][-1] < min(meta["held_curve"][:-1]):
                    meta["best_epoch"] = meta["step"] // n_train
                    best = {n: p.detach().clone() for n, p in params.items()}
                bar.set_postfix(held_kl=f"{meta['held_curve'][0]:.4g}->{meta['held_curve'][-1]:.4g}")
            if meta["step"] % settings.ckpt_every == 0 or meta["step"] % n_train == 0:
                meta["seconds"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                _save_state(state_path, params, opt, best, meta)
            if stop_after is not None and done_here >= stop_after and meta["step"] < total_steps:
                meta["seconds"] += time.perf_counter() - t0
                _save_state(state_path, params, opt, best, meta)
                return {"stopped_at": meta["step"]}
    meta["seconds"] += time.perf_counter() - t0
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(best[n])
        final = {n: t.detach() for n, t in student.weights().items()}
    stats = {"heldout_kl_start": meta["held_curve"][0], "heldout_kl": min(meta["held_curve"]),
             "heldout_curve": meta["held_curve"], "train_curve": meta["train_curve"],
             "selected_epoch": meta["best_epoch"], "seconds": meta["seconds"], "adapter": settings.adapter}
    entries = {}
    start_blocks = src.spd.blocks if src.spd is not None else {}
    for i in plan.changed:
        prev = start_blocks.get(i, {})
        fname = block_file(i)
        bmeta = {"settings_sha": _sha({**common, "layer": i}), "layer": i, "tier": "e2e",
                 "head_order": prev.get("head_order"), "ffn_order": prev.get("ffn_order"),
                 "stats": {"e2e": stats, "start_tier": prev.get("tier", "zs")}}
        save_block(out / fname, {n: final[n].cpu() for n in layer_names(i, cfg)}, bmeta)
        entries[str(i)] = {"file": fname, "tier": "e2e", "head_order": bmeta["head_order"],
                           "ffn_order": bmeta["ffn_order"], "stats": bmeta["stats"]}
    if settings.adapter == "lora":  # the factors too (merged above): inspectable, and re-appliable to the start
        from safetensors.torch import save

        from syncdrop.io_utils import atomic_write_bytes

        atomic_write_bytes(out / ADAPTER_FILE, save({n: p.detach().cpu().contiguous() for n, p in params.items()},
                                                    metadata={"syncdrop": json.dumps({"alpha": settings.alpha,
                                                                                      "rank": settings.rank})}))
    saved = SyncPlan(list(plan.blocks), dict(plan.meta))
    saved.meta["tiers"] = {str(i): "e2e" for i in plan.changed}
    manifest = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "base_model": base_model,
                "model": source.name, "tp": tp, "plan": saved.to_dict(), "blocks": entries,
                "distill": {**common, "method": "e2e", "trained_blocks": plan.changed, "e2e": stats},
                "provenance": provenance()}
    atomic_write_json(out / MANIFEST, manifest)
    state_path.unlink(missing_ok=True)
    log.info("e2e distillation: held-out KL %.4g -> %.4g (epoch %d kept)", stats["heldout_kl_start"],
             stats["heldout_kl"], stats["selected_epoch"])
    return manifest
