"""Is a measured latency gain more than noise? Exact tests on the raw samples of a committed bench file.

Reads a ``syncdrop bench --json`` file (``plans[*].ttft_samples_ms`` / ``decode_samples_ms``) or the
``bench.json`` of a ``syncdrop auto`` run (``rows[*].samples_ms``, one group per link), and compares
every plan's samples with the baseline's (plan ``baseline_plan``, or SPD fraction 0):

* medians and their ratio;
* an exact permutation test of the difference of medians (every split of the pooled samples into
  two groups of the original sizes): one-sided p for "the plan is faster", and two-sided p;
* the exact two-sided Mann-Whitney U test (same enumeration; ties count half).

Nothing is fitted or sampled at random, so the output is the same on every machine::

    python benchmarks/ttft_significance.py results/demo_auto/bench.json
    python benchmarks/ttft_significance.py results/latency/tp2_share55.json

Both tests treat the repetitions as independent draws; the bench interleaves plans per repetition,
which this ignores (it is the conservative choice when repetitions drift together).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np


def exact_tests(base: list[float], other: list[float]) -> dict[str, float]:
    """Exact permutation test of ``median(base) - median(other)`` and exact Mann-Whitney U.

    Returns the medians, the one-sided p of the median difference (H1: ``other`` is faster, i.e. its
    median is lower), its two-sided p, the U statistic of ``base`` and the two-sided U p.
    """
    a, b = np.asarray(base, float), np.asarray(other, float)
    pooled = np.concatenate([a, b])
    n, m = len(a), len(b)
    obs = float(np.median(a) - np.median(b))

    def u_stat(x: np.ndarray, y: np.ndarray) -> float:
        d = x[:, None] - y[None, :]
        return float((d > 0).sum() + 0.5 * (d == 0).sum())

    u_obs = u_stat(a, b)
    u_mid, u_dev = n * m / 2, abs(u_obs - n * m / 2)
    eps = 1e-9 * max(1.0, float(np.abs(pooled).max()))
    total = ge_one = ge_two = u_ext = 0
    for idx in itertools.combinations(range(n + m), n):
        mask = np.zeros(n + m, bool)
        mask[list(idx)] = True
        x, y = pooled[mask], pooled[~mask]
        d = float(np.median(x) - np.median(y))
        total += 1
        ge_one += d >= obs - eps
        ge_two += abs(d) >= abs(obs) - eps
        u_ext += abs(u_stat(x, y) - u_mid) >= u_dev - 1e-9
    return {"median_base_ms": float(np.median(a)), "median_ms": float(np.median(b)), "diff_ms": obs,
            "p_perm_one_sided": ge_one / total, "p_perm_two_sided": ge_two / total,
            "mann_whitney_u": u_obs, "p_mann_whitney_two_sided": u_ext / total, "splits": total}


def groups(d: dict) -> list[tuple[str, str, dict[str, list[float]], str]]:
    """(link, what, {plan: samples}, baseline plan) for each comparison group in a bench file."""
    out = []
    if "plans" in d:  # syncdrop bench --json
        link = (d.get("settings") or {}).get("link_description") or "none"
        for what in ("ttft", "decode"):
            s = {p["plan"]: p[f"{what}_samples_ms"] for p in d["plans"] if p.get(f"{what}_samples_ms")}
            if s:
                out.append((link, what, s, d.get("baseline_plan") or next(iter(s))))
    elif "rows" in d:  # syncdrop auto: bench.json / fig_latency.json
        keys = sorted({(r["link"], r["what"]) for r in d["rows"]})
        for link, what in keys:
            s = {f"SPD {r['fraction']:g}": r["samples_ms"] for r in d["rows"]
                 if (r["link"], r["what"]) == (link, what) and r.get("samples_ms")}
            if s:
                out.append((link, what, s, "SPD 0"))
    else:
        raise SystemExit("error: not a syncdrop bench file (no 'plans') nor an auto bench.json (no 'rows')")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="a committed bench JSON file")
    args = ap.parse_args(argv)
    d = json.loads(Path(args.bench).read_text())
    print(f"{args.bench}: exact tests on the raw samples, each plan against the baseline (SPD 0 or baseline_plan)")
    print("| link | what | plan | n | median ms | baseline median ms | ratio | p one-sided (perm, median) "
          "| p two-sided (perm, median) | p two-sided (Mann-Whitney) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for link, what, s, base in groups(d):
        for plan, samples in s.items():
            if plan == base:
                continue
            t = exact_tests(s[base], samples)
            print(f"| {link} | {what} | {plan} vs {base} | {len(samples)}+{len(s[base])} | {t['median_ms']:.1f} "
                  f"| {t['median_base_ms']:.1f} | {t['median_ms'] / t['median_base_ms']:.3f} "
                  f"| {t['p_perm_one_sided']:.3f} | {t['p_perm_two_sided']:.3f} "
                  f"| {t['p_mann_whitney_two_sided']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
