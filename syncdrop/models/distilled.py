"""Reading ``syncdrop distill`` directories: a base model plus distilled blocks, the plan and per-block
head-grouping permutations. The writing side is :mod:`syncdrop.spd.checkpoint`.

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

This module sits with the model readers (below the plan's consumers): it parses the manifest into
a :class:`SPDCheckpoint` and lays the distilled tensors over the base reader
(:class:`OverlayCheckpoint`). Turning the permutations into per-block shard layouts is the
parallel layer's job (:func:`syncdrop.parallel.sharding.distilled_layouts`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from syncdrop.errors import SyncdropError

if TYPE_CHECKING:
    from syncdrop.plan import SyncPlan

CHECKPOINT_FORMAT = "syncdrop-checkpoint"
CHECKPOINT_VERSION = 1
MANIFEST = "syncdrop.json"


def block_file(index: int) -> str:
    """Path of block ``index``'s tensors relative to the directory, ``blocks/block_007.safetensors``."""
    return f"blocks/block_{index:03d}.safetensors"


def is_checkpoint_dir(path: str) -> bool:
    """True when ``path`` holds a manifest (``syncdrop.json``)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def read_block_meta(path: str | Path) -> dict[str, Any] | None:
    """The ``meta`` stored by :func:`syncdrop.spd.checkpoint.save_block` (JSON under ``syncdrop`` in the
    safetensors header), or None if the file is missing or unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("syncdrop", "null"))
    except (OSError, ValueError, json.JSONDecodeError, Exception):  # safetensors raises its own error type
        return None


@dataclass
class SPDCheckpoint:
    """A parsed manifest (see the module docstring)."""

    path: str
    base_model: str
    tp: int
    plan: SyncPlan
    blocks: dict[int, dict[str, Any]]
    data: dict[str, Any]

    def blocks_for(self, plan: SyncPlan) -> dict[int, dict[str, Any]]:
        """The distilled blocks that run under ``plan``: a block trained as an SPD block (this checkpoint's plan
        drops its attention sync) wherever ``plan`` drops it too, whatever its MLP point carries; a block
        trained under other sync modes (compressed sync points) where ``plan`` gives it the same modes. Any
        other block runs with the base model's weights, the exact block for a plain sync point (distilled
        weights are trained for one form of their block)."""
        def runs(i: int) -> bool:
            trained, want = self.plan.blocks[i], plan.blocks[i]
            return want.attn.drops if trained.attn.drops else (want == trained and not want.is_dense)

        return {i: e for i, e in sorted(self.blocks.items()) if runs(i)}


def _bad(path: str, what: str) -> SyncdropError:
    return SyncdropError(f"model {path}: {what} (a directory written by `syncdrop distill`)")


def load_checkpoint(path: str) -> SPDCheckpoint:
    """Parse and validate ``path/syncdrop.json``; block files must exist."""
    from syncdrop.plan import SyncPlan

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

    def release(self) -> None:
        """Drop the distilled tensors read so far and release the base reader's files (see
        :meth:`syncdrop.models.hf_reader.HFCheckpoint.release`); both are read again when next needed."""
        self._cache.clear()
        if hasattr(self.base, "release"):
            self.base.release()

    def overridden(self) -> list[str]:
        """Canonical names read from the distilled block files, sorted."""
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


def blocks_digest(spec: str) -> str | None:
    """SHA-256 of a ``syncdrop distill`` directory's blocks and plan (its manifest's ``blocks`` and
    ``plan``), None for any other model spec: what an evaluation cache keys on, so that a retrained
    directory is re-evaluated and a rerun that only rewrote the manifest's provenance is not."""
    import hashlib

    manifest = os.path.join(spec, MANIFEST)
    if not os.path.isfile(manifest):
        return None
    with open(manifest) as f:
        m = json.load(f)
    return hashlib.sha256(json.dumps([m.get("blocks"), m.get("plan")], sort_keys=True).encode()).hexdigest()
