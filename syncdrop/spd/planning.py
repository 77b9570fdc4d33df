"""From a sensitivity profile to a sync plan (docs/methods.md, sensitivity profiling and tiers).

Blocks are sorted by sensitivity, ascending (ties: the later block first), and the least
sensitive are dropped:

* ``spd=F``: the ``round(F * L)`` least sensitive blocks;
* ``max_ppl_increase=X``: the longest prefix of that order whose *predicted* perplexity increase
  stays within ``X * baseline_ppl`` (X relative: 0.01 = 1%). The prediction is the sum of the
  chosen blocks' sensitivities, i.e. it assumes the deltas add up. That is exact for progressive
  sensitivities when the chosen blocks are a suffix ``i..L-1`` (the deltas telescope) and an
  approximation otherwise (and always, for isolated sensitivities): blocks interact. It is a
  prediction, not a measurement; ``syncdrop ppl --plan plan.json`` measures it (on the test split,
  where the profile used calibration data).

Each dropped block gets a tier (docs/methods.md, tiers) by its sensitivity ``s``: ``zs`` (zero-shot drop,
``s <= tau1``), ``b2b`` (block-to-block distillation, ``tau1 < s <= tau2``), ``hg+b2b`` (head
grouping then B2B, ``s > tau2``). The thresholds are perplexity deltas, given absolute or as a
percentage of the baseline perplexity (``"0.1%"``). Defaults, from measurements on SmolLM2
(docs/spd.md, results/spd_sweep_tp3): ``tau1 = 0``, so only blocks that the profile finds harmless
(s <= 0) are dropped zero-shot. Even those cost +2.3% test perplexity at TP=3 (blocks 7, 24, 28),
which B2B brings back to 0%; a 4 x 512-token profile cannot resolve deltas below about 0.6 ppl.
``tau2 = 1%`` of the baseline: above it, HG+B2B, which beat B2B at every SPD fraction from 0.2 to 1.0
there. ``syncdrop distill`` trains the b2b and hg+b2b blocks; zs blocks keep their weights.

``SyncPlan.from_dict`` keeps only ``attn``/``mlp`` per block, so tiers live in
``plan.meta["tiers"]`` as ``{"<block index>": tier}`` (string keys, as JSON has them), next to the
profile's path, SHA-256, model and TP. The plan is an ordinary plan file: ``--plan plan.json``
accepts it everywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError
from syncdrop.io_utils import portable_path
from syncdrop.plan import SyncPlan, parse_plan
from syncdrop.spd import PROFILE_FORMAT, SENSITIVITIES

DEFAULT_TAU1 = "0"
DEFAULT_TAU2 = "1%"


@dataclass
class LoadedProfile:
    """A validated profile file: its dict, where it came from and its SHA-256."""

    data: dict[str, Any]
    path: str
    sha256: str

    @property
    def num_blocks(self) -> int:
        return len(self.data["blocks"])

    @property
    def baseline_ppl(self) -> float:
        return float(self.data["baseline_ppl"])

    def sensitivity(self, kind: str) -> list[float]:
        if kind not in SENSITIVITIES:
            raise SyncdropError(f"--sensitivity must be one of {', '.join(SENSITIVITIES)}, got {kind!r}")
        return [float(b[kind]) for b in self.data["blocks"]]


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_profile(d: Any, source: str = "profile") -> dict[str, Any]:
    """Check the structure of a profile dict; raise :class:`SyncdropError` naming the problem."""
    if not isinstance(d, dict):
        raise SyncdropError(f"{source}: expected a JSON object written by `syncdrop profile`")
    if d.get("format") != PROFILE_FORMAT:
        raise SyncdropError(f"{source}: format is {d.get('format')!r}, expected {PROFILE_FORMAT!r} "
                            "(a file written by `syncdrop profile`)")
    if not _number(d.get("baseline_ppl")) or d["baseline_ppl"] <= 0:
        raise SyncdropError(f"{source}: baseline_ppl must be a positive number, got {d.get('baseline_ppl')!r}")
    blocks = d.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise SyncdropError(f"{source}: expected a non-empty 'blocks' list")
    declared = d.get("num_blocks", len(blocks))
    if declared != len(blocks):
        raise SyncdropError(f"{source}: num_blocks={declared} but {len(blocks)} blocks listed")
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("index") != i:
            raise SyncdropError(f"{source}: blocks[{i}] must be an object with index {i}")
        for k in SENSITIVITIES:
            if not _number(b.get(k)):
                raise SyncdropError(f"{source}: blocks[{i}].{k} must be a finite number, got {b.get(k)!r}")
    return d


def load_profile(path: str | Path, num_blocks: int | None = None) -> LoadedProfile:
    """Read and validate a profile file; ``num_blocks``: also require that many blocks."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SyncdropError(f"profile file not found: {p}") from None
    except IsADirectoryError:
        raise SyncdropError(f"profile path {p} is a directory, expected a profile JSON file") from None
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SyncdropError(f"profile file {p} is not valid JSON: {e}") from None
    validate_profile(d, f"profile file {p}")
    if num_blocks is not None and len(d["blocks"]) != num_blocks:
        raise SyncdropError(f"profile file {p} has {len(d['blocks'])} blocks but the model has {num_blocks}")
    return LoadedProfile(d, str(p), hashlib.sha256(raw).hexdigest())


