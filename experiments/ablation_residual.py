"""Residual-placement ablation (docs/methods.md): perplexity with every block's attention sync dropped
in the SPD design vs. the naive drop, Ladder-Residual's "desync" residual and bias-inside-the-sum,
beside the dense model and plain TP.

Writes ``OUT.json`` (settings, provenance, one row per variant with raw per-window NLLs) after each
variant, and ``OUT.md`` (a Markdown table). Example (the full run in docs/results.md):

    python experiments/ablation_residual.py --tp 3 --seq-len 1024 --out results/ablation_residual
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from syncdrop.errors import SyncdropError
from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import make_windows, perplexity
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import DROP_VARIANTS, SyncPlan
from syncdrop.runtime import HFReference, parse_dtype

DESCRIPTIONS = {
    "dense": "dense model, transformers (unsharded reference)",
    "none": "TP, all sync points kept",
    "drop": "all blocks SPD: X + AllReduce(A_r + Z_r) (paper design)",
    "naive": "all blocks naive drop: X + A_r + AllReduce(Z_r) (ranks diverge)",
    "desync": "all blocks desync: AllReduce(Z_r + (X + A_r)/N)",
    "bias-in-sum": "all blocks SPD with biases inside the sum",
}


def markdown(rows: list[dict], settings: dict) -> str:
    base = next((r["ppl"] for r in rows if r["variant"] == "none"), None)
    lines = [
        f"Model {settings['model']}, TP={settings['tp']}, {settings['dataset']} ({settings['tokens']} scored tokens, "
        f"{settings['windows']} windows of {settings['seq_len']}), {settings['dtype']}.",
        "",
        "| variant | what it computes | perplexity | vs TP none |",
        "|---|---|---:|---:|",
    ]
    for r in rows:
        rel = f"{r['ppl'] / base:.3f}x" if base else ""
        lines.append(f"| {r['variant']} | {DESCRIPTIONS[r['variant']]} | {r['ppl']:.3f} | {rel} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--dataset", default="auto")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--variants", default="dense,none," + ",".join(DROP_VARIANTS))
    ap.add_argument("--out", default="results/ablation_residual", help="output prefix (.json, .md)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of an existing OUT.json made with the same settings and run only the rest")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in DESCRIPTIONS]
        if bad:
            raise SyncdropError(f"--variants: unknown {bad}; expected some of {', '.join(DESCRIPTIONS)}")
        source = resolve_model(args.model)
        data = load_text(args.dataset, args.data_dir)
        ids = source.load_tokenizer()(data.text, add_special_tokens=False)["input_ids"]
        windows = make_windows(ids, args.seq_len, args.max_windows)
        dtype = parse_dtype(args.dtype)
    except SyncdropError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_layers = source.config.num_layers
    settings = {"model": source.name, "tp": args.tp, "dataset": data.name, "dataset_path": data.path,
                "seq_len": args.seq_len, "max_windows": args.max_windows, "windows": windows.shape[0],
                "tokens": windows.shape[0] * (args.seq_len - 1), "dtype": args.dtype}
    rows: list[dict] = []
    out_json = Path(args.out + ".json")
    if args.resume and out_json.is_file():
        old = json.loads(out_json.read_text())
        keys = [k for k in settings if k != "dataset_path"]  # the data folder may move between machines
        same = all(old["settings"].get(k) == settings[k] for k in keys)
        if not same:
            print(f"error: {out_json} was made with other settings; drop --resume or pick another --out",
                  file=sys.stderr)
            return 2
        rows = [r for r in old["rows"] if r["variant"] in variants]
        print(f"resuming: kept {[r['variant'] for r in rows]} from {out_json}", flush=True)
    done = {r["variant"] for r in rows}
    tp_model = None
    for v in variants:
        if v in done:
            continue
        if v == "dense":
            model, plan, tp = HFReference(source, dtype), SyncPlan.uniform(n_layers), 1
        else:
            plan = SyncPlan.uniform(n_layers) if v == "none" else SyncPlan.uniform(n_layers, v)
            if tp_model is None:
                tp_model = simulated_model(source.config, source.reader.get, args.tp, plan, dtype)
            tp_model.plan = plan  # the plan is data: one sharded model serves every variant
            model, tp = tp_model, args.tp
        t0 = time.perf_counter()
        res = perplexity(model, windows, desc=v)
        rows.append({"variant": v, "description": DESCRIPTIONS[v], "tp": tp, "plan": plan.to_dict(),
                     "ppl": res.ppl, "nll_mean": res.nll_sum / res.tokens, "elapsed_s": time.perf_counter() - t0,
                     "window_nll": res.window_nll})
        print(f"{v:12s} ppl {res.ppl:10.4f}", flush=True)
        atomic_write_json(args.out + ".json", {"settings": settings, "provenance": provenance(), "rows": rows})
        del model
    rows.sort(key=lambda r: variants.index(r["variant"]))
    table = markdown(rows, settings)
    atomic_write_text(args.out + ".md", table)
    print()
    print(table)
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
