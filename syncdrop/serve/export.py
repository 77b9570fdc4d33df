"""``syncdrop export``: a model and its sync plan as a transformers directory that vLLM serves.

What is written (``OUT/``, atomically: built in a hidden sibling and moved into place)::

    config.json          the model's transformers config, plus
                           syncdrop_plan    the plan (a SyncPlan dict)
                           syncdrop_tp      the TP degree N the export is laid out for
                           syncdrop_export  source model, distilled and head-grouped blocks, commit
                         and, when the plan drops a sync point, ``architectures = ["Syncdrop<arch>"]``:
                         the class the vLLM plugin registers (stock transformers reads ``model_type``
                         and loads the dense model; syncdrop reads the plan back)
    model.safetensors    every weight in float32 under transformers' names
    tokenizer files      the model's own tokenizer

Weights: for each block the plan drops, a distilled directory's trained block replaces the base one
(``runtime.for_plan``: distilled blocks whose sync the plan keeps fall back to the base weights).
A head-grouped block's permutation is baked in: its q/k/v rows, o columns, gate/up rows and down
columns are reordered (:func:`~syncdrop.parallel.sharding.contiguous_orders`) so that vLLM's
contiguous split of heads, KV heads and MLP channels over N ranks gives each rank exactly the heads
and channels syncdrop's layout gave it. Every block must be shardable that way at N (N divides the
query heads and the MLP width; N divides the KV heads or they divide N), as vLLM requires.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import model_names
from syncdrop.models.hf_reader import SERVED_ARCH_PREFIX, base_arch
from syncdrop.models.hf_writer import hf_config, hf_tensor_name
from syncdrop.parallel.sharding import ShardLayout, contiguous_orders, distilled_layouts, head_rows
from syncdrop.plan import SyncPlan

log = logging.getLogger(__name__)

EXPORT_FORMAT = 1
VLLM_VOCAB_PAD = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this
Orders = tuple[list[int], list[int], list[int]]  # (q_order, kv_order, ffn_order)


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote."""

    out: Path
    architecture: str
    plan: SyncPlan
    tp: int
    distilled_blocks: list[int]
    permuted_blocks: list[int]
    bytes_written: int


