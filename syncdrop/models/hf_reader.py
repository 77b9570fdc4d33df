"""Read transformers-format checkpoints (``config.json`` + ``*.safetensors``) into canonical tensors.

``config.json`` is parsed as a plain dict (no transformers config classes, no remote code), with the
defaults of the transformers 5 config classes where a key is missing. Weights are read with
``safetensors.safe_open`` one tensor at a time; pickled ``*.bin`` checkpoints are never loaded.
:meth:`HFCheckpoint.get_rows` / :meth:`~HFCheckpoint.get_cols` read only the covering row/column
range of a tensor (``safe_open(...).get_slice(key)[lo:hi]``), for one tensor-parallel rank's slice.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig, model_names
from syncdrop.models.gguf_reader import normalize_index

SUPPORTED_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "OPTForCausalLM")
# `syncdrop export` names the architecture of a model with dropped sync points Syncdrop<arch>, the class its
# vLLM plugin registers; the weights and every other key are those of <arch>
SERVED_ARCH_PREFIX = "Syncdrop"


def base_arch(arch: str | None) -> str | None:
    """``SyncdropLlamaForCausalLM`` -> ``LlamaForCausalLM``; any other name unchanged."""
    if arch and arch.startswith(SERVED_ARCH_PREFIX) and arch[len(SERVED_ARCH_PREFIX):] in SUPPORTED_HF_ARCHS:
        return arch[len(SERVED_ARCH_PREFIX):]
    return arch

# defaults of the transformers 5 config classes for keys a config.json may omit
_MAX_POS_DEFAULT = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768}

# canonical per-layer suffix -> checkpoint suffix (without the layer prefix and .weight/.bias)
_LLAMA_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_OPT_LAYER = {"attn_norm": "self_attn_layer_norm", "mlp_norm": "final_layer_norm",
              "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.out_proj", "up": "fc1", "down": "fc2"}


def _bad(path: str, what: str) -> SyncdropError:
    return SyncdropError(f"model directory {path}: {what}")


def _require(raw: dict[str, Any], key: str, path: str) -> Any:
    if raw.get(key) is None:
        raise _bad(path, f"config.json lacks {key!r}")
    return raw[key]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling or None)`` from transformers-5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (scaling if kind != "default" else None)


def _first_id(value: Any) -> int | None:
    """Token id fields may be an int, a list (several EOS ids) or null."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def config_from_hf(raw: dict[str, Any], path: str = "<config.json>") -> ModelConfig:
    """Build a :class:`ModelConfig` from a transformers ``config.json`` dict."""
    archs = raw.get("architectures") or []
    arch = base_arch(archs[0]) if archs else None
    if arch not in SUPPORTED_HF_ARCHS:
        raise _bad(path, f"architecture {arch!r} unsupported (expected one of {', '.join(SUPPORTED_HF_ARCHS)})")
    hidden = int(_require(raw, "hidden_size", path))
    heads = int(_require(raw, "num_attention_heads", path))
    common: dict[str, Any] = dict(
        arch=arch,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        num_layers=int(_require(raw, "num_hidden_layers", path)),
        num_heads=heads,
        bos_token_id=_first_id(raw.get("bos_token_id")),
        eos_token_id=_first_id(raw.get("eos_token_id")),
    )
    extra: dict[str, Any] = {}
    if isinstance(raw.get("eos_token_id"), list):
        extra["eos_token_ids"] = list(raw["eos_token_id"])
    if arch == "OPTForCausalLM":
        return _opt_config(raw, path, common, extra)

    theta, scaling = _rope(raw)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    sliding = None
    if arch == "LlamaForCausalLM":
        qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        mlp_bias = bool(raw.get("mlp_bias", False))
    elif arch == "MistralForCausalLM":
        qkv_bias = o_bias = mlp_bias = False
        sliding = raw.get("sliding_window", 4096)
    else:  # Qwen2
        qkv_bias, o_bias, mlp_bias = True, False, False
        sliding = _qwen2_sliding(raw, path, common["num_layers"])
    return ModelConfig(
        family="llama",
        head_dim=int(raw.get("head_dim") or hidden // heads),
        num_kv_heads=kv_heads,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        act=str(raw.get("hidden_act", "silu")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_positions=int(raw.get("max_position_embeddings", _MAX_POS_DEFAULT[arch])),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        sliding_window=None if sliding is None else int(sliding),
        extra=extra,
        **common,
    )


def _qwen2_sliding(raw: dict[str, Any], path: str, num_layers: int) -> int | None:
    """Qwen2 slides only when ``use_sliding_window``, and then only on layers >= ``max_window_layers``
    (or as ``layer_types`` says). One window for all layers is what ModelConfig can express."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or window is None:
        return None
    first = int(raw.get("max_window_layers", 28))
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise _bad(path, "Qwen2 with sliding window on only some layers (max_window_layers/layer_types) "
                     "is not supported")


def _opt_config(raw: dict[str, Any], path: str, common: dict[str, Any], extra: dict[str, Any]) -> ModelConfig:
    hidden = common["hidden_size"]
    if not raw.get("do_layer_norm_before", True):
        raise _bad(path, "OPT with do_layer_norm_before=false (post-norm, OPT-350m style) is not supported")
    if int(raw.get("word_embed_proj_dim") or hidden) != hidden:
        raise _bad(path, f"OPT with word_embed_proj_dim={raw['word_embed_proj_dim']} != hidden_size={hidden} "
                         "(OPT-350m style projections) is not supported")
    if raw.get("_remove_final_layer_norm", False):
        raise _bad(path, "OPT with _remove_final_layer_norm=true is not supported")
    bias = bool(raw.get("enable_bias", True))
    extra["norm_affine"] = bool(raw.get("layer_norm_elementwise_affine", True))
    if common["bos_token_id"] is None and "bos_token_id" not in raw:
        common["bos_token_id"] = 2
    if common["eos_token_id"] is None and "eos_token_id" not in raw:
        common["eos_token_id"] = 2
    return ModelConfig(
        family="opt",
        head_dim=hidden // common["num_heads"],
        num_kv_heads=common["num_heads"],
        intermediate_size=int(_require(raw, "ffn_dim", path)),
        norm_eps=1e-5,  # nn.LayerNorm default, which OPT uses
        act=str(raw.get("activation_function", "relu")),
        max_positions=int(raw.get("max_position_embeddings", 2048)),
        pos_offset=2,
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        extra=extra,
        **common,
    )


def checkpoint_name(name: str, cfg: ModelConfig) -> str:
    """Checkpoint key (without the optional ``model.`` prefix) of canonical tensor ``name``."""
    opt = cfg.family == "opt"
    base = "decoder." if opt else ""
    if name == "embed":
        return base + "embed_tokens.weight"
    if name == "pos_embed":
        return base + "embed_positions.weight"
    if name == "lm_head":
        return "lm_head.weight"
    if name.startswith("final_norm."):
        return base + ("final_layer_norm." if opt else "norm.") + name.split(".")[1]
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m is None:
        raise KeyError(name)
    table = _OPT_LAYER if opt else _LLAMA_LAYER
    return f"{base}layers.{m[1]}.{table[m[2]]}.{m[3]}"


class HFCheckpoint:
    """:class:`~syncdrop.models.loading.CheckpointReader` over a transformers safetensors directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise _bad(path, "no config.json (expected a transformers checkpoint directory or a .gguf file)")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise _bad(path, f"config.json is not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise _bad(path, "config.json is not a JSON object")
        self.raw_config = raw
        self.config = config_from_hf(raw, path)
        self._files = self._weight_files()
        self._handles: dict[str, Any] = {}
        self._index = self._build_index()

    def _weight_files(self) -> dict[str, str]:
        """Checkpoint key -> safetensors file (via the shard index if there is one)."""
        from safetensors import safe_open

        index_path = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
            return {k: os.path.join(self.path, v) for k, v in weight_map.items()}
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise _bad(self.path, "no *.safetensors weights (pickled .bin checkpoints are not loaded)")
        keys: dict[str, str] = {}
        for fname in files:
            full = os.path.join(self.path, fname)
            with safe_open(full, framework="pt") as f:
                keys.update({k: full for k in f.keys()})
        return keys

    def _build_index(self) -> dict[str, str | None]:
        """Canonical name -> checkpoint key (None: a synthesised non-affine LayerNorm parameter)."""
        cfg = self.config
        affine = cfg.extra.get("norm_affine", True)
        index: dict[str, str | None] = {}
        missing = []
        for name in model_names(cfg):
            if not affine and ("norm." in name):
                index[name] = None
                continue
            key = checkpoint_name(name, cfg)
            found = next((k for k in ("model." + key, key) if k in self._files), None)
            if found is None:
                missing.append("model." + key if name != "lm_head" else key)
            else:
                index[name] = found
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise _bad(self.path, f"safetensors lack {', '.join(missing[:3])}{more}")
        return index

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of canonical tensor ``name`` without reading it."""
        key = self._index[name]
        if key is None:
            return (self.config.hidden_size,)
        return tuple(self._handle(self._files[key]).get_slice(key).get_shape())

    def _key(self, name: str) -> str | None:
        if name not in self._index:
            raise KeyError(f"{name!r} not in {self.path}")
        return self._index[name]

    def _filled(self, name: str) -> torch.Tensor:
        """A non-affine LayerNorm's parameter: weight 1, bias 0."""
        fill = torch.ones if name.endswith(".weight") else torch.zeros
        return fill(self.config.hidden_size, dtype=torch.float32)

    def get(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            return self._filled(name)
        return self._handle(self._files[key]).get_tensor(key).to(torch.float32)

    def get_rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``get(name)[index]``, reading only rows ``min(index)..max(index)`` (dim 0; elements of a
        1-D tensor) and converting to float32 after selecting."""
        return self._get_along(name, index, dim=0)

    def get_cols(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``get(name)[:, index]`` of a 2-D tensor, reading only columns ``min(index)..max(index)``."""
        return self._get_along(name, index, dim=1)

    def _get_along(self, name: str, index: torch.Tensor, dim: int) -> torch.Tensor:
        key = self._key(name)
        sl = None if key is None else self._handle(self._files[key]).get_slice(key)
        shape = tuple(sl.get_shape()) if sl is not None else (self.config.hidden_size,)
        if len(shape) <= dim:
            raise IndexError(f"{name}: get_cols needs a 2-D tensor, shape is {shape}")
        idx = normalize_index(index, shape[dim], name)
        if sl is None:
            return self._filled(name)[idx]
        if idx.numel() == 0:
            return torch.empty(shape[:dim] + (0,) + shape[dim + 1:], dtype=torch.float32)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        part = sl[lo:hi] if dim == 0 else sl[:, lo:hi]
        if idx.numel() != hi - lo or not torch.equal(idx, torch.arange(lo, hi)):
            part = part.index_select(dim, idx - lo)
        return part.to(torch.float32).contiguous()
