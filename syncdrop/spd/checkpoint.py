"""Writing SPD checkpoint directories (``syncdrop distill --out DIR``): block files and subsets of a bank.

The directory format and its reading side (manifest constants, :class:`SPDCheckpoint`,
:func:`load_checkpoint`, :class:`OverlayCheckpoint`) live in :mod:`syncdrop.models.distilled`, beside
the other model readers, so that resolving ``--model DIR`` needs nothing from :mod:`syncdrop.spd`.
They are re-exported here: ``from syncdrop.spd.checkpoint import load_checkpoint`` keeps working.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.distilled import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    MANIFEST,
    OverlayCheckpoint,
    SPDCheckpoint,
    block_file,
    is_checkpoint_dir,
    load_checkpoint,
    read_block_meta,
)
from syncdrop.plan import SyncPlan

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "MANIFEST", "OverlayCheckpoint", "SPDCheckpoint", "block_file",
           "is_checkpoint_dir", "load_block", "load_checkpoint", "read_block_meta", "save_block", "write_subset"]


def save_block(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write one block's tensors (float32, contiguous) with ``meta`` as JSON in the safetensors
    header, atomically (read back by :func:`~syncdrop.models.distilled.read_block_meta`)."""
    from safetensors.torch import save

    from syncdrop.io_utils import atomic_write_bytes

    data = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path, save(data, metadata={"syncdrop": json.dumps(meta)}))


def load_block(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one block file (what resuming a distillation reloads)."""
    from safetensors.torch import load_file

    return load_file(str(path))


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
