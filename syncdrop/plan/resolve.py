"""The one owner of a plan: parse it, resolve it against a model and a TP degree, validate it.

Every command and library entry point (the CLI, the launcher, the runtime, ``auto``, export, the
vLLM plugin, the cost model) turns what the user gave into a :class:`SyncPlan` through
:func:`resolve_plan`, so a plan means the same everywhere and is checked once, the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError
from syncdrop.plan.spec import parse_plan
from syncdrop.plan.sync_plan import SyncPlan

log = logging.getLogger(__name__)

OWN_PLAN = "model"  # the spec that names the model's own plan (``--plans model``)


def resolve_plan(spec: str | Path | SyncPlan | dict[str, Any] | None, num_blocks: int, *, tp: int | None = None,
                 own: SyncPlan | None = None, variant: str = "drop", serving: bool = False,
                 what: str = "plan", hidden: int | None = None) -> SyncPlan:
    """The plan to run, checked.

    ``spec``: a spec string or JSON path (:func:`~syncdrop.plan.spec.parse_plan`), a plan's JSON
    dict, a :class:`SyncPlan`, ``"model"`` (the model's own plan, ``own``; an error when it has
    none), or None (``own``, else ``none``). ``num_blocks``: the model's block count, which the plan
    must have. ``tp``: the degree it will run at (a plan made from a profile at another degree is
    warned about: its sensitivities were measured for another split of heads). ``serving``: also
    require that vLLM's plugin can serve it. ``what``: the field errors name (``plan``, ``plans``).
    ``hidden``: the model's hidden size, which every mode must accept (e.g. a wire group size divides it).
    """
    if isinstance(spec, SyncPlan):
        plan = spec
    elif spec is None:
        plan = own if own is not None else SyncPlan.uniform(num_blocks)
    elif isinstance(spec, dict):
        plan = SyncPlan.from_dict(spec, num_blocks, source=what)
    elif str(spec) == OWN_PLAN:
        if own is None:
            raise SyncdropError(f"{OWN_PLAN}: the model has no plan of its own (a `syncdrop distill` directory or a "
                                "`syncdrop train` export has one)", field=what)
        plan = own
    else:
        plan = parse_plan(str(spec), num_blocks, variant)
    if plan.num_blocks != num_blocks:
        raise SyncdropError(f"has {plan.num_blocks} blocks but the model has {num_blocks}", field=what)
    if tp is not None:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise SyncdropError(f"must be a positive integer, got {tp!r}", field="tp")
        made_at = (plan.meta.get("profile") or {}).get("tp") if isinstance(plan.meta.get("profile"), dict) else None
        if isinstance(made_at, int) and made_at != tp:
            log.warning("the plan was chosen from a sensitivity profile measured at tp=%d; it runs at tp=%d, where "
                        "each rank holds other heads, so its predicted perplexity does not apply", made_at, tp)
    if hidden is not None:
        try:
            plan.check(hidden)
        except SyncdropError as e:
            raise SyncdropError(f"{spec!r}: {e.message}" if isinstance(spec, str) else e.message, field=what) from None
    if serving:
        why = plan.vllm_blocker()
        if why:
            raise SyncdropError(f"cannot be served by vLLM: {why}", field=what)
    return plan
