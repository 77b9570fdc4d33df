"""Block-to-block distillation (B2B), with optional head grouping first (docs/methods.md, B2B and head grouping).

For every dropped block ``i`` of tier ``b2b`` or ``hg+b2b``:

* teacher: the original block with both syncs (``attn: full``), frozen;
* student: the same block in SPD form (``attn: drop``), initialised with the same weights (after the
  head-grouping layout for ``hg+b2b``, an exact re-parameterisation);
* input: the residual entering block ``i`` in the *original* model (plan ``none``) on calibration
  windows; target: the teacher block's output on it; loss ``MSE(student(x), teacher(x))``;
* only block ``i``'s parameters train (its dense canonical tensors: norms, q/k/v, o, gate/up, down
  and biases); AdamW; ``epochs`` passes over the training windows in a seeded order.

Because inputs come from the original model, blocks are independent: block ``i``'s result does not
depend on which other blocks are dropped, so a bank distilled for plan ``all`` holds the distilled
weights for every plan with the same settings (the sweep uses this), and blocks can be trained
one at a time, each saved as soon as it is done.

**Sequential B2B** (``method="sequential"``): block ``i``'s student is fed the residual of the model
converted so far -- every earlier block as the plan runs it (SPD form where dropped, with its distilled
weights and layout where distilled, the original block where kept) -- and trained towards the original
model's residual after block ``i``. Errors of earlier blocks are then seen, and corrected where block
``i`` can, instead of compounding unseen. Blocks are no longer independent: the plan and tiers enter
every block's settings hash, and a resumed run recomputes the stream from the block files it reuses.

The trainable tensors are the *dense* weights;
each step re-shards them differentiably (:func:`block_weights`), so a KV head replicated on
two ranks stays one tensor and zero padding stays zero.

Held-out windows (after the training windows) measure the loss before (= the zero-shot SPD block)
and after every epoch; both are stored per block. By default the weights of the epoch with the
lowest held-out loss are kept (epoch 0 = the original weights), so distillation never leaves a block
worse on held-out data than the zero-shot drop (``keep_best``; a run with lr 1e-3 made SmolLM2 TP=2
block 11 six times worse than zero-shot at its last epoch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig, layer_names
from syncdrop.parallel.block import ForwardContext, block_forward
from syncdrop.parallel.comm import SimulatedComm
from syncdrop.parallel.executor import TPModel, simulated_model
from syncdrop.parallel.sharding import ShardLayout
from syncdrop.parallel.weights import TensorSource, block_weights, local_geometry
from syncdrop.plan import DROP, BlockSync, SyncPlan
from syncdrop.spd.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    MANIFEST,
    block_file,
    read_block_meta,
    save_block,
)

log = logging.getLogger(__name__)

SPD_BLOCK = BlockSync(attn=DROP)  # the block distillation trains: attention sync removed, MLP sync full

TRAINED_TIERS = ("b2b", "hg+b2b")
BLOCK_METHODS = ("b2b", "sequential")
PAPER_LR = {"opt": 1e-6}  # docs/methods.md, B2B: 5e-5 for LLaMA-2, 1e-6 for OPT
DEFAULT_LR = 5e-5


def default_lr(cfg: ModelConfig) -> float:
    return PAPER_LR.get(cfg.family, DEFAULT_LR)


@dataclass(frozen=True)
class DistillSettings:
    lr: float
    epochs: int = 10
    batch_size: int = 1
    weight_decay: float = 0.0
    seed: int = 0
    hg_unit: str = "group"
    hg_mlp: str = "shard"
    hg_samples: int = 2
    # keep the weights of the epoch with the lowest held-out loss (epoch 0 = the original weights,
    # i.e. the zero-shot block) instead of the last epoch's
    keep_best: bool = True
    # "b2b": every block's student sees the original model's residual (blocks independent, the paper's);
    # "sequential": it sees the residual of the model converted so far (blocks before it in their plan
    # form, distilled ones with their new weights), and learns to map it back onto the original trajectory
    method: str = "b2b"

    def check(self) -> None:
        from syncdrop.spd import HG_MLP as MLP_MATCHING
        from syncdrop.spd import HG_UNITS as UNITS

        if not (math.isfinite(self.lr) and self.lr > 0):
            raise SyncdropError(f"--lr must be a positive number, got {self.lr}")
        for name in ("epochs", "batch_size", "hg_samples"):
            if getattr(self, name) < 1:
                raise SyncdropError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise SyncdropError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.hg_unit not in UNITS:
            raise SyncdropError(f"--hg-unit must be one of {', '.join(UNITS)}, got {self.hg_unit!r}")
        if self.hg_mlp not in MLP_MATCHING:
            raise SyncdropError(f"--hg-mlp must be one of {', '.join(MLP_MATCHING)}, got {self.hg_mlp!r}")
        if self.method not in BLOCK_METHODS:
            raise SyncdropError(f"--method must be one of {', '.join(BLOCK_METHODS)}, got {self.method!r}")


Batch = tuple[torch.Tensor, ForwardContext]  # residual (1, B*S, h) and its context


def _batches(model: TPModel, windows: torch.Tensor, batch_size: int) -> list[Batch]:
    out = []
    for j in range(0, windows.shape[0], batch_size):
        ids = windows[j : j + batch_size]
        out.append((model.embed_tokens(ids), model.context(*ids.shape)))
    return out


def _owned_float32(read: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``read`` (a tensor a checkpoint reader returned) as a float32 tensor on ``device`` that shares no memory
    with it: :func:`train_block` trains its tensors in place, and a reader may hand out a tensor it keeps."""
    w = read.to(torch.float32).to(device)
    return w.clone() if w.data_ptr() == read.data_ptr() else w


