"""Paired comparisons of two recovery variants on the same test windows (issue 16): for each pair of
per-window NLL files written by ``recovery_sweep.py`` (``OUT/nll/<method>_f<F>.json``), the perplexity
ratio A / B with its 95% paired percentile bootstrap interval over windows. Both files must hold the
same windows (checked: same count; the sweep's cache keys record the window shape). ``@N`` after a pair
compares the first ``N`` windows of both files: the sweep's test windows are consecutive from the start
of WikiText-2 test, so a 304-window file's first 64 are a 64-window file's windows (checked: same
window length, at least ``N`` in each).

    python experiments/recovery_compare.py --out results/recovery/tp3_compare \\
        --pair "32x3 / 8x10=results/recovery/tp3_bank32/nll/hg+b2b_f0.5.json:results/recovery/tp3/nll/hg+b2b_f0.5.json"
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from syncdrop.bench.stats import paired_ppl_ratio
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance


def load_nll(spec: str) -> tuple[list[float], tuple[int, int]]:
    """Per-window NLLs and the window shape ``(count, tokens)`` of a sweep's ``nll/*.json`` file, or of one
    plan of a ``compressed_ppl.py`` result (``OUT.json#PLAN``)."""
    path, _, plan = spec.partition("#")
    d = json.loads(Path(path).read_text())
    if plan:
        if plan not in d.get("window_nll", {}):
            raise SystemExit(f"--pair: {path} has no plan {plan!r} (it has {', '.join(d.get('window_nll', {}))})")
        return d["window_nll"][plan], tuple(d["settings"]["windows_shape"])
    return d["window_nll"], tuple(d["key"]["windows"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", action="append", required=True,
                    help="NAME=A.json[#PLAN]:B.json[#PLAN][@N] (ratio A / B, on the first N windows with @N); "
                         "repeatable")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = ap.parse_args(argv)
    rows = []
    for item in args.pair:
        name, sep, files = item.rpartition("=")
        files, at, first = files.partition("@")
        m = re.fullmatch(r"(.+?):([^:#]+\.json(?:#.+)?)", files)  # B: the first ``PATH.json[#PLAN]`` after a colon
        fa, fb = m.groups() if m else (files, "")
        if (not sep or not name or not all(Path(f.partition("#")[0]).is_file() for f in (fa, fb) if f) or not fb
                or (at and not (first.isdigit() and int(first) > 0))):
            raise SystemExit(f"--pair: expected NAME=A.json:B.json[@N] with both files present and N a positive "
                             f"window count, got {item!r}")
        (a, (na, la)), (b, (nb, lb)) = load_nll(fa), load_nll(fb)
        if at:
            n = int(first)
            if la != lb or min(len(a), len(b)) < n:
                raise SystemExit(f"--pair {name}: @{n} needs windows of one length and {n} in each "
                                 f"({len(a)} x {la} and {len(b)} x {lb})")
            a, b = a[:n], b[:n]
        elif len(a) != len(b) or (na, la) != (nb, lb):
            raise SystemExit(f"--pair {name}: the files hold different windows ({len(a)} and {len(b)})")
        r, ci = paired_ppl_ratio(a, b)
        rows.append({"name": name, "a": fa, "b": fb, "windows": len(a), "ratio": r,
                     "ratio_ci": list(ci) if ci else None, "significant": bool(ci) and (ci[1] < 1 or ci[0] > 1)})
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), {"command": sys.argv, "provenance": provenance(), "rows": rows})
    lines = ["Paired comparisons on the same WikiText-2 test windows: perplexity ratio A / B with its 95% paired "
             "bootstrap interval over windows (below 1: A is better).", "",
             "| comparison | windows | A / B | 95% interval | significant |", "|---|---:|---:|---|---|"]
    for r in rows:
        ci = r["ratio_ci"]
        lines.append(f"| {r['name']} | {r['windows']} | {r['ratio']:.4f} | "
                     + (f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "-") + f" | {'yes' if r['significant'] else 'no'} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
