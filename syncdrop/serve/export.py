"""``syncdrop export``: a model and its sync plan as a transformers directory that vLLM serves.

What is written (``OUT/``, atomically: built in a hidden sibling and moved into place)::

    config.json          the model's transformers config, plus
                           dtype, torch_dtype  the dtype the weights are stored in
                           syncdrop_plan    the plan (a SyncPlan dict)
                           syncdrop_tp      the TP degree N the export is laid out for
                           syncdrop_export  source model, dtype, distilled and head-grouped blocks, commit
                         and, when the plan is not dense (it drops or compresses a sync point),
                         ``architectures = ["Syncdrop<arch>"]``:
                         the class the vLLM plugin registers (stock transformers reads ``model_type``
                         and loads the dense model; syncdrop reads the plan back)
    model.safetensors    every weight in the export dtype under transformers' names; a model larger than
                         the shard limit (``max_shard_size``, default 5GB) is split as ``save_pretrained``
                         splits it: model-00001-of-0000N.safetensors ... and model.safetensors.index.json
                         (:mod:`syncdrop.models.hf_writer`)
    tokenizer files      the model's own tokenizer

Dtype: ``float32``, ``bfloat16`` or ``float16``; by default the source's (:func:`source_dtype`). Casting
down is rounding to nearest; a value that would not fit (float16 beyond +-65504) is an error, not an inf.

Streaming: tensors are read, permuted, cast and written a block of rows at a time (``CHUNK_ELEMENTS``
float32 values), straight into their shard file, and the reader's files are released after each tensor,
so peak memory is about one chunk above the interpreter's, whatever the model's depth or the shard size.

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
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import model_names
from syncdrop.models.hf_reader import SERVED_ARCH_PREFIX, base_arch
from syncdrop.models.hf_writer import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPE_NAMES,
    TensorSpec,
    dtype_keys,
    hf_config,
    hf_tensor_layout,
    parse_size,
    write_sharded,
)
from syncdrop.parallel.sharding import ShardLayout, contiguous_orders, distilled_layouts, head_rows
from syncdrop.plan import SyncPlan

log = logging.getLogger(__name__)

EXPORT_FORMAT = 1
VLLM_VOCAB_PAD = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this
Orders = tuple[list[int], list[int], list[int]]  # (q_order, kv_order, ffn_order)
CHUNK_ELEMENTS = 1 << 23  # rows read, cast and written at a time: about 32 MB of float32
_STORED = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors dtype -> export dtype


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote."""

    out: Path
    architecture: str
    plan: SyncPlan
    tp: int
    distilled_blocks: list[int]
    permuted_blocks: list[int]
    bytes_written: int  # tensor bytes, the index's total_size
    dtype: str = "float32"
    files: tuple[str, ...] = ("model.safetensors",)


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


