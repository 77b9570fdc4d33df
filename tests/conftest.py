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

Tests that read the data folder carry ``@pytest.mark.needs_data(kind)`` (``"tasks"``: the lm-eval task
files; ``"wikitext2"``). Where the folder (``$SYNCDROP_DATA`` or ``../shared/data``) lacks those files they
are skipped with the reason "needs ../shared/data (...)" (printed by ``-rs``), except under
``SYNCDROP_REQUIRE_DATA=1`` (CI), where they fail instead: CI has the data, so a missing folder is a fault.

A newcomer's clone has no data folder. To run the suite as there, point ``SYNCDROP_DATA`` at an empty folder
(``SYNCDROP_DATA=$(mktemp -d) make test``): a non-empty ``$SYNCDROP_DATA`` is the data folder, and
``../shared/data`` is not looked at then. ``.ci/run`` runs such a pass after the main one. The header of every
run (not printed under ``-q``) names the data folder and whether it holds WikiText-2 and the task files.
"""

from __future__ import annotations

import functools
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
def tiny_vllm_dir(tmp_path_factory):
    """``tiny_vllm_dir(family)``: the tiny model at vLLM's sizes (head_dim 32, vocab 384: TP = 2 and 3 shard it)."""
    root = tmp_path_factory.mktemp("tiny_vllm")

    def make(family: str) -> Path:
        path = root / family
        if not path.exists():
            build_tiny_family(path, family, head_dim=32, vocab_size=384)
        return path

    return make


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A small English text file (for --dataset / --calib with the tiny models' tokenizer)."""
    p = tmp_path_factory.mktemp("data") / "sample.txt"
    p.write_text(SAMPLE_TEXT)
    return p


# ---------------------------------------------------------------- the needs_data marker

_DATA_MISSING = pytest.StashKey[str]()


@functools.cache
def _missing_data(kind: str, root: Path) -> str | None:
    """Why ``root`` cannot serve a ``needs_data(kind)`` test, or None when it has every file."""
    from syncdrop.eval.data import WIKITEXT_SPLITS

    if kind == "tasks":
        from syncdrop.eval.tasks import missing_task_files

        what, missing = "lm-eval task files", missing_task_files(root)
    elif kind == "wikitext2":
        what = "WikiText-2"
        files = sorted(set(WIKITEXT_SPLITS.values()))
        missing = [f"wikitext2/{f}" for f in files if not (root / "wikitext2" / f).is_file()]
    else:
        raise pytest.UsageError(f"needs_data: unknown kind {kind!r} (expected 'tasks' or 'wikitext2')")
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return f"needs ../shared/data ({what}: {missing[0]}{more} not in {root}; set SYNCDROP_DATA to the data folder)"


@functools.cache
def _missing_vllm() -> str | None:
    """Why ``needs_vllm`` tests cannot run (no vLLM environment), or None."""
    from syncdrop.errors import SyncdropError
    from syncdrop.serve.engine import vllm_python

    try:
        vllm_python()
    except SyncdropError as e:
        return f"needs vLLM ({e.message})"
    return None


def pytest_report_header(config: pytest.Config) -> str:
    """Which data folder this run sees (a pass with the data hidden says so at the top of its log)."""
    from syncdrop.eval.data import data_dir

    root = data_dir()
    found = [k for k in ("wikitext2", "tasks") if _missing_data(k, root) is None]
    have = f"has {' and '.join(found)}" if found else "has neither WikiText-2 nor the task files"
    return f"syncdrop data folder: {root} ({have}; SYNCDROP_REQUIRE_DATA={os.environ.get('SYNCDROP_REQUIRE_DATA', '')})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``needs_data`` tests without their data and ``needs_vllm`` tests without the vLLM environment: a skip
    with the reason, or (SYNCDROP_REQUIRE_DATA=1 / SYNCDROP_REQUIRE_VLLM=1, as `make test` sets) a failure."""
    from syncdrop.eval.data import data_dir

    require = os.environ.get("SYNCDROP_REQUIRE_DATA") == "1"
    require_vllm = os.environ.get("SYNCDROP_REQUIRE_VLLM") == "1"
    root = data_dir()
    for item in items:
        if item.get_closest_marker("needs_vllm") is not None and (why := _missing_vllm()):
            if require_vllm:
                item.stash[_DATA_MISSING] = f"{why} [SYNCDROP_REQUIRE_VLLM=1: failing instead of skipping]"
            else:
                item.add_marker(pytest.mark.skip(reason=why))
            continue
        kinds = [k for m in item.iter_markers("needs_data") for k in (m.args or ("tasks",))]
        reason = next((r for k in kinds if (r := _missing_data(k, root))), None)
        if reason is None:
            continue
        if require:
            item.stash[_DATA_MISSING] = f"{reason} [SYNCDROP_REQUIRE_DATA=1: failing instead of skipping]"
        else:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Under SYNCDROP_REQUIRE_DATA=1 a ``needs_data`` test whose data is missing fails (its body is not run)."""
    reason = item.stash.get(_DATA_MISSING, None)
    if reason is not None:
        pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3: q/k norms (head_dim 16, twice hidden / heads), 2 KV heads, tied embeddings."""
    return build_tiny_family(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj as transformers saves them, 3 KV heads."""
    return build_tiny_family(tmp_path_factory.mktemp("tiny_phi3"), "phi3")


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> Path:
    """Llama with Llama 3.x ``llama3`` rope scaling (``syncdrop.tiny_models.LLAMA3_ROPE``)."""
    return build_tiny_family(tmp_path_factory.mktemp("tiny_llama3"), "llama3")
