"""Plan spec strings, as the CLI takes them: ``none | all | last:K | first:K | frac:F | blocks:0,3,7 |
partial:P | PATH.json``, each optionally followed by ``+WIRE`` (``int8``, ``int4:g32``, ``fp8``,
``bf16``: every kept sync point compressed, :meth:`SyncPlan.compressed`), or ``WIRE`` alone (``none+WIRE``).
Commands do not call :func:`parse_plan` directly: they resolve a plan
with :func:`syncdrop.plan.resolve.resolve_plan`, which parses, resolves and validates in one place.
"""

from __future__ import annotations

from pathlib import Path

from syncdrop.errors import SyncdropError
from syncdrop.plan.sync_plan import SyncPlan
from syncdrop.plan.wire import WIRE_FORMATS, parse_wire

PLAN_SPEC_HELP = ("none | all | last:K | first:K | frac:F | blocks:0,3,7 | partial:P | PATH.json, optionally "
                  "+WIRE (int8, int4, int8h/int4h Hadamard-rotated, fp8, bf16; :gG for the group size) to compress the "
                  "kept sync points, "
                  "or WIRE alone")


def _parse_int(text: str, what: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SyncdropError(f"malformed plan {spec!r}: {what} must be an integer, got {text!r}") from None


def _parse_fraction(text: str, letter: str, spec: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise SyncdropError(f"malformed plan {spec!r}: {letter} must be a number between 0 and 1") from None
    if not 0 <= f <= 1:
        raise SyncdropError(f"plan {spec!r}: {letter} must be between 0 and 1")
    return f


def parse_plan(spec: str, num_blocks: int, variant: str = "drop") -> SyncPlan:
    """Build a plan from a spec string (see the module docstring).

    ``frac:F`` drops the last ``round(F * L)`` blocks (a fixed choice for latency work; a
    sensitivity-guided plan file is what accuracy work should use). ``variant`` is what "dropped"
    means for the spec forms (``drop`` = the SPD block); a JSON file states its modes itself.
    """
    s = spec.strip()
    base, plus, wire = s.rpartition("+")
    if wire.partition(":")[0] in WIRE_FORMATS and not Path(s).is_file():  # PLAN+WIRE, or WIRE alone
        if plus and not base:
            raise SyncdropError(f"malformed plan {spec!r}: expected PLAN+WIRE, e.g. frac:0.7+int8")
        w = parse_wire(wire, f"plan {spec!r}: wire")
        return parse_plan(base or "none", num_blocks, variant).compressed(w.fmt, w.group)
    if s == "none":
        return SyncPlan.uniform(num_blocks)
    if s == "all":
        return SyncPlan.dropping(num_blocks, range(num_blocks), variant)
    if s.startswith(("last:", "first:")):
        kind, _, k_text = s.partition(":")
        k = _parse_int(k_text, "K", spec)
        if not 0 <= k <= num_blocks:
            raise SyncdropError(f"plan {spec!r}: K must be between 0 and {num_blocks} (the number of blocks)")
        idx = range(num_blocks - k, num_blocks) if kind == "last" else range(k)
        return SyncPlan.dropping(num_blocks, idx, variant)
    if s.startswith("frac:"):
        k = round(_parse_fraction(s[len("frac:"):], "F", spec) * num_blocks)
        return SyncPlan.dropping(num_blocks, range(num_blocks - k, num_blocks), variant)
    if s.startswith("partial:"):
        return SyncPlan.partial(num_blocks, _parse_fraction(s[len("partial:"):], "P", spec))
    if s.startswith("blocks:"):
        items = [t for t in s[len("blocks:"):].split(",") if t.strip()]
        if not items:
            raise SyncdropError(f"malformed plan {spec!r}: list at least one block index, e.g. blocks:0,3,7")
        return SyncPlan.dropping(num_blocks, [_parse_int(t.strip(), "block index", spec) for t in items], variant)
    if s.endswith(".json") or Path(s).is_file():
        return SyncPlan.load(s, num_blocks)
    raise SyncdropError(f"malformed plan {spec!r}: expected {PLAN_SPEC_HELP}")


def split_plan_list(text: str) -> list[str]:
    """Split a comma-separated list of plan specs; bare integers continue a ``blocks:`` spec, so
    ``"none,blocks:0,3,7,all"`` -> ``["none", "blocks:0,3,7", "all"]``."""
    out: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if tok.lstrip("-").isdigit() and out and out[-1].startswith("blocks:"):
            out[-1] += "," + tok
        else:
            out.append(tok)
    if not out:
        raise SyncdropError(f"--plans {text!r}: list at least one plan")
    return out
