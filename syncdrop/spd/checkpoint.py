"""SPD checkpoint directories: a base model plus distilled blocks, the plan and per-block layouts.

What ``syncdrop distill --out DIR`` writes, and what ``--model DIR`` reads everywhere::

    DIR/syncdrop.json                    manifest (written last, atomically)
    DIR/blocks/block_007.safetensors     every canonical tensor of block 7 (``layers.7.*``), dense
                                         layout, float32; one file per distilled block, each written
                                         atomically as soon as the block is done (resume unit)

Manifest keys: ``format`` (``syncdrop-checkpoint``), ``version``, ``base_model`` (the spec that
resolves the unchanged tensors: ``smollm2``, an absolute path, or a hub id), ``tp`` (the degree the
blocks were distilled for: a distilled SPD block is trained for one split of heads over ranks),
``plan`` (a plan dict, tiers in ``meta``), ``blocks`` (``{"7": {"file", "tier", "head_order",
"ffn_order", "stats"}}``; ``head_order``/``ffn_order`` are the head-grouping permutations, ``null``
when the block keeps the default layout), ``distill`` (settings) and ``provenance``.

Only the distilled blocks are stored; the base model provides everything else, so the directory
is small and the base is never copied. Reads use safetensors (nothing is unpickled).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig
from syncdrop.plan import SyncPlan

CHECKPOINT_FORMAT = "syncdrop-checkpoint"
CHECKPOINT_VERSION = 1
MANIFEST = "syncdrop.json"


def block_file(index: int) -> str:
    return f"blocks/block_{index:03d}.safetensors"


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def save_block(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write one block's tensors (float32, contiguous) with ``meta`` as JSON in the safetensors
    header, atomically."""
    from safetensors.torch import save

    from syncdrop.io_utils import atomic_write_bytes

    data = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path, save(data, metadata={"syncdrop": json.dumps(meta)}))


def read_block_meta(path: str | Path) -> dict[str, Any] | None:
    """The ``meta`` stored by :func:`save_block`, or None if the file is missing or unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("syncdrop", "null"))
    except (OSError, ValueError, json.JSONDecodeError, Exception):  # safetensors raises its own error type
        return None


def load_block(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@dataclass
class SPDCheckpoint:
    """A parsed manifest (see module docstring)."""

    path: str
    base_model: str
    tp: int
    plan: SyncPlan
    blocks: dict[int, dict[str, Any]]
    data: dict[str, Any]

    def blocks_for(self, plan: SyncPlan) -> dict[int, dict[str, Any]]:
        """The distilled blocks that ``plan`` drops; the others would run with their sync, where the
        base model's block is the exact one (distilled weights are trained for the SPD form only)."""
        return {i: e for i, e in sorted(self.blocks.items()) if i in plan.dropped}

    def layouts(self, cfg: ModelConfig) -> dict[int, Any]:
        """``{block: ShardLayout}`` for the blocks with a head-grouping permutation."""
        from syncdrop.parallel.sharding import ShardLayout

        out = {}
        for i, b in self.blocks.items():
            if b.get("head_order") is not None or b.get("ffn_order") is not None:
                try:
                    out[i] = ShardLayout.build(cfg, self.tp, b.get("head_order"), b.get("ffn_order"))
                except ValueError as e:
                    raise SyncdropError(f"model {self.path}: block {i}: {e}") from e
        return out


def _bad(path: str, what: str) -> SyncdropError:
    return SyncdropError(f"model {path}: {what} (a directory written by `syncdrop distill`)")


