"""The model trained from scratch: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, no biases, untied
LM head), its initialisation, a differentiable tensor-parallel forward, and export as a
transformers ``LlamaForCausalLM`` directory (so ``--model DIR`` and transformers both load it).

Parameters are the *dense* canonical tensors (:mod:`syncdrop.models.config`). Each step builds a
:class:`~syncdrop.parallel.executor.TPModel` from them: sharding (:func:`block_weights`) is
indexing and concatenation, so gradients flow back into the dense tensors, exactly, for any
layout (uneven splits and replicated KV heads included). In the simulated executor all N ranks are
in one graph; in the distributed runtime each rank's graph touches only its own slices, and
:mod:`syncdrop.caat.train` all-reduces the dense gradients so that every rank holds the full one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from syncdrop.models.config import ModelConfig, model_names
from syncdrop.models.hf_writer import hf_config, hf_tensor_name
from syncdrop.models.loading import expected_shape
from syncdrop.parallel.executor import TPModel
from syncdrop.parallel.sharding import ShardLayout
from syncdrop.plan import SyncPlan


def llama_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, seq: int,
                 rope_theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(family="llama", arch="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       intermediate_size=ffn, norm_eps=1e-5, rope_theta=rope_theta, max_positions=seq,
                       tie_embeddings=False)


def init_params(cfg: ModelConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """GPT-2 / Megatron initialisation: N(0, std) matrices, output projections (o, down) scaled by
    1/sqrt(2L), norm weights 1. Seeded; float32, drawn on the host (the same values for every device;
    the caller moves them)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in model_names(cfg):
        shape = expected_shape(name, cfg)
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            s = std / math.sqrt(2 * cfg.num_layers) if name.endswith(("o.weight", "down.weight")) else std
            out[name] = torch.randn(shape, generator=g) * s
    return out


def tp_forward(params: dict[str, torch.Tensor], cfg: ModelConfig, layout: ShardLayout, plan: SyncPlan, comm,
               ranks: list[int], ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, S, V)`` of token ids ``(B, S)``, differentiable in ``params``, computed on the
    parameters' device (where the ids are moved)."""
    m = TPModel(cfg, params, layout, comm, plan, ranks=ranks, device=params["embed"].device)
    B, S = ids.shape
    return m.logits(m.forward_blocks(m.embed_tokens(ids), 0, m.context(B, S)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``(B, S, V)`` against the next tokens ``targets`` ``(B, S)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def export_hf(params: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path, tokenizer=None,
              extra: dict | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) for ``LlamaForCausalLM``, from
    ``params`` on any device (float32 host copies are written)."""
    from safetensors.torch import save

    from syncdrop.io_utils import atomic_write_bytes, atomic_write_json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = {**hf_config(cfg), **(extra or {})}
    tensors = {hf_tensor_name(k, cfg): v.detach().float().cpu().contiguous() for k, v in params.items()}
    atomic_write_bytes(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    atomic_write_json(out / "config.json", json.loads(json.dumps(hf)))
