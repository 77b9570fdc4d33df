"""Training a partial-sync (CAAT-Net) model from scratch: AdamW, warm-up + cosine, clipping,
atomic resumable checkpoints, validation on held-out books.

One step: a seeded batch (:func:`syncdrop.caat.data.train_batch`), the tensor-parallel forward
under the plan ``partial:p`` (every attention and MLP sync point a partial reduce; p = 1 is
ordinary TP with a vocab-parallel head), mean next-token cross-entropy, backward, gradient
all-reduce (distributed runtime only: every rank holds the dense parameters but its graph reaches
only its own slices, plus its share of the replicated tensors (embedding, norm weights); the sum
over ranks is the full gradient, so all ranks apply identical updates), global-norm clipping,
AdamW (betas 0.9/0.95; weight decay on matrices only).

Checkpoint (``OUT/checkpoint``): ``params.safetensors``, ``optim.pt`` (tensors and numbers only,
loaded with ``weights_only=True``) and ``state.json`` (step, settings, loss history), each written
atomically, ``state.json`` last; a run restarted with the same settings continues from it and
produces the same losses as an uninterrupted run (batches are seeded by step). At the end the
model is exported as a transformers Llama directory (``OUT/model``) with the tokenizer and
``OUT/model/plan.json`` (``syncdrop ppl --model OUT/model --tp N --plan OUT/model/plan.json``).
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from syncdrop.caat.data import load_corpus, token_stream, train_batch, train_tokenizer, val_windows
from syncdrop.caat.model import export_hf, init_params, llama_config, lm_loss, tp_forward
from syncdrop.caat.settings import TrainSettings
from syncdrop.errors import SyncdropError
from syncdrop.parallel.device import device_clock
from syncdrop.parallel.sharding import ShardLayout, check_tp
from syncdrop.plan import SyncPlan

log = logging.getLogger(__name__)


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine to ``min_lr`` at ``steps``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def _optimizer(params: dict[str, torch.Tensor], s: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=s.lr, betas=(0.9, 0.95))


def _save(ckpt: Path, params, opt, state: dict[str, Any]) -> None:
    from safetensors.torch import save

    from syncdrop.io_utils import atomic_write_bytes, atomic_write_json

    ckpt.mkdir(parents=True, exist_ok=True)
    meta = {"step": str(state["step"])}
    tensors = {k: v.detach().cpu() for k, v in params.items()}  # one copy to the host per checkpoint
    atomic_write_bytes(ckpt / "params.safetensors", save(tensors, metadata=meta))
    buf = io.BytesIO()
    torch.save({"step": state["step"], "optim": opt.state_dict()}, buf)
    atomic_write_bytes(ckpt / "optim.pt", buf.getvalue())
    atomic_write_json(ckpt / "state.json", state)


def _load(ckpt: Path, settings: dict, params, opt) -> dict[str, Any] | None:
    from safetensors import safe_open

    f = ckpt / "state.json"
    if not f.exists():
        return None
    state = json.loads(f.read_text())
    if state.get("settings") != settings:
        raise SyncdropError(f"{ckpt} holds a run with other settings; use another --out or delete it")
    with safe_open(str(ckpt / "params.safetensors"), framework="pt") as sf:
        if (sf.metadata() or {}).get("step") != str(state["step"]):
            raise SyncdropError(f"{ckpt}: params.safetensors and state.json disagree on the step; delete it")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(sf.get_tensor(k))
    device = next(iter(params.values())).device
    o = torch.load(ckpt / "optim.pt", weights_only=True, map_location=device)
    if o["step"] != state["step"]:
        raise SyncdropError(f"{ckpt}: optim.pt and state.json disagree on the step; delete it")
    opt.load_state_dict(o["optim"])
    return state


def train(s: TrainSettings, corpus: str, out_dir: str | Path, progress: bool = True, runtime=None) -> dict[str, Any]:
    """Run (or resume) a training run on ``runtime`` (a :class:`syncdrop.runtime.Runtime`; default:
    the simulated executor on the CPU); returns the result dict (also written to ``OUT/train.json``).
    Parameters, batches and optimizer state live on the runtime's device; initialisation and batch
    offsets are drawn on the host from seeded generators, so a run is the same on every device."""
    from syncdrop.eval.data import in_data_dir
    from syncdrop.io_utils import atomic_write_json, provenance
    from syncdrop.progress import progress_bar
    from syncdrop.runtime import choose_runtime

    s.check()
    runtime = runtime or choose_runtime("simulated", "cpu")
    dist_ctx = runtime.start()
    device = runtime.device
    clock = device_clock(device)  # synchronises the device before each reading (tokens/s)
    out = Path(out_dir)
    main = dist_ctx is None or dist_ctx.is_main
    # the data folder's books relative to it (resumes and results travel); any other corpus resolved, as one run
    settings = {**asdict(s), "corpus": in_data_dir(Path(corpus).resolve())}
    data = load_corpus(corpus, s.val_books, s.seed)
    tok_dir = out / "tokenizer"
    tok = None
    if main and not (tok_dir / "tokenizer.json").exists():
        tok = train_tokenizer(data.train_text, s.vocab_size)
        tok.save_pretrained(str(tok_dir))
    comm = runtime.communicator(s.tp)
    comm.barrier()  # every rank reads rank 0's tokenizer
    if tok is None:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    train_ids, val_ids = token_stream(tok, data.train_text), token_stream(tok, data.val_text)
    vw = val_windows(val_ids, s.seq_len, s.val_windows).to(device)
    cfg = llama_config(len(tok), s.hidden, s.layers, s.heads, s.kv_heads, s.ffn, s.seq_len)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = type(cfg)(**{**cfg.to_dict(), "bos_token_id": eot, "eos_token_id": eot})
    check_tp(cfg, s.tp)
    layout = ShardLayout.build(cfg, s.tp)
    plan = SyncPlan.partial(cfg.num_layers, s.sync_fraction, s.scale, s.mask)
    ranks = runtime.local_ranks(s.tp)
    if dist_ctx is not None:  # torch.distributed collectives are not differentiable by themselves
        from syncdrop.caat.grad_comm import GradComm

        comm = GradComm(comm, dist_ctx.rank)
    params = {k: v.to(device).requires_grad_(True) for k, v in init_params(cfg, s.seed).items()}
    opt = _optimizer(params, s)
    state = _load(out / "checkpoint", settings, params, opt) or {
        "step": 0, "settings": settings, "train_loss": [], "val_loss": [], "tokens_per_s": []}
    if state["step"]:
        log.info("resuming at step %d", state["step"])

    def val_loss() -> float:
        with torch.no_grad():
            return sum(lm_loss(tp_forward(params, cfg, layout, plan, comm, ranks, w[None, :-1]), w[None, 1:]).item()
                       for w in vw) / len(vw)

    if not state["val_loss"]:
        state["val_loss"].append([0, val_loss()])
    bar = progress_bar(total=s.steps, initial=state["step"], desc=f"train p={s.sync_fraction:g}", unit="step",
                       disable=not (progress and main))
    while state["step"] < s.steps:
        step = state["step"]
        t0 = clock()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s)
        batch = train_batch(train_ids, s.batch, s.seq_len, s.seed, step).to(device)
        loss = lm_loss(tp_forward(params, cfg, layout, plan, comm, ranks, batch[:, :-1]), batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if dist_ctx is not None:
            _all_reduce_grads(params, comm.inner)
        torch.nn.utils.clip_grad_norm_(list(params.values()), s.clip)
        opt.step()
        state["step"] = step + 1
        step_loss = loss.item()  # the one host read of the step
        state["train_loss"].append(step_loss)
        state["tokens_per_s"].append(s.batch * s.seq_len / (clock() - t0))
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{state['tokens_per_s'][-1]:.0f}")
        if state["step"] % s.val_every == 0 or state["step"] == s.steps:
            state["val_loss"].append([state["step"], val_loss()])
            log.info("step %d: train %.4f val %.4f", state["step"], step_loss, state["val_loss"][-1][1])
        if main and (state["step"] % s.ckpt_every == 0 or state["step"] == s.steps):
            _save(out / "checkpoint", params, opt, state)
    bar.close()
    result = {"settings": settings, "model_config": cfg.to_dict(), "plan": plan.to_dict(),
              "train_books": [in_data_dir(b) for b in data.train_books],
              "val_books": [in_data_dir(b) for b in data.val_books],
              "train_tokens": int(train_ids.numel()), "val_tokens_scored": int(vw.shape[0] * s.seq_len),
              "train_loss": state["train_loss"], "val_loss": state["val_loss"],
              "final_val_loss": state["val_loss"][-1][1], "tokens_per_s": state["tokens_per_s"],
              "provenance": provenance()}
    if main:
        export_hf(params, cfg, out / "model", tok, {"syncdrop_sync_fraction": s.sync_fraction,
                                                     "syncdrop_tp": s.tp})
        plan.save(out / "model" / "plan.json")
        atomic_write_json(out / "train.json", result)
    return result


def _all_reduce_grads(params: dict[str, torch.Tensor], comm) -> None:
    """Sum every gradient over the ranks (fp32): the full gradient on every rank."""
    for p in params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(comm.all_reduce(p.grad.float()[None])[0].to(p.grad.dtype))
