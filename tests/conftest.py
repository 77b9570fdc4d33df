"""Shared fixtures: tiny random transformers checkpoints of every family, and the real SmolLM2.

Tiny models (:mod:`syncdrop.tiny_models`, saved with ``save_pretrained``, session-scoped):

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

from syncdrop.tiny_models import build_tiny_family


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_family(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return build_tiny_family(tmp_path_factory.mktemp("tiny_mistral"), "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_family(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory) -> Path:
    return build_tiny_family(tmp_path_factory.mktemp("tiny_opt"), "opt")


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
