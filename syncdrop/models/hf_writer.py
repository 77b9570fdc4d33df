"""Write canonical tensors as a transformers checkpoint: tensor names, ``config.json`` and sharded safetensors.

The inverse of :mod:`syncdrop.models.hf_reader`: canonical ``layers.{i}.q.weight`` becomes
``model.layers.{i}.self_attn.q_proj.weight`` (OPT: ``model.decoder.layers.{i}.self_attn.q_proj.weight``),
``lm_head`` stays ``lm_head.weight``. Canonical tensors are already in transformers' layout (q/k rows
in rotate-half order, ``(out, in)`` matrices), so only names change.

Weights are written as transformers' ``save_pretrained`` writes them, but streamed: :func:`write_sharded`
splits the tensors into shards of at most ``max_shard_size`` bytes with transformers' own rule
(``huggingface_hub.split_state_dict_into_shards_factory``: tensors in order, a new shard when the next
would overflow, a tensor larger than the limit alone), names them ``model.safetensors`` (one shard) or
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``metadata.total_size``,
``metadata.total_parameters``, ``weight_map``; ``json.dumps(indent=2, sort_keys=True)``), and writes each
shard by :func:`write_safetensors`: since every tensor's shape and dtype are known beforehand, the
safetensors header (8-byte little-endian length, compact JSON with ``__metadata__`` first, padded with
spaces to a multiple of 8 bytes, as the safetensors library writes it) goes first and each tensor's bytes
follow as its producer yields them, a chunk at a time. Memory is one chunk, not one shard: the safetensors
library's ``save_file`` would hold a whole shard (and a bytes copy of it).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from syncdrop.models.config import ModelConfig, model_names
from syncdrop.models.hf_reader import checkpoint_name, checkpoint_slice

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default (transformers 5's save_pretrained uses 50GB)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # decimal, as transformers reads them


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint before it is written: its key, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """Bytes of a shard-size limit: an integer, or a number with a unit as transformers' ``max_shard_size``
    takes it (``"5GB"``, ``"500MB"``; KB, MB, GB, TB are powers of 1000). ``ValueError`` otherwise."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"{size!r} is not a size (e.g. 5GB, 500MB, or a number of bytes)")
        value = int(float(m[1]) * _SIZE_UNITS[m[2].upper()]) if m[2] else int(float(m[1]))
    if value < 1:
        raise ValueError(f"{size!r} is not a positive size")
    return value


def shard_files(specs: list[TensorSpec], max_shard_size: int | str) -> dict[str, list[TensorSpec]]:
    """``{file name: its tensors, in order}``: transformers' split of ``specs`` (in their order) into shards of
    at most ``max_shard_size`` bytes, and its names (``model.safetensors`` alone, else
    ``model-00001-of-0000N.safetensors``...)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs):
        raise ValueError("tensor names repeat")
    split = split_state_dict_into_shards_factory(by_name, get_storage_size=lambda s: s.nbytes,
                                                 filename_pattern=WEIGHTS_NAME.replace(".safetensors",
                                                                                       "{suffix}.safetensors"),
                                                 max_shard_size=parse_size(max_shard_size))
    return {f: [by_name[n] for n in names] for f, names in split.filename_to_tensors.items()}


def safetensors_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The header of a safetensors file holding ``specs`` in this order, contiguously: what precedes the
    tensor bytes, byte for byte as the safetensors library writes it when its order is this one."""
    entries: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for s in specs:
        entries[s.name] = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape),
                           "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


Chunks = Callable[[TensorSpec], Iterable[torch.Tensor]]


