"""Read transformers-format checkpoints (``config.json`` + ``*.safetensors``) into canonical tensors.

``config.json`` is parsed as a plain dict (no transformers config classes, no remote code), with the
defaults of the transformers 5 config classes where a key is missing. Families: Llama (Llama 3.x ``llama3``
rope scaling included), Mistral, Qwen2, Qwen3 (per-head q/k RMSNorm: ``ModelConfig.qk_norm``), Phi-3 (fused
``qkv_proj`` and ``gate_up_proj``, read as row ranges: :func:`checkpoint_slice`) and OPT. Architectures that
put a norm on a sublayer's output (Gemma 2/3, OLMo 2) are refused with the reason (:data:`POST_NORM_ARCHS`).
Weights are read with ``safetensors.safe_open`` one tensor at a time; pickled ``*.bin`` checkpoints are never
loaded. :meth:`HFCheckpoint.get_rows` / :meth:`~HFCheckpoint.get_cols` read only the covering row/column range
of a tensor (``safe_open(...).get_slice(key)[lo:hi]``, within a fused tensor's rows), for one tensor-parallel
rank's slice.
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
from syncdrop.models.rope import check_scaling

SUPPORTED_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Phi3ForCausalLM", "OPTForCausalLM")
# architectures that normalise the attention (and MLP) output before the residual add: with a sync point dropped,
# SPD carries the attention partials P_r inside the MLP's all-reduce as a sum, X + AllReduce(P_r + Z_r), and
# norm(sum_r P_r) is not sum_r norm(P_r), so the algebra does not hold for them
POST_NORM_ARCHS = {"Gemma2ForCausalLM": "Gemma 2", "Gemma3ForCausalLM": "Gemma 3",
                   "Gemma3ForConditionalGeneration": "Gemma 3", "Gemma3nForCausalLM": "Gemma 3n",
                   "Gemma3nForConditionalGeneration": "Gemma 3n", "Gemma4ForCausalLM": "Gemma 4",
                   "Gemma4ForConditionalGeneration": "Gemma 4", "Olmo2ForCausalLM": "OLMo 2",
                   "Olmo3ForCausalLM": "OLMo 3"}
# `syncdrop export` names the architecture of a model with dropped sync points Syncdrop<arch>, the class its
# vLLM plugin registers; the weights and every other key are those of <arch>
SERVED_ARCH_PREFIX = "Syncdrop"


def base_arch(arch: str | None) -> str | None:
    """``SyncdropLlamaForCausalLM`` -> ``LlamaForCausalLM``; any other name unchanged."""
    if arch and arch.startswith(SERVED_ARCH_PREFIX) and arch[len(SERVED_ARCH_PREFIX):] in SUPPORTED_HF_ARCHS:
        return arch[len(SERVED_ARCH_PREFIX):]
    return arch

# defaults of the transformers 5 config classes for keys a config.json may omit
_MAX_POS_DEFAULT = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768,
                    "Qwen3ForCausalLM": 32768, "Phi3ForCausalLM": 4096}
_EPS_DEFAULT = {"Phi3ForCausalLM": 1e-5}  # the others: 1e-6

# canonical per-layer suffix -> checkpoint suffix (without the layer prefix and .weight/.bias)
_LLAMA_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
                "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
# Phi-3 stores q, k, v stacked in the rows of one qkv_proj, and gate, up in those of one gate_up_proj
_PHI3_FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
_OPT_LAYER = {"attn_norm": "self_attn_layer_norm", "mlp_norm": "final_layer_norm",
              "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.out_proj", "up": "fc1", "down": "fc2"}


def _bad(path: str, what: str) -> SyncdropError:
    return SyncdropError(f"model directory {path}: {what}")


def _require(raw: dict[str, Any], key: str, path: str) -> Any:
    if raw.get(key) is None:
        raise _bad(path, f"config.json lacks {key!r}")
    return raw[key]


def _rope(raw: dict[str, Any], path: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling or None)`` from transformers-5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` keys. A scaling type syncdrop's RoPE does not compute
    (:func:`syncdrop.models.rope.check_scaling`) or a partial rotary factor is refused."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    partial = scaling.pop("partial_rotary_factor", None)
    partial = raw.get("partial_rotary_factor") if partial is None else partial
    if partial is not None and float(partial) != 1.0:
        raise _bad(path, f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported")
    try:
        kind = check_scaling(scaling)
    except SyncdropError as e:
        raise _bad(path, e.message) from None
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
    if arch in POST_NORM_ARCHS:
        raise _bad(path, f"{arch} is not supported: {POST_NORM_ARCHS[arch]} normalises the attention output "
                         "before the residual add, so a dropped sync point cannot carry the attention partials "
                         "in the MLP's all-reduce as a sum (the norm of a sum is not the sum of the norms)")
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

    theta, scaling = _rope(raw, path)
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    sliding = None
    head_dim = raw.get("head_dim")
    qk_norm = False
    if arch == "LlamaForCausalLM":
        qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        mlp_bias = bool(raw.get("mlp_bias", False))
    elif arch == "MistralForCausalLM":
        qkv_bias = o_bias = mlp_bias = False
        sliding = raw.get("sliding_window", 4096)
    elif arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias, mlp_bias = True, False, False
        sliding = _qwen2_sliding(raw, path, common["num_layers"])
    elif arch == "Qwen3ForCausalLM":  # q/k norms; one attention_bias for q/k/v and o; head_dim defaults to 128
        qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        mlp_bias, qk_norm = False, True
        head_dim = raw.get("head_dim", 128)
        sliding = _qwen2_sliding(raw, path, common["num_layers"])
    else:  # Phi3: no biases; its sliding_window (if set) applies to every layer
        qkv_bias = o_bias = mlp_bias = False
        sliding = raw.get("sliding_window")
    return ModelConfig(
        family="llama",
        head_dim=int(head_dim or hidden // heads),
        num_kv_heads=kv_heads,
        intermediate_size=int(_require(raw, "intermediate_size", path)),
        norm_eps=float(raw.get("rms_norm_eps", _EPS_DEFAULT.get(arch, 1e-6))),
        act=str(raw.get("hidden_act", "silu")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_positions=int(raw.get("max_position_embeddings", _MAX_POS_DEFAULT[arch])),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        sliding_window=None if sliding is None else int(sliding),
        extra=extra,
        **common,
    )


def _qwen2_sliding(raw: dict[str, Any], path: str, num_layers: int) -> int | None:
    """Qwen2 and Qwen3 slide only when ``use_sliding_window``, and then only on layers >= ``max_window_layers``
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
    raise _bad(path, "Qwen2/Qwen3 with sliding window on only some layers (max_window_layers/layer_types) "
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


def fused_projections(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Checkpoint suffix of each fused projection -> the canonical projections stacked in its rows, in row
    order: Phi-3 ``{"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}``, else ``{}``.

    Block ``i``'s ``model.layers.{i}.self_attn.qkv_proj.weight`` is ``cat([q, k, v].weight)`` along rows (what a
    writer concatenates, and what :func:`checkpoint_slice` cuts apart)."""
    return dict(_PHI3_FUSED) if cfg.arch == "Phi3ForCausalLM" else {}


def _fused_rows(cfg: ModelConfig) -> dict[str, int]:
    d, i = cfg.head_dim, cfg.intermediate_size
    return {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d, "gate": i, "up": i}


def checkpoint_slice(name: str, cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """``(key, rows)``: the checkpoint key (without the optional ``model.`` prefix) holding canonical tensor
    ``name``, and the row range ``(lo, hi)`` it occupies there when that tensor is fused with others
    (:func:`fused_projections`), else None (the whole tensor)."""
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.(weight|bias)", name)
    for fused, parts in fused_projections(cfg).items():
        if m is not None and m[2] in parts:
            sizes = _fused_rows(cfg)
            lo = sum(sizes[p] for p in parts[: parts.index(m[2])])
            return f"layers.{m[1]}.{fused}.{m[3]}", (lo, lo + sizes[m[2]])
    return _plain_name(name, cfg), None


def checkpoint_name(name: str, cfg: ModelConfig) -> str:
    """Checkpoint key (without the optional ``model.`` prefix) of canonical tensor ``name``. ``ValueError``
    for a tensor a checkpoint stores as rows of a fused one (Phi-3's q/k/v, gate/up: :func:`checkpoint_slice`)."""
    key, rows = checkpoint_slice(name, cfg)
    if rows is not None:
        raise ValueError(f"{name} is rows {rows[0]}..{rows[1] - 1} of {key} in a {cfg.arch} checkpoint, not a "
                         "tensor of its own (see fused_projections)")
    return key


def _plain_name(name: str, cfg: ModelConfig) -> str:
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
        self._rows: dict[str, tuple[int, int]] = {}  # canonical name -> its rows in a fused tensor (Phi-3)
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
        """Canonical name -> checkpoint key (None: a synthesised non-affine LayerNorm parameter); the row
        ranges of fused tensors go to ``self._rows``, and a fused tensor must have exactly their rows."""
        cfg = self.config
        affine = cfg.extra.get("norm_affine", True)
        index: dict[str, str | None] = {}
        missing = []
        for name in model_names(cfg):
            if not affine and ("norm." in name):
                index[name] = None
                continue
            key, rows = checkpoint_slice(name, cfg)
            found = next((k for k in ("model." + key, key) if k in self._files), None)
            if found is None:
                shown = "model." + key if name != "lm_head" else key
                if shown not in missing:  # fused parts (Phi-3) share a key
                    missing.append(shown)
                continue
            index[name] = found
            if rows is not None:
                self._rows[name] = rows
                total = self._slice(found).get_shape()[0]
                fused = key.split(".", 2)[2].rsplit(".", 1)[0]  # layers.0.self_attn.qkv_proj.weight: self_attn.qkv_proj
                want = sum(_fused_rows(cfg)[p] for p in fused_projections(cfg)[fused])
                if total != want:
                    raise _bad(self.path, f"{found} has {total} rows, config.json implies {want}")
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

    def stored_dtype(self, name: str) -> str | None:
        """The safetensors dtype (``"BF16"``, ``"F32"``...) canonical tensor ``name`` is stored in, without
        reading it; None for a synthesised non-affine LayerNorm parameter."""
        key = self._key(name)
        return None if key is None else self._handle(self._files[key]).get_slice(key).get_dtype()

    def release(self) -> None:
        """Close the open files. ``safe_open`` memory-maps them, and every page read stays in this process's
        resident memory while the map is open; a reader that streams a whole checkpoint once (``syncdrop
        export``) calls this after each tensor, so that its RSS is one tensor, not the checkpoint. Files
        reopen on the next read."""
        self._handles.clear()

    def _slice(self, key: str) -> Any:
        return self._handle(self._files[key]).get_slice(key)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of canonical tensor ``name`` without reading it."""
        key = self._index[name]
        if key is None:
            return (self.config.hidden_size,)
        shape = tuple(self._slice(key).get_shape())
        lo, hi = self._rows.get(name, (0, shape[0]))
        return (hi - lo, *shape[1:])

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
        if name in self._rows:  # its rows of a fused tensor, read alone
            lo, hi = self._rows[name]
            return self._slice(key)[lo:hi].to(torch.float32).contiguous()
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
        sl = None if key is None else self._slice(key)
        shape = self.shape(name)
        r0, r1 = self._rows.get(name, (0, shape[0]))  # the canonical tensor's rows in the stored one
        if len(shape) <= dim:
            raise IndexError(f"{name}: get_cols needs a 2-D tensor, shape is {shape}")
        idx = normalize_index(index, shape[dim], name)
        if sl is None:
            return self._filled(name)[idx]
        if idx.numel() == 0:
            return torch.empty(shape[:dim] + (0,) + shape[dim + 1:], dtype=torch.float32)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        part = sl[r0 + lo : r0 + hi] if dim == 0 else sl[r0:r1, lo:hi]
        if idx.numel() != hi - lo or not torch.equal(idx, torch.arange(lo, hi)):
            part = part.index_select(dim, idx - lo)
        return part.to(torch.float32).contiguous()
