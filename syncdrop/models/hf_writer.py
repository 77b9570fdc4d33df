"""Write canonical tensors as a transformers checkpoint: tensor names and ``config.json``.

The inverse of :mod:`syncdrop.models.hf_reader`: canonical ``layers.{i}.q.weight`` becomes
``model.layers.{i}.self_attn.q_proj.weight`` (OPT: ``model.decoder.layers.{i}.self_attn.q_proj.weight``),
``lm_head`` stays ``lm_head.weight``. Canonical tensors are already in transformers' layout (q/k rows
in rotate-half order, ``(out, in)`` matrices), so only names change.
"""

from __future__ import annotations

from typing import Any

from syncdrop.models.config import ModelConfig
from syncdrop.models.hf_reader import checkpoint_name

ARCH_MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                   "OPTForCausalLM": "opt"}


def hf_tensor_name(name: str, cfg: ModelConfig) -> str:
    """The transformers checkpoint key of canonical tensor ``name``."""
    return "lm_head.weight" if name == "lm_head" else "model." + checkpoint_name(name, cfg)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers ``config.json`` dict for ``cfg`` (Llama-family models read from a GGUF, or trained here).

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
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
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
