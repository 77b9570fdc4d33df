"""A trained partial-sync model at inference (issue 6, item 4): accuracy and latency per plan.

Trains two models from scratch at ``--tp`` (default 2: one rank per core on this machine) in the
simulated executor with identical seed, data and size: one with full syncs (p = 1) and one with
partial sync (``--p``, default 0.5) at every sync point (``syncdrop train``; resumable, reused when
rerun). Then, for each model:

* accuracy: validation perplexity on the held-out books under the plan it was trained with, and
  for the partial model also under plans it was *not* trained with (full sync, a mixed plan that
  drops every attention sync and keeps partial MLP syncs), to show a plan must match training;
* latency: ``syncdrop bench --launch`` (real ranks, gloo) of the plans on one warm process group,
  interleaved repetitions, without and with an emulated slow link; payload per sync = p of the
  full all-reduce.

Writes ``OUT.json`` (command, commit, settings, raw files, medians, ratios to the full-sync plan
in the same run) and ``OUT.md``. The committed results were made with::

    OMP_NUM_THREADS=1 python experiments/caat_latency.py --out results/caat_latency
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from syncdrop.eval.data import data_dir
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.plan import BlockSync, Partial, SyncPlan

log = logging.getLogger("caat_latency")


def _syncdrop(*args: str) -> None:
    cmd = [sys.executable, "-m", "syncdrop", *args]
    log.info("$ syncdrop %s", " ".join(args))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-3000:])
        raise SystemExit(f"syncdrop {args[0]} failed (exit {r.returncode})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension; runs go to OUT/")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--p", type=float, default=0.5, help="sync fraction of the partial model (default 0.5)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--link-bandwidth", default="100MB/s")
    ap.add_argument("--link-latency", default="50us")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--val-windows", type=int, default=16)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads), "--kv-heads",
            str(args.heads), "--ffn", str(args.ffn), "--steps", str(args.steps), "--warmup", str(args.steps // 10),
            "--val-every", str(max(1, args.steps // 5)), "--ckpt-every", str(max(1, args.steps // 10)), "--lr", "1e-3",
            "--min-lr", "1e-4"]
    models = {"p=1": 1.0, f"p={args.p:g}": args.p}
    train: dict[str, Any] = {}
    for name, p in models.items():
        run = root / f"train_p{round(p * 100):03d}"
        if not (run / "train.json").exists():
            _syncdrop("train", "--tp", str(args.tp), "--sync-fraction", str(p), *size, "--out", str(run), "-q")
        train[name] = json.loads((run / "train.json").read_text())
        train[name]["dir"] = str(run / "model")
    L = args.layers
    part = Partial(args.p)
    mixed = SyncPlan([BlockSync(attn="drop", mlp=part) for _ in range(L)])
    mixed_path = root / "plan_mixed.json"
    mixed.save(mixed_path)
    partial_name, partial_dir = f"p={args.p:g}", train[f"p={args.p:g}"]["dir"]
    # train.json records the book relative to the data folder; the command line gets it relative to here
    val_book = os.path.relpath(data_dir() / train["p=1"]["val_books"][0])
    # (model, plan spec, label, trained with this plan?)
    cases = [("p=1", "none", "full sync (p=1)", True),
             (partial_name, f"partial:{args.p:g}", f"partial p={args.p:g}", True),
             (partial_name, "none", "full sync", False),
             (partial_name, str(mixed_path), f"SPD all + partial MLP p={args.p:g}", False)]
    acc = []
    for i, (m, plan, label, trained) in enumerate(cases):
        j = root / f"ppl_{i}.json"
        if not j.exists():
            _syncdrop("ppl", "--model", train[m]["dir"], "--tp", str(args.tp), "--plan", plan, "--dataset", val_book,
                      "--seq-len", "256", "--max-windows", str(args.val_windows), "--json", str(j), "-q")
        d = json.loads(j.read_text())
        acc.append({"model": m, "plan": label, "plan_spec": plan, "trained_with_plan": trained, "ppl": d["ppl"],
                    "file": str(j)})
    bench_plans = ["none", f"partial:{args.p:g}", "partial:0.25", str(mixed_path), "all"]
    common = ["--model", partial_dir, "--tp", str(args.tp), "--launch", "--plans", ",".join(bench_plans),
              "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens), "--reps",
              str(args.reps), "-q"]
    benches, bench_files = {}, {}
    for tag, extra in (("no link emulation", []),
                       (f"{args.link_bandwidth}, {args.link_latency}",
                        ["--link-bandwidth", args.link_bandwidth, "--link-latency", args.link_latency])):
        j = root / f"bench_{'link' if extra else 'nolink'}.json"
        if not j.exists():
            _syncdrop("bench", *common, *extra, "--json", str(j))
        benches[tag], bench_files[tag] = json.loads(j.read_text()), str(j)
    rows = []
    for tag, b in benches.items():
        ref = next(p for p in b["plans"] if p["plan"] == "none")
        for p in b["plans"]:
            rows.append({"link": tag, "plan": p["plan"], "spd_fraction": p.get("spd_fraction"),
                         "ttft_ms": p["ttft_ms"], "decode_ms": p["decode_ms"],
                         "ttft_ratio": p["ttft_ms"] / ref["ttft_ms"],
                         "decode_ratio": p["decode_ms"] / ref["decode_ms"]})
    result = {"settings": vars(args), "provenance": provenance(),
              "train": {n: {k: t[k] for k in ("settings", "final_val_loss", "val_loss", "val_books")}
                        for n, t in train.items()},
              "accuracy": acc, "latency": rows, "bench_files": bench_files}
    atomic_write_json(f"{args.out}.json", result)
    md = _markdown(args, train, acc, rows, mixed_path)
    atomic_write_text(f"{args.out}.md", md)
    print(md)
    return 0


def _markdown(args, train, acc, rows, mixed_path) -> str:
    short = {"none": "full sync (p=1)", str(mixed_path): f"SPD all + partial MLP p={args.p:g}", "all": "SPD all"}
    lines = [f"Trained partial-sync model at inference: TP={args.tp}, {args.layers} layers, h={args.hidden}, "
             f"{args.steps} training steps per model (`syncdrop train`), same seed and data.", "",
             f"Validation perplexity (first {args.val_windows} windows of 256 tokens of the held-out book "
             f"{Path(train['p=1']['val_books'][0]).name}):", "",
             "| model | plan at inference | trained with it | ppl |", "|---|---|---|---:|"]
    for a in acc:
        lines.append(f"| {a['model']} | {a['plan']} | {'yes' if a['trained_with_plan'] else 'no'} | {a['ppl']:.2f} |")
    lines += ["", f"Latency of the p={args.p:g} model's plans (`syncdrop bench --launch`, {args.tp} gloo ranks, prompt "
              f"{args.prompt_len} tokens, {args.decode_tokens} decode tokens, {args.reps} interleaved reps, medians; "
              "ratios to full sync in the same run):", "",
              "| link | plan | TTFT ms | decode ms/token | TTFT ratio | decode ratio |",
              "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['link']} | {short.get(r['plan'], r['plan'])} | {r['ttft_ms']:.2f} | {r['decode_ms']:.2f} | "
                     f"{r['ttft_ratio']:.3f} | {r['decode_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
