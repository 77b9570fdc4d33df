"""A ``syncdrop auto`` candidate: an SPD fraction with the wire format of the sync points it keeps. Its key
in the stage results, the name of its files, how the report names it, and which of its variants (zero-shot
or recovered) counts."""

from __future__ import annotations

from typing import Any

from syncdrop.errors import SyncdropError


def candidate_name(fraction: float, wire: str = "none") -> str:
    """The name of a candidate's files (SPD fraction ``fraction``, kept sync points on wire format ``wire``):
    its plan ``plans/NAME.json``, its model directory ``models/NAME`` (``models/NAME_e2e`` after end-to-end
    distillation): ``spd050`` for 0.5, ``spd050_int4g32`` for 0.5 with ``int4:g32`` on the wire."""
    base = f"spd{round(fraction * 100):03d}"
    return base if wire == "none" else f"{base}_{wire.replace(':', '')}"


def candidate_key(fraction: float, wire: str = "none") -> str:
    """A candidate's key in the stage results: ``0.5``, or ``0.5+int8`` with compressed sync points."""
    return f"{fraction:g}" if wire == "none" else f"{fraction:g}+{wire}"


def row_key(row: dict[str, Any]) -> str:
    """The candidate key of a stage row (rows of an uncompressed candidate may carry only its fraction)."""
    return row.get("key") or candidate_key(row["fraction"], row.get("wire", "none"))


def candidate_label(c: dict[str, Any]) -> str:
    """``SPD 0.5``, ``SPD 0.5 + int8``, ``dense`` or ``dense + int8``: how the report and the reasons name a
    candidate."""
    w = c.get("wire", "none")
    return ("dense" if c["fraction"] == 0 else f"SPD {c['fraction']:g}") + ("" if w == "none" else f" + {w}")


DEFAULT_WIRES = ("none", "int8")


def parse_wires(wires: tuple[str, ...] | list[str] | None, hidden: int | None = None) -> list[str]:
    """``none`` first, then each other wire format once, checked (:func:`syncdrop.plan.wire.parse_wire`; with
    ``hidden``, its group size must divide the payload). ``None``: :data:`DEFAULT_WIRES`, leaving out (with a
    warning) a format whose default group size does not divide ``hidden``; a format the user named is an
    error then."""
    import logging

    from syncdrop.plan.wire import parse_wire

    out = ["none"]
    for w in DEFAULT_WIRES if wires is None else wires:
        w = w.strip()
        if w in out or not w:
            continue
        fmt = parse_wire(w, "--wire")
        if hidden is not None:
            try:
                fmt.check(hidden)
            except SyncdropError as e:
                if wires is not None:
                    raise SyncdropError(f"--wire {w!r}: {e.message}") from None
                logging.getLogger(__name__).warning("no %s candidates: %s (pass --wire with a group, e.g. %s:g16)",
                                                    w, e.message, w)
                continue
        out.append(w)
    return out


def best_variant(row: dict[str, Any]) -> str:
    """``distilled`` when the candidate's recovered model has the lower test perplexity, else ``zero-shot``."""
    return "distilled" if row["ppl_distilled"] < row["ppl_zero_shot"] else "zero-shot"
