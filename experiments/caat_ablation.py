"""CAAT-Net ablation on real text (issue 6, item 3): validation loss against the sync fraction p.

Trains one model per variant from scratch in the simulated executor at TP=8, with identical seed,
model, steps, batches and tokenizer (trained once on the training books, shared by every run):
p in {1, 0.75, 0.5, 0.25, 0}, and at p = 0.5 without the sqrt(N) scaling and with random or top-k
channel masks instead of fixed channels. Whole Gutenberg books are held out for validation.
Each run is resumable (rerun the same command after an interruption); finished runs are reused.

Writes ``OUT.json`` (settings, provenance, per variant: train/val loss curves, final val loss),
``OUT.md`` (table beside the paper's TinyLlama numbers) and ``OUT.png`` (validation curves)::

    python experiments/caat_ablation.py --steps 400 --out results/caat_ablation
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from syncdrop.caat.data import load_corpus, train_tokenizer
from syncdrop.caat.train import TrainSettings, train
from syncdrop.eval.data import data_dir, in_data_dir
from syncdrop.io_utils import atomic_write_json, atomic_write_png, atomic_write_text, provenance

VARIANTS = {  # name -> (p, scale, mask)
    "p=1": (1.0, True, "fixed"), "p=0.75": (0.75, True, "fixed"), "p=0.5": (0.5, True, "fixed"),
    "p=0.25": (0.25, True, "fixed"), "p=0": (0.0, True, "fixed"),
    "p=0.5 no sqrt(N)": (0.5, False, "fixed"), "p=0.5 random mask": (0.5, True, "random"),
    "p=0.5 top-k mask": (0.5, True, "topk"),
}
PAPER = {"p=1": 1.28, "p=0.75": 1.27, "p=0.25": 1.29, "p=0": 1.49}  # TinyLlama 1.1B, TP 8 (docs/methods.md)


def _slug(name: str) -> str:
    return name.replace("=", "").replace(" ", "_").replace("(", "").replace(")", "").replace("-", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension; runs go to OUT/<variant>/")
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0,
                    help="init, batches and the held-out books; another seed estimates run-to-run spread")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    corpus = args.corpus or str(data_dir() / "gutenberg")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for n in names:
        if n not in VARIANTS:
            ap.error(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
    base = TrainSettings(tp=args.tp, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                         min_lr=args.lr / 10, warmup=args.warmup, hidden=args.hidden, layers=args.layers,
                         heads=args.heads, kv_heads=args.heads, ffn=args.ffn, vocab_size=args.vocab_size,
                         val_every=max(1, args.steps // 10), ckpt_every=max(1, args.steps // 20), seed=args.seed)
    root = Path(args.out)
    tok_dir = root / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():  # one tokenizer for every run
        data = load_corpus(corpus, base.val_books, base.seed)
        train_tokenizer(data.train_text, base.vocab_size).save_pretrained(str(tok_dir))
    runs: dict[str, dict] = {}
    lines: list[str] = []
    for n in names:
        p, scale, mask = VARIANTS[n]
        s = replace(base, sync_fraction=p, scale=scale, mask=mask)
        run = root / _slug(n)
        if not (run / "tokenizer" / "tokenizer.json").exists():
            shutil.copytree(tok_dir, run / "tokenizer", dirs_exist_ok=True)
        done = run / "train.json"
        if done.exists() and json.loads(done.read_text())["settings"]["steps"] == s.steps:
            runs[n] = json.loads(done.read_text())
        else:
            logging.info("training %s", n)
            runs[n] = train(s, corpus, run)
        lines = _write(args, runs)  # after every variant, so an interrupted ablation still leaves its table
    print("\n".join(lines))
    return 0


def _write(args: argparse.Namespace, runs: dict[str, dict]) -> list[str]:
    """Write OUT.json / OUT.md / OUT.png for the finished variants; returns the table lines."""
    rows = {n: {"sync_fraction": VARIANTS[n][0], "scale": VARIANTS[n][1], "mask": VARIANTS[n][2],
                "final_val_loss": r["final_val_loss"], "val_loss": r["val_loss"], "train_loss": r["train_loss"],
                "tokens_per_s_median": sorted(r["tokens_per_s"])[len(r["tokens_per_s"]) // 2]}
            for n, r in runs.items()}
    first = next(iter(runs.values()))
    settings = {k: v for k, v in first["settings"].items() if k not in ("sync_fraction", "scale", "mask")}
    settings["corpus"] = in_data_dir(settings["corpus"])
    first = {**first, "train_books": [in_data_dir(b) for b in first["train_books"]],
             "val_books": [in_data_dir(b) for b in first["val_books"]]}
    atomic_write_json(f"{args.out}.json", {"settings": settings, "train_books": first["train_books"],
                                           "val_books": first["val_books"], "train_tokens": first["train_tokens"],
                                           "provenance": provenance(), "variants": rows})
    ref = rows.get("p=1", {}).get("final_val_loss")
    lines = [f"CAAT-Net ablation: TP={args.tp} simulated, {args.layers} layers, h={args.hidden}, {args.steps} steps of "
             f"{args.batch}x{args.seq_len} tokens ({args.steps * args.batch * args.seq_len:,} tokens); validation = "
             f"held-out books {first['val_books']}; seed {args.seed}.", "",
             "| variant | final val loss | vs p=1 | paper (TinyLlama 1.1B, TP 8) |", "|---|---:|---:|---:|"]
    for n, r in rows.items():
        d = f"{r['final_val_loss'] - ref:+.3f}" if ref is not None else ""
        lines.append(f"| {n} | {r['final_val_loss']:.4f} | {d} | {PAPER.get(n, '')} |")
    atomic_write_text(f"{args.out}.md", "\n".join(lines) + "\n")
    _plot(rows, f"{args.out}.png")
    return lines


def _plot(rows: dict, path: str) -> None:

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for n, r in rows.items():
        ax.plot([s for s, _ in r["val_loss"]], [v for _, v in r["val_loss"]], marker=".", label=n)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (held-out books)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_png(path, fig)


if __name__ == "__main__":
    sys.exit(main())
