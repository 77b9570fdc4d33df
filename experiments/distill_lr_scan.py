"""B2B learning-rate scan: which AdamW learning rate recovers the most perplexity with our small
calibration budget (the paper's 5e-5 assumes 128 x 2048 calibration tokens; we train on 8 x 512).

Distils the given blocks at each learning rate (everything else fixed), then measures the
WikiText-2 test perplexity of: the dense model, the zero-shot drop of those blocks, and each
distilled variant, on the same windows. Writes JSON + Markdown::

    python experiments/distill_lr_scan.py --tp 3 --blocks 3,20 --lrs 5e-5,3e-4,1e-3,3e-3 --out results/distill_lr_scan
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile

from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import make_windows, perplexity
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import SyncPlan
from syncdrop.spd.distill import DistillSettings, distill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--blocks", default="3,20")
    ap.add_argument("--lrs", default="5e-5,3e-4,1e-3,3e-3")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    src = resolve_model(args.model)
    cfg, tok = src.config, src.load_tokenizer()
    blocks = [int(b) for b in args.blocks.split(",")]
    plan = SyncPlan.dropping(cfg.num_layers, blocks)
    calib, test = load_text("wikitext2:valid"), load_text("wikitext2")
    cw = make_windows(tok(calib.text, add_special_tokens=False)["input_ids"], args.seq_len, args.samples + args.heldout)
    tw = make_windows(tok(test.text, add_special_tokens=False)["input_ids"], args.seq_len, args.windows)
    base = simulated_model(cfg, src.reader, args.tp)
    rows = [{"variant": "dense", "ppl": perplexity(base, tw, progress=False).ppl}]
    base.plan = plan
    rows.append({"variant": "zero-shot", "ppl": perplexity(base, tw, progress=False).ppl})
    for lr in [float(x) for x in args.lrs.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            m = distill(src, args.tp, plan, dict.fromkeys(blocks, "b2b"), cw[: args.samples], cw[args.samples :], d,
                        DistillSettings(lr, args.epochs), {"dataset": calib.name}, progress=False)
            ck = resolve_model(d)
            model = simulated_model(cfg, ck.reader, args.tp, plan)
            r = perplexity(model, tw, progress=False)
        rows.append({"variant": f"b2b lr={lr:g}", "lr": lr, "ppl": r.ppl,
                     "heldout_mse": {k: [e["stats"]["heldout_loss_zs"], e["stats"]["heldout_loss"]]
                                     for k, e in m["blocks"].items()}})
        logging.info("lr %g: ppl %.4f", lr, r.ppl)
    dense, zs = rows[0]["ppl"], rows[1]["ppl"]
    for r in rows[2:]:
        r["recovered"] = (zs - r["ppl"]) / (zs - dense)
    settings = {"model": args.model, "tp": args.tp, "blocks": blocks, "samples": args.samples,
                "heldout": args.heldout, "epochs": args.epochs, "seq_len": args.seq_len,
                "test_windows": int(tw.shape[0])}
    atomic_write_json(args.out + ".json", {"settings": settings, "provenance": provenance(), "rows": rows})
    lines = [f"B2B learning-rate scan, {src.name} TP={args.tp}, blocks {blocks} dropped; WikiText-2 test, "
             f"{tw.shape[0]} windows of {args.seq_len}; {args.samples} calibration windows x {args.epochs} epochs.",
             "", "| variant | ppl | share of zero-shot loss recovered | held-out MSE per block (zs -> b2b) |",
             "|---|---:|---:|---|"]
    for r in rows:
        mse = "; ".join(f"{k}: {a:.3g} -> {b:.3g}" for k, (a, b) in r.get("heldout_mse", {}).items())
        rec = f"{r['recovered']:.0%}" if "recovered" in r else ""
        lines.append(f"| {r['variant']} | {r['ppl']:.3f} | {rec} | {mse} |")
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