def write_safetensors(path: str | Path, specs: list[TensorSpec], chunks: Chunks,
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``specs`` to the safetensors file ``path``, each tensor's bytes being what ``chunks(spec)`` yields:
    tensors of ``spec.dtype`` whose elements, in order, are the tensor's (row-major), e.g. blocks of rows.
    Returns the bytes of tensor data written; ``ValueError`` when a producer yields another dtype or count."""
    if any(s.dtype not in SAFETENSORS_DTYPES for s in specs):
        raise ValueError(f"dtypes must be one of {sorted(DTYPE_NAMES)}")
    total = 0
    with open(path, "wb") as f:
        f.write(safetensors_header(specs, metadata))
        for s in specs:
            written = 0
            for c in chunks(s):
                if c.dtype != s.dtype:
                    raise ValueError(f"{s.name}: a chunk of {c.dtype}, expected {s.dtype}")
                flat = c.detach().to("cpu").contiguous().reshape(-1)
                f.write(flat.view(torch.uint8).numpy().data)  # little-endian, as safetensors stores it; no copy
                written += flat.numel() * flat.element_size()
            if written != s.nbytes:
                raise ValueError(f"{s.name}: {written} bytes produced, {s.nbytes} expected for shape {s.shape}")
            total += written
        f.flush()
        os.fsync(f.fileno())
    return total


@dataclass(frozen=True)
class ShardedCheckpoint:
    """What :func:`write_sharded` wrote: the weight files (in order), the index (None for one file)."""

    files: list[str]
    total_size: int
    index: dict[str, Any] | None


def write_sharded(directory: str | Path, specs: list[TensorSpec], chunks: Chunks,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> ShardedCheckpoint:
    """Write ``specs`` into ``directory`` as transformers' ``save_pretrained`` does (the module docstring),
    one shard after another, each tensor streamed from ``chunks`` (see :func:`write_safetensors`)."""
    directory = Path(directory)
    shards = shard_files(specs, max_shard_size)
    total = sum(write_safetensors(directory / f, group, chunks, {"format": "pt"}) for f, group in shards.items())
    index = None
    if len(shards) > 1:
        index = {"metadata": {"total_parameters": sum(math.prod(s.shape) for s in specs), "total_size": total},
                 "weight_map": {s.name: f for f, group in shards.items() for s in group}}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return ShardedCheckpoint(list(shards), total, index)

ARCH_MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                   "OPTForCausalLM": "opt"}


def hf_tensor_name(name: str, cfg: ModelConfig) -> str:
    """The transformers checkpoint key of canonical tensor ``name``."""
    return "lm_head.weight" if name == "lm_head" else "model." + checkpoint_name(name, cfg)


def hf_tensor_layout(cfg: ModelConfig) -> dict[str, list[str]]:
    """Every transformers checkpoint key of ``cfg`` (in the order of :func:`~syncdrop.models.config.model_names`)
    -> the canonical tensors stored in it, stacked along its rows in this order: one tensor, or the parts of a
    fused one (Phi-3: ``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up; see
    :func:`syncdrop.models.hf_reader.fused_projections`)."""
    layout: dict[str, list[tuple[int, str]]] = {}
    for name in model_names(cfg):
        key, rows = checkpoint_slice(name, cfg)
        layout.setdefault(key if name == "lm_head" else "model." + key, []).append((0 if rows is None else rows[0],
                                                                                   name))
    return {k: [n for _, n in sorted(parts)] for k, parts in layout.items()}


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A transformers ``config.json`` dict for ``cfg`` (Llama-family models read from a GGUF, or trained here),
    its weights stored in ``dtype``.

    OPT and models read from a transformers directory keep that directory's own ``config.json`` instead,
    which carries keys this config does not model."""
    arch = cfg.arch if cfg.arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM") else None
    if cfg.family != "llama" or arch is None:
        raise ValueError(f"hf_config writes Llama-family configs, got {cfg.family} / {cfg.arch}")
    d: dict[str, Any] = {
        "architectures": [arch], "model_type": ARCH_MODEL_TYPE[arch], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_positions, "hidden_act": cfg.act,
        "tie_word_embeddings": cfg.tie_embeddings, **dtype_keys(dtype),
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.extra.get("eos_token_ids", cfg.eos_token_id),
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if arch == "LlamaForCausalLM":
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("LlamaForCausalLM has one attention_bias for q/k/v and o")
        d |= {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    elif cfg.sliding_window is not None:
        d |= {"sliding_window": cfg.sliding_window}
        if arch == "Qwen2ForCausalLM":
            d |= {"use_sliding_window": True, "max_window_layers": 0}
    return d


def dtype_keys(dtype: str) -> dict[str, str]:
    """``config.json``'s dtype entries: ``dtype`` (transformers 5) and ``torch_dtype`` (what transformers 4 and
    older readers look for; transformers 5 reads it when ``dtype`` is absent)."""
    return {"dtype": dtype, "torch_dtype": dtype}
