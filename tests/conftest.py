"""Shared fixtures: tiny random transformers checkpoints of every family, and the real SmolLM2.

Tiny models (built with transformers, saved with ``save_pretrained``, session-scoped):

=================  ==========  =====  ======  =========================================
fixture            class       heads  kv      notable
=================  ==========  =====  ======  =========================================
tiny_llama_dir     Llama       6      2       GQA, untied lm_head
tiny_mistral_dir   Mistral     6      3       GQA, sliding_window 4096 (> any test seq)
tiny_qwen2_dir     Qwen2       6      3       q/k/v biases
tiny_opt_dir       OPT         6      6       biases everywhere, relu, tied, LayerNorm
=================  ==========  =====  ======  =========================================

All have hidden 48 (head_dim 8), 2 layers, vocab 300, intermediate 96, 128 positions, and a
byte-level BPE tokenizer (``tokenizer.json``, vocab 300, ``<unk>``/``<s>``/``</s>`` = 0/1/2), so
``AutoTokenizer.from_pretrained(dir)`` works. Every parameter is re-drawn from a seeded generator
(matrices N(0, 0.08), biases N(0, 0.1), norm weights 1 + N(0, 0.1)) so biases and norm weights
are non-trivial.

``smollm2_source`` is ``resolve_model("smollm2")``; ``smollm2_hf`` is transformers' own model
loaded from the same GGUF (float32, eval mode; ~30 s, so load it once per session).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
            max_position_embeddings=128)
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Tensor parallelism splits each layer across devices. ",
    "Sync points are all-reduce operations after attention and the MLP. ",
]


def _tiny_tokenizer():
    """Deterministic byte-level BPE with 300 entries, wrapped for ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer)
    assert tok.get_vocab_size() <= TINY["vocab_size"]
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


def build_tiny(path: Path, config, seed: int = 0) -> Path:
    """Instantiate ``config`` as a causal LM, randomise it, save model + tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)
    model.save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, num_key_value_heads=2, intermediate_size=96, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return build_tiny(tmp_path_factory.mktemp("tiny_llama"), cfg, seed=1)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    from transformers import MistralConfig

    cfg = MistralConfig(**TINY, num_key_value_heads=3, intermediate_size=96, sliding_window=4096,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return build_tiny(tmp_path_factory.mktemp("tiny_mistral"), cfg, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY, num_key_value_heads=3, intermediate_size=96, rope_theta=1000000.0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return build_tiny(tmp_path_factory.mktemp("tiny_qwen2"), cfg, seed=3)


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory) -> Path:
    from transformers import OPTConfig

    cfg = OPTConfig(**TINY, ffn_dim=96, word_embed_proj_dim=TINY["hidden_size"], activation_function="relu",
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    return build_tiny(tmp_path_factory.mktemp("tiny_opt"), cfg, seed=4)


@pytest.fixture(scope="session")
def smollm2_source():
    """The default model resolved by syncdrop (GGUF header only; weights are read lazily)."""
    from syncdrop.models.loading import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_source):
    """transformers' LlamaForCausalLM loaded from the same GGUF (float32, eval): the reference."""
    from transformers import AutoModelForCausalLM

    path = smollm2_source.path
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog. " * 40
               + "Tensor parallelism splits each layer across devices. " * 30)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A small English text file (for --dataset / --calib with the tiny models' tokenizer)."""
    p = tmp_path_factory.mktemp("data") / "sample.txt"
    p.write_text(SAMPLE_TEXT)
    return p
