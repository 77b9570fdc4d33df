"""Tiny random transformers checkpoints of every family syncdrop loads, for tests and smoke runs.

Each is a real ``save_pretrained`` directory (config.json, model.safetensors, tokenizer.json) that
stock transformers loads, with every parameter re-drawn from a seeded generator (matrices
N(0, 0.08), biases N(0, 0.1), norm gains 1 + N(0, 0.1)), so biases and norm weights are
non-trivial. Shapes: hidden 48 (6 heads of 8), 2 layers, vocab 300, intermediate 96, 128
positions; tokenizer: byte-level BPE with 300 entries, ``<unk>``/``<s>``/``</s>`` = 0/1/2.

=========  ==========  =====  ==============================================
family     class       kv     notable
=========  ==========  =====  ==============================================
llama      Llama       2      GQA, untied lm_head
llama3     Llama       2      Llama 3.x ``llama3`` rope scaling (factor 8 over 64 positions)
mistral    Mistral     3      GQA, sliding_window 4096 (> any test sequence)
qwen2      Qwen2       3      q/k/v biases
qwen3      Qwen3       2      q/k norms, head_dim 2x (16: q width 96 != 48), tied
phi3       Phi3        3      fused qkv_proj and gate_up_proj (as saved)
opt        OPT         6      biases everywhere, relu, tied, LayerNorm
=========  ==========  =====  ==============================================
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
            max_position_embeddings=128)
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Tensor parallelism splits each layer across devices. ",
    "Sync points are all-reduce operations after attention and the MLP. ",
]
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "opt")
SEEDS = {"llama": 1, "mistral": 2, "qwen2": 3, "opt": 4, "qwen3": 5, "phi3": 6, "llama3": 7}
# Llama 3.1's rope scaling with the original context shrunk to 64 positions, so that at head_dim 8 (theta 1e4:
# wavelengths 6.3, 63, 628, 6283 positions) one frequency is kept, one interpolated and two divided by 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_tokenizer():
    """Deterministic byte-level BPE with 300 entries, wrapped for ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer)
    if tok.get_vocab_size() > TINY["vocab_size"]:
        raise AssertionError(f"tiny tokenizer has {tok.get_vocab_size()} entries, more than the model's vocab")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter so weights, biases and norm gains all differ from their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)
    return model.eval()


def tiny_config(family: str, head_dim: int = 8, vocab_size: int | None = None):
    """The transformers config of the tiny ``family`` model (see the module table). ``head_dim`` scales
    the widths (hidden = 6 heads x head_dim, MLP = 2 x hidden) and ``vocab_size`` may exceed the tokenizer's
    300 entries: vLLM's CPU attention needs head_dim >= 32, and vLLM pads the vocabulary to a multiple of 64
    that TP must divide (384 serves TP = 2 and 3)."""
    from transformers import LlamaConfig, MistralConfig, OPTConfig, Phi3Config, Qwen2Config, Qwen3Config

    ids = dict(bos_token_id=1, eos_token_id=2)
    hidden = TINY["num_attention_heads"] * head_dim
    shape = {**TINY, "hidden_size": hidden, "vocab_size": vocab_size or TINY["vocab_size"]}
    ffn = 2 * hidden
    if family == "llama":
        return LlamaConfig(**shape, num_key_value_heads=2, intermediate_size=ffn, rope_theta=10000.0, **ids,
                           tie_word_embeddings=False)
    if family == "llama3":
        return LlamaConfig(**shape, num_key_value_heads=2, intermediate_size=ffn, **ids, tie_word_embeddings=False,
                           rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0})
    if family == "mistral":
        return MistralConfig(**shape, num_key_value_heads=3, intermediate_size=ffn, sliding_window=4096, **ids,
                             tie_word_embeddings=False)
    if family == "qwen2":
        return Qwen2Config(**shape, num_key_value_heads=3, intermediate_size=ffn, rope_theta=1000000.0, **ids,
                           tie_word_embeddings=False)
    if family == "qwen3":  # head_dim is its own key in Qwen3 (default 128), here twice hidden / heads
        return Qwen3Config(**shape, num_key_value_heads=2, head_dim=2 * head_dim, intermediate_size=ffn,
                           rope_theta=1000000.0, **ids, tie_word_embeddings=True)
    if family == "phi3":
        return Phi3Config(**shape, num_key_value_heads=3, intermediate_size=ffn, rope_theta=10000.0, **ids,
                          pad_token_id=None, original_max_position_embeddings=shape["max_position_embeddings"],
                          tie_word_embeddings=False)
    if family == "opt":
        return OPTConfig(**shape, ffn_dim=ffn, word_embed_proj_dim=hidden, activation_function="relu",
                         **ids, pad_token_id=0, tie_word_embeddings=True)
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


def build_tiny(path: str | Path, config, seed: int = 0) -> Path:
    """Instantiate ``config`` as a causal LM, randomise it, save model + tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def build_tiny_family(path: str | Path, family: str, head_dim: int = 8, vocab_size: int | None = None) -> Path:
    """The tiny ``family`` checkpoint (fixed seed per family) saved to ``path``."""
    return build_tiny(path, tiny_config(family, head_dim, vocab_size), SEEDS[family])