def load_checkpoint(path: str) -> SPDCheckpoint:
    """Parse and validate ``path/syncdrop.json``; block files must exist."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _bad(path, f"cannot read {MANIFEST}: {e}") from e
    if not isinstance(d, dict) or d.get("format") != CHECKPOINT_FORMAT:
        raise _bad(path, f"{MANIFEST} has format {d.get('format') if isinstance(d, dict) else None!r}, "
                         f"expected {CHECKPOINT_FORMAT!r}")
    if d.get("version") != CHECKPOINT_VERSION:
        raise _bad(path, f"{MANIFEST} version {d.get('version')!r} is not supported (expected {CHECKPOINT_VERSION})")
    tp, base = d.get("tp"), d.get("base_model")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise _bad(path, f"tp must be a positive integer, got {tp!r}")
    if not isinstance(base, str) or not base:
        raise _bad(path, f"base_model must be a model spec, got {base!r}")
    plan = SyncPlan.from_dict(d.get("plan"), source=f"{mpath} plan")
    raw_blocks = d.get("blocks")
    if not isinstance(raw_blocks, dict):
        raise _bad(path, "blocks must be an object {index: entry}")
    blocks: dict[int, dict[str, Any]] = {}
    for k, b in raw_blocks.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < plan.num_blocks) or not isinstance(b, dict):
            raise _bad(path, f"blocks: bad entry {k!r}")
        f = b.get("file")
        if not isinstance(f, str) or not os.path.isfile(os.path.join(path, f)):
            raise _bad(path, f"block {k}: file {f!r} is missing")
        blocks[int(k)] = b
    return SPDCheckpoint(os.path.abspath(path), base, tp, plan, blocks, d)


class OverlayCheckpoint:
    """A checkpoint reader (see :class:`syncdrop.models.loading.CheckpointReader`): tensors of the
    distilled blocks from their safetensors files, everything else from the base reader."""

    def __init__(self, base: Any, ckpt: SPDCheckpoint) -> None:
        self.base, self.config = base, base.config
        self._files: dict[str, str] = {}
        self._cache: dict[str, torch.Tensor] = {}
        from safetensors import safe_open

        for i, b in ckpt.blocks.items():
            fpath = os.path.join(ckpt.path, b["file"])
            with safe_open(fpath, framework="pt") as f:
                for name in f.keys():
                    if not name.startswith(f"layers.{i}."):
                        raise _bad(ckpt.path, f"{b['file']} holds {name}, not a tensor of block {i}")
                    self._files[name] = fpath

    def names(self) -> list[str]:
        return self.base.names()

    def overridden(self) -> list[str]:
        return sorted(self._files)

    def shape(self, name: str) -> Sequence[int]:
        if name in self._files:
            return tuple(self.get(name).shape)
        return self.base.shape(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            return self.base.get(name)
        if name not in self._cache:
            from safetensors import safe_open

            with safe_open(self._files[name], framework="pt") as f:
                self._cache[name] = f.get_tensor(name).to(torch.float32)
        return self._cache[name]

    def get_rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self.get(name)[index] if name in self._files else self.base.get_rows(name, index)

    def get_cols(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self.get(name)[:, index] if name in self._files else self.base.get_cols(name, index)


def write_subset(out_dir: str | Path, bank: str | Path, plan: SyncPlan, base_model: str, tp: int) -> dict[str, Any]:
    """Write a checkpoint directory for ``plan`` whose distilled blocks are the ``bank``'s blocks
    that ``plan`` drops (no tensors are copied: entries point at the bank's files by relative path).

    Valid because B2B distillation feeds each block the original model's residual stream: block
    i's distilled weights do not depend on which other blocks are dropped, so a bank distilled
    for plan ``all`` restricted to a plan's blocks is what ``syncdrop distill --plan PLAN`` would
    train with the same settings. Blocks that ``plan`` drops but the bank lacks stay zero-shot.
    Returns the manifest.
    """
    from syncdrop.io_utils import atomic_write_json

    src = load_checkpoint(str(bank))
    if src.tp != tp:
        raise SyncdropError(f"bank {bank} was distilled for tp={src.tp}, not tp={tp}")
    out = Path(out_dir)
    blocks = {str(i): {**e, "file": os.path.relpath(os.path.join(src.path, e["file"]), out)}
              for i, e in src.blocks_for(plan).items()}
    manifest = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "base_model": base_model, "tp": tp,
                "plan": plan.to_dict(), "blocks": blocks, "distill": {"bank": src.path}}
    atomic_write_json(out / MANIFEST, manifest)
    return manifest