def check_servable(cfg, tp: int) -> None:
    """Raise (field ``tp``) unless vLLM can shard this model over ``tp`` ranks: a contiguous even split of
    heads, KV heads and MLP channels, and a padded vocabulary that ``tp`` divides."""
    from syncdrop.parallel.sharding import check_tp

    check_tp(cfg, tp)
    default = ShardLayout.build(cfg, tp)
    try:
        contiguous_orders(cfg, default)
    except SyncdropError as e:
        raise SyncdropError(f"{tp}: vLLM cannot serve it: {e}", field="tp") from e
    padded = -(-cfg.vocab_size // VLLM_VOCAB_PAD) * VLLM_VOCAB_PAD
    if padded % tp:
        raise SyncdropError(f"{tp}: vLLM cannot serve it: it pads the vocabulary ({cfg.vocab_size}) to a multiple of "
                            f"{VLLM_VOCAB_PAD} ({padded}) and splits that over the ranks, which {tp} does not divide",
                            field="tp")


def _block_orders(cfg, tp: int, layouts: dict[int, ShardLayout]) -> dict[int, Orders]:
    """``{block: (q_order, kv_order, ffn_order)}`` for blocks whose order is not the identity; raises
    (field ``tp``) when a block cannot be split contiguously over ``tp`` ranks."""
    check_servable(cfg, tp)
    out = {}
    for i, layout in sorted(layouts.items()):
        try:
            q, kv, ffn = contiguous_orders(cfg, layout)
        except SyncdropError as e:
            raise SyncdropError(f"{tp}: head-grouped block {i} cannot be served by a contiguous split: {e}",
                                field="tp") from e
        if (q, kv, ffn) != (list(range(cfg.num_heads)), list(range(cfg.num_kv_heads)),
                            list(range(cfg.intermediate_size))):
            out[i] = (q, kv, ffn)
    return out


def permute_block_tensor(name: str, t: torch.Tensor, cfg, orders: Orders) -> torch.Tensor:
    """Canonical tensor ``name`` of one block with its heads and MLP channels reordered: row ``n`` of the
    result is row ``order[n]`` of ``t`` (columns for o and down)."""
    q_order, kv_order, ffn_order = orders
    proj, kind = name.split(".")[2:]
    d = cfg.head_dim
    if proj == "q":
        return t[head_rows(q_order, d)]
    if proj in ("k", "v"):
        return t[head_rows(kv_order, d)]
    if proj == "o" and kind == "weight":
        return t[:, head_rows(q_order, d)]
    if proj in ("gate", "up"):
        return t[torch.tensor(ffn_order)]
    if proj == "down" and kind == "weight":
        return t[:, torch.tensor(ffn_order)]
    return t  # norms, o and down biases (h,)


def _hf_config(source) -> dict[str, Any]:
    """The source's own ``config.json`` (a transformers directory, or a distilled directory's base), else
    one written from the model config (GGUF)."""
    if source.kind == "hf":
        with open(os.path.join(source.path, "config.json")) as f:
            raw = json.load(f)
        raw.pop("quantization_config", None)
        return {k: v for k, v in raw.items() if not k.startswith("syncdrop_")}
    return hf_config(source.config)


def check_out_dir(out: str | Path, force: bool) -> Path:
    """``out`` may be new or an empty directory; otherwise ``force`` is needed (field ``out``)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise SyncdropError(f"{p} exists and is not a directory", field="out")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise SyncdropError(f"{p} exists and is not empty; pass --force to replace it", field="out")
    return p


def export_model(model_spec: str, tp: int, out: str | Path, plan_spec: str | SyncPlan | None = None,
                 force: bool = False, progress: bool = True) -> ExportResult:
    """Write ``model_spec`` under its plan (``plan_spec``, else the model's own plan, else ``none``),
    laid out for ``tp`` ranks, as a transformers directory at ``out`` (see the module docstring)."""
    from safetensors.torch import save

    from syncdrop.io_utils import atomic_directory, atomic_write_bytes, atomic_write_json, git_commit
    from syncdrop.progress import progress_bar
    from syncdrop.runtime import for_plan, prepare

    dest = check_out_dir(out, force)
    source, plan = prepare(model_spec, tp, plan_spec, serving=True)
    cfg = source.config
    src = for_plan(source, plan)
    layouts = distilled_layouts(src.spd, cfg) if src.spd is not None else {}
    orders = _block_orders(cfg, tp, layouts)
    raw = _hf_config(source)
    arch = base_arch((raw.get("architectures") or [cfg.arch])[0])
    served_arch = SERVED_ARCH_PREFIX + arch if plan.dropped else arch
    distilled = sorted(src.spd.blocks) if src.spd is not None else []
    raw |= {"architectures": [served_arch], "torch_dtype": "float32", "syncdrop_plan": plan.to_dict(),
            "syncdrop_tp": tp,
            "syncdrop_export": {"format": EXPORT_FORMAT, "source": model_spec, "source_name": source.name,
                                "base_model": src.spd.base_model if src.spd is not None else model_spec,
                                "distilled_blocks": distilled, "permuted_blocks": sorted(orders),
                                "commit": git_commit()}}
    tensors = {}
    names = model_names(cfg)
    for name in progress_bar(names, desc="export", unit="tensor", disable=not progress, leave=False):
        t = src.reader.get(name).to(torch.float32)
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        if block in orders:
            t = permute_block_tensor(name, t, cfg, orders[block])
        tensors[hf_tensor_name(name, cfg)] = t.contiguous()
    blob = save(tensors, metadata={"format": "pt"})
    with atomic_directory(dest, replace=force) as tmp:
        atomic_write_bytes(tmp / "model.safetensors", blob)
        source.load_tokenizer().save_pretrained(str(tmp))
        atomic_write_json(tmp / "config.json", raw)
    log.info("exported %s (%s, plan %s, TP=%d) to %s", model_spec, served_arch, plan.summary(), tp, dest)
    return ExportResult(dest, served_arch, plan, tp, distilled, sorted(orders), len(blob))