def permutation_index(name: str, cfg, orders: Orders) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(rows, cols)``: the reordering of canonical block tensor ``name`` by its heads and MLP channels, as
    indices (None: that axis keeps its order). Row ``n`` of the result is row ``rows[n]`` of the tensor (q/k/v
    and gate/up, weights and biases); column ``n`` is column ``cols[n]`` (o and down weights)."""
    q_order, kv_order, ffn_order = orders
    proj, kind = name.split(".")[2:]
    d = cfg.head_dim
    if proj == "q":
        return head_rows(q_order, d), None
    if proj in ("k", "v"):
        return head_rows(kv_order, d), None
    if proj in ("gate", "up"):
        return torch.tensor(ffn_order), None
    if proj == "o" and kind == "weight":
        return None, head_rows(q_order, d)
    if proj == "down" and kind == "weight":
        return None, torch.tensor(ffn_order)
    return None, None  # norms, o and down biases (h,)


def permute_block_tensor(name: str, t: torch.Tensor, cfg, orders: Orders) -> torch.Tensor:
    """Canonical tensor ``name`` of one block with its heads and MLP channels reordered
    (:func:`permutation_index`)."""
    rows, cols = permutation_index(name, cfg, orders)
    t = t if rows is None else t[rows]
    return t if cols is None else t[:, cols]


def export_dtype(dtype: str | None) -> str | None:
    """``--dtype`` checked: ``float32``, ``bfloat16``, ``float16``, or None / ``auto`` (the source's)."""
    if dtype is None or dtype == "auto":
        return None
    if dtype not in DTYPE_NAMES:
        raise SyncdropError(f"{dtype}: unknown dtype; expected one of {', '.join(DTYPE_NAMES)} or auto (the "
                            "source's)", field="dtype")
    return dtype


def source_dtype(source) -> str:
    """The dtype an export is written in by default: that of the source's weights.

    A transformers directory: the one dtype its safetensors store every weight in (F32, BF16, F16), else
    (mixed or other dtypes) its ``config.json`` ``dtype``/``torch_dtype``, else float32. A GGUF file (or a
    distilled directory over one): float32, the dtype its quantised blocks (scales in float16, times small
    integers) dequantise to exactly, and what transformers' own GGUF loader gives; bfloat16 would round them.
    A distilled directory: its base model's (its trained blocks, float32, are cast)."""
    reader = getattr(source.reader, "base", source.reader)
    if source.kind != "hf" or not hasattr(reader, "stored_dtype"):
        return "float32"
    stored = {reader.stored_dtype(n) for n in model_names(source.config)} - {None}
    if len(stored) == 1 and next(iter(stored)) in _STORED:
        return _STORED[next(iter(stored))]
    raw = getattr(reader, "raw_config", {})
    named = raw.get("dtype") or raw.get("torch_dtype")
    return named if named in DTYPE_NAMES else "float32"


def _cast(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``t`` (float32) in ``dtype``, rounded to nearest; a finite value that overflows to inf is an error
    (field ``dtype``). Only values beyond ``dtype``'s largest finite one can overflow, so the elementwise check
    runs only when ``t``'s extremes (one cheap reduction) exceed it."""
    out = t.to(dtype)
    limit = torch.finfo(dtype).max
    if dtype == t.dtype or t.numel() == 0 or limit >= torch.finfo(t.dtype).max:
        return out
    lo, hi = torch.aminmax(t)
    big = max(float(hi), -float(lo))
    if big > limit and math.isfinite(big) and not bool(torch.isfinite(out).all()):
        dtype_name = str(dtype).removeprefix("torch.")
        raise SyncdropError(f"{dtype_name}: {name} holds values beyond {dtype_name}'s range (largest |x| {big:.4g}, "
                            f"largest finite {limit:.4g}); export in bfloat16 or float32", field="dtype")
    return out


def _tensor_chunks(reader, name: str, hf_name: str, shape: tuple[int, ...], order: Orders | None, cfg,
                   dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Canonical tensor ``name`` permuted by ``order`` and cast to ``dtype``, a block of rows at a time: each
    read with ``reader.get_rows`` (safetensors: that row range of the file; GGUF: those rows dequantised)."""
    rows, cols = permutation_index(name, cfg, order) if order is not None else (None, None)
    rows = torch.arange(shape[0]) if rows is None else rows
    step = max(1, CHUNK_ELEMENTS // math.prod(shape[1:]))
    for lo in range(0, shape[0], step):
        part = reader.get_rows(name, rows[lo:lo + step])
        yield _cast(part if cols is None else part[:, cols], dtype, hf_name)


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
                 force: bool = False, progress: bool = True, dtype: str | None = None,
                 max_shard_size: int | str | None = None) -> ExportResult:
    """Write ``model_spec`` under its plan (``plan_spec``, else the model's own plan, else ``none``),
    laid out for ``tp`` ranks, as a transformers directory at ``out`` with its weights in ``dtype`` (None or
    ``auto``: the source's, :func:`source_dtype`) in shards of at most ``max_shard_size`` (None: 5GB,
    ``DEFAULT_MAX_SHARD_SIZE``; see the module docstring)."""
    from syncdrop.io_utils import atomic_directory, atomic_write_json, git_commit
    from syncdrop.models.loading import expected_shape
    from syncdrop.progress import progress_bar
    from syncdrop.runtime import for_plan, prepare

    dest = check_out_dir(out, force)
    want = export_dtype(dtype)
    max_shard_size = DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    try:
        parse_size(max_shard_size)
    except ValueError as e:
        raise SyncdropError(f"{max_shard_size}: {e}", field="max_shard_size") from None
    source, plan = prepare(model_spec, tp, plan_spec, serving=True)
    cfg = source.config
    src = for_plan(source, plan)
    layouts = distilled_layouts(src.spd, cfg) if src.spd is not None else {}
    orders = _block_orders(cfg, tp, layouts)
    dtype_name = want or source_dtype(source)
    raw = _hf_config(source)
    arch = base_arch((raw.get("architectures") or [cfg.arch])[0])
    served_arch = arch if plan.is_dense else SERVED_ARCH_PREFIX + arch
    distilled = sorted(src.spd.blocks) if src.spd is not None else []
    raw |= {"architectures": [served_arch], **dtype_keys(dtype_name), "syncdrop_plan": plan.to_dict(),
            "syncdrop_tp": tp,
            "syncdrop_export": {"format": EXPORT_FORMAT, "source": model_spec, "source_name": source.name,
                                "base_model": src.spd.base_model if src.spd is not None else model_spec,
                                "dtype": dtype_name, "distilled_blocks": distilled,
                                "permuted_blocks": sorted(orders), "commit": git_commit()}}
    layout = hf_tensor_layout(cfg)  # transformers key -> canonical tensors stacked in its rows (fused: several)
    specs = [TensorSpec(hf, (sum(expected_shape(n, cfg)[0] for n in parts), *expected_shape(parts[0], cfg)[1:]),
                        DTYPE_NAMES[dtype_name]) for hf, parts in layout.items()]
    bar = progress_bar(total=len(specs), desc="export", unit="tensor", disable=not progress, leave=False)
    release = getattr(src.reader, "release", None)

    def chunks(spec: TensorSpec) -> Iterator[torch.Tensor]:
        for name in layout[spec.name]:
            block = int(name.split(".")[1]) if name.startswith("layers.") else None
            yield from _tensor_chunks(src.reader, name, spec.name, expected_shape(name, cfg), orders.get(block), cfg,
                                      spec.dtype)
        if release is not None:
            release()
        bar.update(1)

    with bar, atomic_directory(dest, replace=force) as tmp:
        written = write_sharded(tmp, specs, chunks, max_shard_size)
        source.load_tokenizer().save_pretrained(str(tmp))
        atomic_write_json(tmp / "config.json", raw)
    log.info("exported %s (%s, plan %s, TP=%d, %s, %d files) to %s", model_spec, served_arch, plan.summary(), tp,
             dtype_name, len(written.files), dest)
    return ExportResult(dest, served_arch, plan, tp, distilled, sorted(orders), written.total_size, dtype_name,
                        tuple(written.files))
