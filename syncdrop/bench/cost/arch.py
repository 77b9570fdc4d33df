"""Architectures the cost model knows, and what the slowest rank holds of each block.

Every rank runs the largest rank's head and channel counts (the executors pad to them), so a block
costs what its slowest rank computes: ``q, kv`` query and KV heads, ``I_r`` MLP channels, asked of
the shard layout the runtime builds (:meth:`syncdrop.parallel.sharding.ShardLayout.build`). Its
weight-matrix elements (``h`` hidden size, ``d`` head dim; biases and norms ignored)::

    P_layer = h*q*d (Q) + 2*h*kv*d (K, V) + q*d*h (O) + (3 if gated else 2) * h * I_r
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig


def _llama(arch: str, vocab: int, h: int, layers: int, heads: int, kv: int, ffn: int, tie: bool = False,
           **kw: Any) -> ModelConfig:
    return ModelConfig(family="llama", arch=arch, vocab_size=vocab, hidden_size=h, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=h // heads, intermediate_size=ffn,
                       tie_embeddings=tie, **kw)


MODELS: dict[str, ModelConfig] = {
    # Shapes from the models' config.json (LLaMA2: Touvron et al. 2023; SmolLM2-135M: the GGUF header).
    "smollm2": _llama("LlamaForCausalLM", 49152, 576, 30, 9, 3, 1536, tie=True, rope_theta=100000.0,
                      max_positions=8192),
    "llama2-7b": _llama("LlamaForCausalLM", 32000, 4096, 32, 32, 32, 11008, max_positions=4096),
    "llama2-13b": _llama("LlamaForCausalLM", 32000, 5120, 40, 40, 40, 13824, max_positions=4096),
    "llama2-70b": _llama("LlamaForCausalLM", 32000, 8192, 80, 64, 8, 28672, max_positions=4096),
}


def get_model(name: str) -> ModelConfig:
    """A named architecture (:data:`MODELS`); raises :class:`SyncdropError` naming the choices."""
    key = name.strip().lower()
    if key not in MODELS:
        raise SyncdropError(f"--cluster {name!r}: unknown model; choose one of {', '.join(MODELS)}")
    return MODELS[key]


def bench_model_config(name: str, hidden: int, layers: int, where: str) -> ModelConfig:
    """Architecture of a bench file's model: a named one, else resolved like ``--model`` (reads a header);
    it must have the ``hidden`` size and ``layers`` the file records. Errors start with ``where``."""
    cfg = MODELS.get(name)
    if cfg is None:
        from syncdrop.models.loading import resolve_model

        try:
            cfg = resolve_model(name).config
        except SyncdropError as e:
            raise SyncdropError(f"{where}: cannot get the architecture of model {name!r} ({e})") from None
    if (cfg.hidden_size, cfg.num_layers) != (hidden, layers):
        raise SyncdropError(f"{where}: model {name!r} has h={cfg.hidden_size}, L={cfg.num_layers} but the file's "
                            f"settings say h={hidden}, L={layers}")
    return cfg


@dataclass(frozen=True)
class RankShare:
    """What the slowest rank computes per block: query heads, KV heads, MLP channels."""

    q_heads: int
    kv_heads: int
    ffn: int


def _share(layout) -> RankShare:
    """The slowest rank of a :class:`~syncdrop.parallel.sharding.ShardLayout`: every rank runs the
    largest rank's head and channel counts (the executors pad to them)."""
    return RankShare(layout.max_q, layout.max_kv, layout.max_ffn)


def block_shares(cfg: ModelConfig, n_ranks: int, block_layouts: dict | None = None) -> list[RankShare]:
    """Per block, the slowest rank's share, asked of the shard layout the runtime builds
    (:meth:`syncdrop.parallel.sharding.ShardLayout.build`; ``block_layouts``: the head-grouping
    layouts of a distilled directory, :func:`~syncdrop.parallel.sharding.distilled_layouts`).
    Without ``block_layouts`` every block has the same share: ``block_shares(cfg, N)[0]``."""
    from syncdrop.parallel.sharding import ShardLayout  # lazily: the CLI parser imports this module

    if n_ranks < 1 or n_ranks > cfg.num_heads:
        raise SyncdropError(f"--gpus {n_ranks}: must be between 1 and the model's {cfg.num_heads} query heads")
    base = _share(ShardLayout.build(cfg, n_ranks))
    return [_share(block_layouts[i]) if block_layouts and i in block_layouts else base for i in range(cfg.num_layers)]


def layer_weights(cfg: ModelConfig, share: RankShare) -> int:
    """``P_layer``: weight-matrix elements of one block on the rank with ``share`` (biases and norms ignored)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * share.q_heads * d + 2 * h * share.kv_heads * d + share.q_heads * d * h
    mlp = (3 if cfg.gated_mlp else 2) * h * share.ffn
    return attn + mlp
