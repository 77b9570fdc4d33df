"""Sync plans: which sync mode each block's two sync points use (data, not code).

* :mod:`syncdrop.plan.modes`: the sync modes, one class each (block math, payload, servability);
* :mod:`syncdrop.plan.wire`: low-bit wire formats and the two-step all-reduce of the compressed mode;
* :mod:`syncdrop.plan.sync_plan`: :class:`SyncPlan`, a list of per-block modes, its derived facts and JSON form;
* :mod:`syncdrop.plan.spec`: the CLI's spec strings (``frac:0.5``, ``blocks:0,3``, ...);
* :mod:`syncdrop.plan.resolve`: :func:`resolve_plan`, the one place a plan is parsed, resolved and validated.
"""

from syncdrop.plan.modes import (
    DROP,
    FULL,
    PARTIAL_MASKS,
    BiasInSum,
    Compressed,
    Desync,
    Drop,
    DropMode,
    Full,
    Naive,
    Partial,
    SyncMode,
    drop_variants,
    mode_named,
    named_modes,
    parse_mode,
    register,
)
from syncdrop.plan.resolve import OWN_PLAN, resolve_plan
from syncdrop.plan.spec import PLAN_SPEC_HELP, parse_plan, split_plan_list
from syncdrop.plan.sync_plan import PLAN_FORMAT, BlockSync, SyncPlan, SyncPoint

DROP_VARIANTS = drop_variants()  # names of the modes that remove the attention sync point

__all__ = [
    "DROP", "DROP_VARIANTS", "FULL", "OWN_PLAN", "PARTIAL_MASKS", "PLAN_FORMAT", "PLAN_SPEC_HELP", "BiasInSum",
    "BlockSync", "Compressed", "Desync", "Drop", "DropMode", "Full", "Naive", "Partial", "SyncMode", "SyncPlan",
    "SyncPoint",
    "drop_variants", "mode_named", "named_modes", "parse_mode", "parse_plan", "register", "resolve_plan",
    "split_plan_list",
]