def parse_threshold(text: str | float, baseline_ppl: float, flag: str) -> float:
    """``"0.1%"`` -> 0.001 * baseline; ``"0.05"`` -> 0.05 (a perplexity delta)."""
    s = str(text).strip()
    rel = s.endswith("%")
    try:
        v = float(s[:-1] if rel else s)
    except ValueError:
        raise SyncdropError(f"{flag} must be a perplexity delta (e.g. 0.05) or a percentage of the baseline "
                            f"perplexity (e.g. 0.1%), got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise SyncdropError(f"{flag} must be a finite number >= 0, got {text!r}")
    return v / 100 * baseline_ppl if rel else v


def drop_order(sens: list[float]) -> list[int]:
    """Block indices by sensitivity, ascending; ties go to the later block first."""
    return sorted(range(len(sens)), key=lambda i: (sens[i], -i))


def tier_of(s: float, tau1: float, tau2: float) -> str:
    """``zs`` (s <= tau1), ``b2b`` (tau1 < s <= tau2) or ``hg+b2b`` (s > tau2); one of :data:`TIERS`."""
    return "zs" if s <= tau1 else ("b2b" if s <= tau2 else "hg+b2b")


def choose_blocks(sens: list[float], baseline_ppl: float, spd: float | None = None,
                  max_ppl_increase: float | None = None) -> list[int]:
    """The blocks to drop (in drop order): by SPD fraction or by predicted-perplexity budget."""
    if (spd is None) == (max_ppl_increase is None):
        raise SyncdropError("give exactly one of --spd or --max-ppl-increase")
    order = drop_order(sens)
    if spd is not None:
        if not (math.isfinite(spd) and 0 <= spd <= 1):
            raise SyncdropError(f"--spd must be a fraction between 0 and 1, got {spd}")
        return order[: round(spd * len(sens))]
    if not (math.isfinite(max_ppl_increase) and max_ppl_increase >= 0):
        raise SyncdropError(f"--max-ppl-increase must be a relative increase >= 0 (0.01 = 1%), got {max_ppl_increase}")
    budget = max_ppl_increase * baseline_ppl
    # the prefix sums fall while sensitivities are negative and rise after, so the largest k within
    # the budget is also the largest k with every shorter prefix within it
    k, acc = 0, 0.0
    for n, i in enumerate(order, 1):
        acc += sens[i]
        if acc <= budget:
            k = n
    return order[:k]


def make_plan(
    profile: LoadedProfile, spd: float | None = None, max_ppl_increase: float | None = None,
    sensitivity: str = "progressive", tau1: str | float = DEFAULT_TAU1, tau2: str | float = DEFAULT_TAU2,
    variant: str = "drop",
) -> SyncPlan:
    """Plan dropping the least sensitive blocks of ``profile`` (see the module docstring)."""
    sens = profile.sensitivity(sensitivity)
    base = profile.baseline_ppl
    t1, t2 = parse_threshold(tau1, base, "--tau1"), parse_threshold(tau2, base, "--tau2")
    if t1 > t2:
        raise SyncdropError(f"--tau1 ({t1:.6g}) must not exceed --tau2 ({t2:.6g})")
    chosen = choose_blocks(sens, base, spd, max_ppl_increase)
    L = len(sens)
    plan = SyncPlan.dropping(L, chosen, variant)
    predicted = sum(sens[i] for i in chosen)
    d = profile.data
    plan.meta = {
        "source": "syncdrop plan",
        "profile": {"path": portable_path(profile.path), "sha256": profile.sha256, "model": d.get("model"),
                    "tp": d.get("tp"), "calib": d.get("calib"), "baseline_ppl": base},
        "sensitivity": sensitivity,
        "target": {"spd": spd} if spd is not None else {"max_ppl_increase": max_ppl_increase},
        "drop_order": drop_order(sens),
        "tau1": t1,
        "tau2": t2,
        "tau_spec": {"tau1": str(tau1), "tau2": str(tau2)},
        "tau_note": "perplexity deltas; defaults measured on SmolLM2 (docs/spd.md); the paper publishes none",
        "tiers": {str(i): tier_of(sens[i], t1, t2) for i in sorted(chosen)},
        "sensitivities": {str(i): sens[i] for i in sorted(chosen)},
        "predicted_ppl_increase": predicted,
        "predicted_ppl": base + predicted,
        "predicted_note": "sum of the dropped blocks' sensitivities on the calibration data; measure with "
                          "`syncdrop ppl --plan PLAN.json`",
    }
    return plan


def tiers(plan: SyncPlan) -> dict[int, str]:
    """``{block: tier}`` of a plan made by :func:`make_plan` (empty for other plans)."""
    t = plan.meta.get("tiers", {}) if isinstance(plan.meta, dict) else {}
    return {int(k): v for k, v in t.items()} if isinstance(t, dict) else {}


def config_plan(name: str, num_blocks: int, order: list[int]) -> SyncPlan:
    """A benchmark configuration -> its plan: ``WIRE`` (every sync point compressed), ``spd:F`` (the first
    ``round(F L)`` blocks of the drop ``order`` SPD) or ``spd:F+WIRE`` (those blocks SPD, every kept sync point,
    the SPD blocks' one all-reduce included, compressed); anything else is a plan spec (:func:`parse_plan`)."""
    m = re.fullmatch(r"spd:([0-9.]+)(?:\+(.+))?", name)
    if not m:
        return parse_plan(name, num_blocks)
    plan = SyncPlan.dropping(num_blocks, sorted(order[: round(float(m.group(1)) * num_blocks)]))
    if m.group(2):
        wire = parse_plan(m.group(2), num_blocks).blocks[0].mlp
        plan = plan.compressed(wire.wire, wire.group)
    return plan


def config_plans(specs: str, num_blocks: int, profile_path: str | Path,
                 hidden: int | None = None) -> dict[str, SyncPlan]:
    """Comma-separated benchmark configurations -> their plans (:func:`config_plan`), SPD blocks in the drop
    order of the profile at ``profile_path`` (progressive sensitivity); with ``hidden``, each plan is checked
    against the hidden size (wire group sizes)."""
    order = drop_order(load_profile(profile_path, num_blocks).sensitivity("progressive"))
    plans = {c: config_plan(c, num_blocks, order) for c in specs.split(",") if c}
    if hidden is not None:
        for plan in plans.values():
            plan.check(hidden)
    return plans
