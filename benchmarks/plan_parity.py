"""Perplexity of every kind of sync plan on SmolLM2, to pin behaviour across a redesign.

Runs the simulated executor on the first ``--windows`` WikiText-2 test windows of ``--seq-len``
tokens for each plan below (spec strings, JSON plans for the forms a spec cannot say, and a
``syncdrop distill`` directory with its own plan and with ``none``), and on the tests' tiny OPT
(biases everywhere, so where each mode adds them shows) for the drop variants and partial sync,
and writes per plan the
perplexity, the NLL sum (``float.hex``, so "identical" means bit for bit) and the per-window NLLs.

``--compare BEFORE.json`` adds a table of this run against an earlier one (same settings):
the exact equality of each plan's NLL sum, and the relative difference.

Usage::

    python benchmarks/plan_parity.py --out results/plan_parity/after.json \
        --distilled runs/parity_distill --compare results/plan_parity/before.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time

import torch

from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import make_windows, perplexity
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.runtime import build

log = logging.getLogger("plan_parity")

# (label, tp, spec or JSON blocks builder); JSON builders take L and return the "blocks" list
SPECS: list[tuple[str, int, object]] = [
    ("none", 3, "none"),
    ("frac:0.25", 3, "frac:0.25"),
    ("frac:0.5", 3, "frac:0.5"),
    ("all", 3, "all"),
    ("first:5", 3, "first:5"),
    ("blocks:0,3,7", 3, "blocks:0,3,7"),
    ("none tp2", 2, "none"),
    ("frac:0.5 tp2", 2, "frac:0.5"),
    ("all tp4", 4, "all"),
    ("partial:0.5", 3, "partial:0.5"),
    ("partial:0", 3, "partial:0"),
    ("partial:1", 3, "partial:1"),
    ("naive frac:0.5", 3, ("naive", "frac:0.5")),
    ("desync frac:0.5", 3, ("desync", "frac:0.5")),
    ("bias-in-sum frac:0.5", 3, ("bias-in-sum", "frac:0.5")),
    ("naive all", 3, ("naive", "all")),
    ("desync all", 3, ("desync", "all")),
    ("partial 0.25 random mask", 3, lambda L: [{"attn": {"partial": 0.25, "mask": "random"},
                                                "mlp": {"partial": 0.25, "mask": "random"}}] * L),
    ("partial 0.25 topk mask", 3, lambda L: [{"attn": {"partial": 0.25, "mask": "topk"},
                                              "mlp": {"partial": 0.25, "mask": "topk"}}] * L),
    ("partial 0.5 unscaled", 3, lambda L: [{"attn": {"partial": 0.5, "scale": False}, "mlp": "full"}] * L),
    ("SPD half + partial MLP 0.5", 3, lambda L: [{"attn": "drop" if i >= L // 2 else "full",
                                                  "mlp": {"partial": 0.5}} for i in range(L)]),
    ("partial attn 0.5, full MLP, tp2", 2, lambda L: [{"attn": {"partial": 0.5}, "mlp": "full"}] * L),
]

# the tiny OPT of the tests (biases on every linear layer, LayerNorm, fixed seed): where biases go in
# each mode; 8 random windows of 64 token ids
TINY_OPT_SPECS: list[tuple[str, int, object]] = [
    ("tiny OPT none", 2, "none"),
    ("tiny OPT all", 2, "all"),
    ("tiny OPT naive all", 2, ("naive", "all")),
    ("tiny OPT desync all", 2, ("desync", "all")),
    ("tiny OPT bias-in-sum all", 2, ("bias-in-sum", "all")),
    ("tiny OPT partial:0.5", 3, "partial:0.5"),
    ("tiny OPT SPD + partial MLP 0.5", 2, lambda L: [{"attn": "drop", "mlp": {"partial": 0.5}}] * L),
]


def run(args: argparse.Namespace) -> dict:
    data = load_text("wikitext2", args.data_dir)
    rows = []
    tmp = tempfile.mkdtemp(prefix="plan_parity_")
    jobs: list[tuple[str, str, int, object, str]] = [(lbl, "smollm2", tp, s, "drop") for lbl, tp, s in SPECS]
    if args.distilled:
        jobs += [("distilled dir, own plan", args.distilled, args.distilled_tp, None, "drop"),
                 ("distilled dir, plan none", args.distilled, args.distilled_tp, "none", "drop")]
    from syncdrop.tiny_models import build_tiny_family

    opt_dir = str(build_tiny_family(os.path.join(tmp, "tiny_opt"), "opt"))
    jobs += [(lbl, opt_dir, tp, s, "drop") for lbl, tp, s in TINY_OPT_SPECS]
    opt_windows = torch.randint(3, 300, (8, 64), generator=torch.Generator().manual_seed(0))
    windows = None
    for label, model, tp, spec, variant in jobs:
        if isinstance(spec, tuple):
            variant, spec = spec
        built = None
        if callable(spec):
            from syncdrop.models.loading import resolve_model

            L = resolve_model(model).config.num_layers
            path = os.path.join(tmp, f"{len(rows)}.json")
            with open(path, "w") as f:
                json.dump({"format": "syncdrop-plan", "version": 1, "num_blocks": L, "blocks": spec(L)}, f)
            spec = path
        t0 = time.perf_counter()
        built = build(model, tp, spec, drop_variant=variant, progress=False, executor="simulated")
        if windows is None:
            ids = built.source.load_tokenizer()(data.text, add_special_tokens=False)["input_ids"]
            windows = make_windows(ids, args.seq_len, args.windows)
        res = perplexity(built.model, opt_windows if model == opt_dir else windows, progress=False)
        log.info("%-34s ppl %.6f (%.1f s)", label, res.ppl, time.perf_counter() - t0)
        name = "smollm2" if model == "smollm2" else "tiny_opt" if model == opt_dir else os.path.basename(model)
        rows.append({"label": label, "model": name, "tp": tp,
                     "plan_summary": built.plan.summary(), "ppl": res.ppl, "nll_sum": res.nll_sum,
                     "nll_sum_hex": float.hex(res.nll_sum), "window_nll": res.window_nll})
    return {"settings": {"dataset": data.name, "windows": args.windows, "seq_len": args.seq_len,
                         "executor": "simulated", "dtype": "float32"},
            "provenance": provenance(), "rows": rows}


def compare(before: dict, after: dict) -> str:
    b = {r["label"]: r for r in before["rows"]}
    lines = [f"Perplexity per plan, SmolLM2, {after['settings']['windows']} WikiText-2 test windows of "
             f"{after['settings']['seq_len']} tokens (tiny OPT: 8 random windows of 64 token ids), simulated "
             "executor, fp32.",
             f"Before: commit {before['provenance'].get('commit')}; after: commit {after['provenance'].get('commit')}.",
             "", "| plan | TP | ppl before | ppl after | NLL sum bit-identical | relative difference |",
             "|---|---:|---:|---:|:---:|---:|"]
    for r in after["rows"]:
        o = b.get(r["label"])
        if o is None:
            lines.append(f"| {r['label']} | {r['tp']} | (not run) | {r['ppl']:.6f} | | |")
            continue
        same = o["nll_sum_hex"] == r["nll_sum_hex"]
        rel = (r["nll_sum"] - o["nll_sum"]) / abs(o["nll_sum"])
        lines.append(f"| {r['label']} | {r['tp']} | {o['ppl']:.6f} | {r['ppl']:.6f} | {'yes' if same else 'no'} | "
                     f"{rel:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--distilled", default=None, help="a `syncdrop distill` directory (SmolLM2) to include")
    ap.add_argument("--distilled-tp", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--compare", default=None, help="an earlier run's JSON: write a before/after table beside --out")
    args = ap.parse_args()
    res = run(args)
    atomic_write_json(args.out, {"command": "python benchmarks/plan_parity.py " + " ".join(
        a for a in os.sys.argv[1:]), **res})
    if args.compare:
        with open(args.compare) as f:
            table = compare(json.load(f), res)
        atomic_write_text(args.out.removesuffix(".json") + ".md", table)
        print(table)
    assert all(math.isfinite(r["ppl"]) for r in res["rows"])


if __name__ == "__main__":
    main()
