"""Sync-Point Drop tooling: per-block sensitivity profiling (:mod:`syncdrop.spd.profile`) and
sensitivity-guided planning (:mod:`syncdrop.spd.planning`); block-to-block
distillation (:mod:`syncdrop.spd.distill`), head grouping (:mod:`syncdrop.spd.head_grouping`) and
distilled checkpoint directories (:mod:`syncdrop.spd.checkpoint`). The methods: docs/methods.md.

Exports are loaded lazily so that building the CLI parser does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

PROFILE_FORMAT = "syncdrop-profile"
PROFILE_VERSION = 1
SENSITIVITIES = ("progressive", "isolated")
TIERS = ("zs", "b2b", "hg+b2b")
HG_UNITS = ("group", "head")  # head grouping moves whole KV groups or single query heads
HG_MLP = ("shard", "channel", "none")  # MLP matching: whole shards, single channels, or none

_EXPORTS = {
    "BlockSensitivity": "profile",
    "Profile": "profile",
    "profile_sensitivity": "profile",
    "plot_profile": "profile",
    "LoadedProfile": "planning",
    "load_profile": "planning",
    "validate_profile": "planning",
    "drop_order": "planning",
    "choose_blocks": "planning",
    "tier_of": "planning",
    "make_plan": "planning",
    "tiers": "planning",
}

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "SENSITIVITIES", "TIERS", "HG_UNITS", "HG_MLP", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"syncdrop.spd.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'syncdrop.spd' has no attribute {name!r}")