def _mse(model_out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model_out.float(), target.float())


def _step_in_backward(params: list[torch.Tensor], s: DistillSettings) -> list[Any]:
    """Give every tensor of ``params`` its own AdamW, stepped (and its gradient freed) by a hook as soon as the
    backward pass has accumulated that tensor's gradient. AdamW's update is element-wise per tensor, so this is
    the update of one AdamW over all of them, without holding every gradient at once (torch's "fusing the
    optimizer step into the backward pass"). Returns the hook handles (remove them when done)."""
    def step(p: torch.Tensor) -> None:
        opt = opts[id(p)]
        opt.step()
        opt.zero_grad(set_to_none=True)

    opts = {id(p): torch.optim.AdamW([p], lr=s.lr, weight_decay=s.weight_decay) for p in params}
    return [p.register_post_accumulate_grad_hook(step) for p in params]


def train_block(
    params: dict[str, torch.Tensor], layer: int, cfg: ModelConfig, layout: ShardLayout,
    train: list[Batch], train_y: list[torch.Tensor], held: list[Batch], held_y: list[torch.Tensor],
    s: DistillSettings, bar: Any = None, original: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Distil block ``layer`` in place (``params``: its dense tensors, float32, owned by the caller: AdamW updates
    them). Returns stats.

    Memory: the float32 masters and AdamW's two moments (12 bytes per trained parameter) are what stays; each
    parameter's step runs as soon as its gradient is complete (a hook on the backward pass, one AdamW per
    tensor: element-wise the same update as one AdamW over all of them), so the block's gradients never coexist.
    ``original``: reads the block's starting weights again, the epoch-0 candidate of ``keep_best``, so no copy of
    them is held (default: a copy); a copy of the best epoch's weights is held, on the host, only while a later
    epoch may still beat it.

    ``params`` are the float32 master copies that AdamW updates; the student runs in the batches' dtype
    (each step casts the masters to it, a differentiable cast, so bfloat16 activations train float32
    weights; for float32 batches the cast is the identity). The loss is taken in float32.
    Runs on the device of the batches (``params`` are trained there and come back there). Losses are
    summed on the device in float64 (the same sums, in the same order, as adding Python floats) and
    read back once per epoch; the batch order is drawn on the host (a seeded permutation of indices)."""
    tp = layout.tp
    device = train[0][0].device
    geo = local_geometry(cfg, layout, range(tp), device)
    comm = SimulatedComm(tp)
    # the masters are trained in place of ``params``' tensors, which the caller owns (no second float32 copy of
    # the block; ``params`` gets the selected weights back at the end)
    P = {k: v.detach().to(device).requires_grad_(True) for k, v in params.items()}

    def student(x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        w = block_weights(TensorSource(P), cfg, geo, layout, layer, x.dtype)  # differentiable re-sharding and cast
        return block_forward(x, w, geo, cfg, comm, ctx, SPD_BLOCK)

    def held_loss() -> float:
        total = torch.zeros((), dtype=torch.float64, device=device)  # as sum(loss.item() ...), one host read
        with torch.no_grad():
            for (x, c), y in zip(held, held_y, strict=True):
                total += _mse(student(x, c), y).double()
        return total.item() / len(held)

    hooks = _step_in_backward(list(P.values()), s)
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + layer)  # on the host: it orders Python indices
    t0 = time.perf_counter()
    zs = held_loss()
    train_curve, held_curve = [], []
    # the best epoch's weights: None while they are the originals (read again at the end, or copied now)
    best, best_epoch = zs, 0
    best_params = None if original is not None else {k: v.detach().clone() for k, v in P.items()}
    for epoch in range(1, s.epochs + 1):
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j in torch.randperm(len(train), generator=gen).tolist():
            (x, ctx), y = train[j], train_y[j]
            loss = _mse(student(x, ctx), y)
            loss.backward()  # every tensor's AdamW step runs in here, as its gradient completes
            total += loss.detach().double()
            if bar is not None:
                bar.update(1)
        train_curve.append(total.item() / len(train))
        held_curve.append(held_loss())
        if held_curve[-1] < best:
            best, best_epoch = held_curve[-1], epoch
            # the last epoch's weights are P itself; an earlier best is copied (a later epoch may change P), to the
            # host: on an accelerator the copy takes no device memory
            best_params = ({k: v.detach().to("cpu", copy=True) for k, v in P.items()} if epoch < s.epochs
                           else None)
        if bar is not None:
            bar.set_postfix(block=layer, held=f"{zs:.4g}->{held_curve[-1]:.4g}")
    for h in hooks:
        h.remove()
    if not s.keep_best or best_epoch == s.epochs:
        final = {k: v.detach() for k, v in P.items()}
    elif best_params is not None:
        final = {k: v.to(device) for k, v in best_params.items()}
    else:  # the originals won: read them again (``original`` is set, else best_params holds their copy)
        del P
        final = original()  # type: ignore[misc]
    for k in params:
        params[k] = final[k]
    return {"heldout_loss_zs": zs, "heldout_loss": best if s.keep_best else held_curve[-1],
            "heldout_curve": held_curve, "train_curve": train_curve,
            "selected_epoch": best_epoch if s.keep_best else s.epochs, "seconds": time.perf_counter() - t0}


@torch.no_grad()
def _converted_block(source: Any, teacher: TPModel, out: Path, entry: dict[str, Any] | None, plan: SyncPlan,
                     i: int, xs: list[torch.Tensor], batches: list[Batch]) -> list[torch.Tensor]:
    """Block ``i`` of the converted model applied to the residuals ``xs``: its distilled weights and layout
    when ``entry`` names a block file, else the original weights; SPD form when ``plan`` drops it."""
    from syncdrop.spd.checkpoint import load_block

    cfg, tp = teacher.cfg, teacher.layout.tp
    if entry is None:
        w, geo = teacher.blocks[i], teacher.geo
    else:
        layout = ShardLayout.build(cfg, tp, entry["head_order"], entry["ffn_order"])
        geo = local_geometry(cfg, layout, range(tp), teacher.device)
        params = {k: v.to(teacher.device) for k, v in load_block(out / entry["file"]).items()}
        w = block_weights(TensorSource(params), cfg, geo, layout, i, teacher.dtype)
    comm = SimulatedComm(tp)
    return [block_forward(x, w, geo, cfg, comm, c, plan.blocks[i]) for x, (_, c) in
            zip(xs, batches, strict=True)]


def _settings_sha(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def base_spec(spec: str) -> str:
    """How the manifest names the base model: an absolute path for paths, else the spec itself."""
    p = os.path.expanduser(spec)
    return os.path.abspath(p) if os.path.exists(p) else spec


def distill(
    source: Any, tp: int, plan: SyncPlan, tiers: dict[int, str], train_windows: torch.Tensor,
    held_windows: torch.Tensor, out_dir: str | Path, settings: DistillSettings, calib: dict[str, Any],
    progress: bool = True, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Distil every ``b2b`` / ``hg+b2b`` block of ``tiers`` and write the checkpoint directory.

    ``device``: where the teacher, the students and the batches live (the windows may be anywhere;
    block files are written from host copies). ``dtype``: the teacher's and the students' compute dtype
    (activations); trained weights are float32 master copies whatever it is, and the block files hold
    them (a runtime casts them to its own dtype when it loads the directory). Resumable: a block whose
    file exists with the same settings is loaded, not retrained; the manifest is written last. Returns
    the manifest dict.
    """
    from syncdrop.progress import progress_bar
    from syncdrop.spd.checkpoint import load_block
    from syncdrop.spd.head_grouping import group_heads

    if source.spd is not None:
        raise SyncdropError(f"--model {source.spec} is already a distilled directory; distil from its base "
                            f"model {source.spd.base_model}")
    settings.check()
    cfg = source.config
    L = cfg.num_layers
    bad = sorted(i for i, t in tiers.items() if i not in plan.dropped)
    if bad:
        raise SyncdropError(f"plan gives tiers to blocks {bad} that it does not drop")
    work = sorted(i for i, t in tiers.items() if t in TRAINED_TIERS)
    out = Path(out_dir)
    (out / "blocks").mkdir(parents=True, exist_ok=True)
    # blocks are visited in order, each once: hold one (memory independent of depth)
    teacher = simulated_model(cfg, source.reader, tp, dtype=dtype, device=device, resident_blocks=1)
    comm = SimulatedComm(tp)
    with torch.no_grad():
        train = _batches(teacher, train_windows, settings.batch_size)
        held = _batches(teacher, held_windows, settings.batch_size)
    hashed = asdict(settings)
    if not settings.keep_best:  # the behaviour before the option existed: earlier block files stay valid
        hashed.pop("keep_best")
    if settings.method == "b2b":  # likewise: block-wise B2B files from before the option stay valid
        hashed.pop("method")
    sequential = settings.method == "sequential"
    # the student stream (sequential): the residual entering each block in the model converted so far
    s_train, s_held = [x for x, _ in train], [x for x, _ in held]
    common = {"base_model": base_spec(source.spec), "tp": tp, "calib": calib, **hashed,
              "train_windows": list(train_windows.shape), "held_windows": list(held_windows.shape)}
    if dtype != torch.float32:  # float32 block files from before the option stay valid
        common["dtype"] = str(dtype).removeprefix("torch.")
    if settings.method == "sequential":  # a block's inputs depend on every block before it: the plan and tiers
        common |= {"plan_blocks": plan.to_dict()["blocks"], "tiers": {str(k): v for k, v in sorted(tiers.items())}}
    entries: dict[str, dict[str, Any]] = {}
    steps = len(work) * settings.epochs * len(train)
    t0 = time.perf_counter()
    with progress_bar(total=steps, desc="distilling", unit="step", disable=not progress, leave=False) as bar:
        for i in range(L):
            with torch.no_grad():  # teacher outputs: the targets of block i and the inputs of block i+1
                train_y = [block_forward(x, teacher.blocks[i], teacher.geo, cfg, comm, c) for x, c in train]
                held_y = [block_forward(x, teacher.blocks[i], teacher.geo, cfg, comm, c) for x, c in held]
            if i in work:
                tier = tiers[i]
                fname = block_file(i)
                sha = _settings_sha({**common, "layer": i, "tier": tier})
                meta = read_block_meta(out / fname)
                if meta is not None and meta.get("settings_sha") == sha:
                    log.info("block %d: reusing %s", i, fname)
                    bar.update(settings.epochs * len(train))
                    load_block(out / fname)  # fail now, not at load time, if the file is damaged
                else:
                    teacher.blocks.drop_held()  # block i's targets are computed: its weights are not needed again
                    names = layer_names(i, cfg)
                    def read_params(names: list[str] = names) -> dict[str, torch.Tensor]:
                        params = {n: _owned_float32(source.reader.get(n), teacher.device) for n in names}
                        release = getattr(source.reader, "release", None)
                        if release is not None:  # unmap the checkpoint: its pages read would stay resident
                            release()
                        return params

                    params = read_params()
                    head_order = ffn_order = None
                    hg = None
                    if tier == "hg+b2b":
                        g = group_heads(params, i, cfg, tp, train[: settings.hg_samples], settings.hg_unit,
                                        settings.hg_mlp, settings.seed)
                        head_order, ffn_order, hg = g.head_order, g.ffn_order, g.report
                    layout = ShardLayout.build(cfg, tp, head_order, ffn_order)
                    inputs = ([(x, c) for x, (_, c) in zip(s_train, train, strict=True)],
                              [(x, c) for x, (_, c) in zip(s_held, held, strict=True)]) if sequential else (train, held)
                    stats = train_block(params, i, cfg, layout, inputs[0], train_y, inputs[1], held_y, settings, bar,
                                        original=read_params)
                    stats["head_grouping"] = hg
                    meta = {"settings_sha": sha, "layer": i, "tier": tier, "head_order": head_order,
                            "ffn_order": ffn_order, "stats": stats}
                    save_block(out / fname, {k: v.cpu() for k, v in params.items()}, meta)
                    log.info("block %d (%s): held-out MSE %.4g -> %.4g", i, tier, stats["heldout_loss_zs"],
                             stats["heldout_loss"])
                entries[str(i)] = {"file": fname, "tier": tier, "head_order": meta["head_order"],
                                   "ffn_order": meta["ffn_order"], "stats": meta["stats"]}
            if sequential:  # block i as the converted model runs it, on the converted model's residual
                s_train, s_held = (_converted_block(source, teacher, out, entries.get(str(i)), plan, i, xs, cs)
                                   for xs, cs in ((s_train, train), (s_held, held)))
            train = [(y, c) for y, (_, c) in zip(train_y, train, strict=True)]
            held = [(y, c) for y, (_, c) in zip(held_y, held, strict=True)]
    from syncdrop.io_utils import atomic_write_json, provenance

    saved = SyncPlan(list(plan.blocks), dict(plan.meta))
    saved.meta["tiers"] = {str(i): t for i, t in sorted(tiers.items())}
    manifest = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "base_model": common["base_model"],
                "model": source.name, "tp": tp, "plan": saved.to_dict(), "blocks": entries,
                "distill": {**common, "trained_blocks": work, "elapsed_s": time.perf_counter() - t0},
                "provenance": provenance()}
    atomic_write_json(out / MANIFEST, manifest)
    return manifest
