"""Recovery beyond the paper: WikiText-2 test perplexity of SPD plans after each recovery method,
with paired bootstrap intervals against dense.

Methods (``--methods``; the drop order is the profile's, the ``round(F L)`` least sensitive blocks
dropped at SPD fraction ``F``):

* ``zs``: the dropped blocks as they are (zero-shot);
* ``b2b`` / ``hg+b2b``: block-to-block distillation (docs/methods.md), without / after head
  grouping; every block is distilled once on the original model's residual, so one *bank* per
  method serves every fraction (the bank restricted to a plan's blocks is ``syncdrop distill --plan``);
* ``hg+seq``: sequential B2B (``DistillSettings.method="sequential"``): each dropped block trained
  on the residual of the model converted so far; one distillation per fraction;
* ``<block method>+e2e`` (e.g. ``hg+b2b+e2e``): then every dropped block end to end, KL to the
  original model's next-token distribution (:mod:`syncdrop.spd.e2e`), starting from the block stage.

Calibration never overlaps evaluation: training and held-out windows come from WikiText-2 *valid*
(``--calib``), the profile too, plus Gutenberg books for e2e (``--e2e-gutenberg``); evaluation is
WikiText-2 *test*. Model directories are named by their settings (block stage: samples, epochs and
window length where they differ from the first runs' 8 x 512 x 10; e2e: adapter, lr, samples, epochs,
Gutenberg windows, window length; a plan off the default zero-shot order: a digest of its blocks).

Every stage is resumable and cached under ``--work`` (model directories: large, not committed) and
``--out`` (results): a distillation reruns from its own state files, an evaluation appends its
windows' NLL to ``OUT/nll/<name>.json`` every ``--chunk`` windows. The wall time of every completed
stage is kept in ``OUT/times.json`` (a stage interrupted and resumed counts its last run only). A
finished evaluation outlives its model directory: where the directory is gone (a fresh clone), the
committed ``OUT/nll`` file stands for it and nothing is retrained; delete the file to retrain.

Outputs: ``OUT/recovery.json`` (settings, provenance, per point: ppl, ratio to dense with its 95%
paired bootstrap interval over windows, the method's time), ``OUT/recovery.md`` and ``OUT/recovery.png``.

    python experiments/recovery_sweep.py --tp 3 --fractions 0.5,0.7 --methods zs,hg+b2b,hg+b2b+e2e \\
        --windows 64 --out results/recovery/tp3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from syncdrop.bench.stats import paired_ppl_ratio
from syncdrop.eval.data import load_text, resolve_corpus
from syncdrop.eval.perplexity import make_windows, window_nll
from syncdrop.io_utils import atomic_write_json, atomic_write_png, atomic_write_text, provenance
from syncdrop.models.distilled import blocks_digest
from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.runtime import choose_runtime
from syncdrop.spd.distill import DistillSettings, default_lr, distill
from syncdrop.spd.e2e import E2ESettings, e2e_distill
from syncdrop.spd.planning import drop_order, load_profile

log = logging.getLogger("recovery_sweep")

BLOCK_METHODS = {  # name -> (tier, DistillSettings.method, one bank for all fractions)
    "b2b": ("b2b", "b2b", True), "hg+b2b": ("hg+b2b", "b2b", True), "hg+seq": ("hg+b2b", "sequential", False),
}


def gutenberg_windows(tok, seq_len: int, n: int) -> torch.Tensor:
    """``n`` windows of ``seq_len`` tokens from the data folder's Gutenberg books ``(n, seq_len)``: round robin
    over the books (sorted by path), window ``k`` of a book being its tokens ``k*seq_len..``, from ``k = 1`` (the
    first holds the licence header or title page)."""
    books = sorted(resolve_corpus("gutenberg").rglob("*.txt"))
    per_book = [make_windows(tok(b.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
                             ["input_ids"], seq_len, n // len(books) + 2)[1:] for b in books]
    out = [w[k] for k in range(max(len(w) for w in per_book)) for w in per_book if k < len(w)][:n]
    if len(out) < n:
        raise SystemExit(f"--e2e-gutenberg {n}: the books hold only {len(out)} windows of {seq_len} tokens")
    return torch.stack(out)


def parse_method(name: str) -> tuple[str | None, bool]:
    """``zs`` -> (None, False); ``hg+b2b+e2e`` -> ("hg+b2b", True)."""
    block, e2e = name.removesuffix("+e2e"), name.endswith("+e2e")
    if block == "zs" and not e2e:
        return None, False
    if block not in BLOCK_METHODS:
        raise SystemExit(f"--methods: unknown method {name!r} (zs, {', '.join(BLOCK_METHODS)}, each optionally +e2e)")
    return block, e2e


class Times:
    """``OUT/times.json``: seconds of each completed stage, written as each one ends. Beside it,
    ``OUT/times_conditions.json`` says what each stage ran with: torch's intra-op threads and the machine's
    1-minute load average at its start and end (a load above the threads means another job shared the cores,
    so that time is not comparable with a stage that ran alone). Sweeps that share an ``OUT`` (two fractions run
    side by side) each add their stages to the files as they are on disk when a stage ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cond_path = path.with_name("times_conditions.json")
        self.d = json.loads(path.read_text()) if path.exists() else {}
        self.cond = json.loads(self.cond_path.read_text()) if self.cond_path.exists() else {}

    def run(self, key: str, fn, record: bool = True):
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        out = fn()
        if record and key not in self.d:
            secs = time.perf_counter() - t0
            # merged into what is on disk now: another sweep into the same OUT may have written since we read it
            for attr, path in (("d", self.path), ("cond", self.cond_path)):
                if path.exists():
                    setattr(self, attr, {**json.loads(path.read_text()), **getattr(self, attr)})
            self.d[key] = secs
            self.cond[key] = {"threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                              "loadavg_1min_start": round(load0, 2), "loadavg_1min_end": round(os.getloadavg()[0], 2)}
            atomic_write_json(self.cond_path, self.cond)
            atomic_write_json(self.path, self.d)
        return out


def evaluate(spec: str, tp: int, plan: SyncPlan, windows: torch.Tensor, path: Path, chunk: int) -> list[float]:
    """Per-window mean NLL of ``spec`` under ``plan`` (simulated executor, fp32), resumable: the windows
    done so far live in ``path``."""
    key = {"model": spec, "manifest_sha256": blocks_digest(spec), "tp": tp, "plan": plan.to_dict()["blocks"],
           "windows": list(windows.shape)}
    done: list[float] = []
    if path.exists():
        d = json.loads(path.read_text())
        if d.get("key") == key:
            done = d["window_nll"]
    if len(done) >= windows.shape[0]:
        return done[: windows.shape[0]]
    built = choose_runtime("simulated").build(spec, tp, plan, progress=False)
    L = windows.shape[1]
    from syncdrop.progress import progress_bar

    with torch.inference_mode(), progress_bar(total=windows.shape[0], initial=len(done), desc=path.stem, unit="win",
                                              leave=False) as bar:
        while len(done) < windows.shape[0]:
            w = windows[len(done) : len(done) + chunk]
            done += [s / (L - 1) for s in window_nll(built.model, w).tolist()]
            bar.update(w.shape[0])
            atomic_write_json(path, {"key": key, "window_nll": done})
    return done


def kept_result(spec: str, tp: int, plan: SyncPlan, windows: torch.Tensor, path: Path) -> list[float] | None:
    """A finished evaluation of ``spec`` whose model directory no longer exists (model directories are
    large and not committed; their evaluations are): the per-window NLL in ``path`` when its key matches
    everything but the directory's digest, else None. The directory name encodes every training setting
    (:func:`main`'s ``e2e_name`` / ``block_name``), so a result kept under that name is that experiment's.
    Where the directory exists, :func:`evaluate`'s full key decides (a retrained directory is re-evaluated)."""
    if Path(spec, "syncdrop.json").exists() or not path.exists():
        return None
    d = json.loads(path.read_text())
    key = d.get("key", {})
    want = {"model": spec, "tp": tp, "plan": plan.to_dict()["blocks"], "windows": list(windows.shape)}
    if key.get("manifest_sha256") is None or any(key.get(k) != v for k, v in want.items()):
        return None
    done = d["window_nll"]
    return done if len(done) == windows.shape[0] else None


def e2e_curve(model_dir: Path) -> dict[str, Any] | None:
    """The end-to-end stage's record in ``model_dir``'s manifest (held-out KL before training and after each
    epoch, the epoch kept, training windows, adapter, lr, seconds), or None when the directory is not there."""
    man = model_dir / "syncdrop.json"
    if not man.exists():
        return None
    d = json.loads(man.read_text()).get("distill", {})
    st = d.get("e2e")
    if not st:
        return None
    return {"heldout_curve": st["heldout_curve"], "selected_epoch": st["selected_epoch"], "seconds": st["seconds"],
            "adapter": d.get("adapter"), "lr": d.get("lr"), "epochs": d.get("epochs"),
            "train_windows": d.get("train_windows")}


def plot(rows: list[dict], path: Path, title: str) -> None:

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["fraction"], r["ratio"], r["ratio_ci"]) for r in rows if r["method"] == m)
        f = [p[0] * 100 for p in pts]
        y = [(p[1] - 1) * 100 for p in pts]
        err = [[(p[1] - (p[2] or [p[1]])[0]) * 100 for p in pts], [((p[2] or [0, p[1]])[1] - p[1]) * 100 for p in pts]]
        ax.errorbar(f, y, yerr=err, marker="o", capsize=3, label=m)
    ax.axhline(1, color="grey", ls="--", lw=0.8)
    if max((r["ratio"] - 1) * 100 for r in rows) > 50:  # zero-shot at 100% would flatten every other curve
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylim(bottom=min(0.0, min((r["ratio"] - 1) * 100 for r in rows)))
    ax.set_xlabel("SPD fraction (%)")
    ax.set_ylabel("perplexity increase over dense (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_png(path, fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--fractions", default="0.25,0.5,0.7,1.0")
    ap.add_argument("--methods", default="zs,b2b,hg+b2b,hg+seq,hg+b2b+e2e")
    ap.add_argument("--profile", default=None,
                    help="drop order (default results/spd_sweep_tp{tp}/profile.json, the zero-shot one); a recovered "
                         "profile (`syncdrop profile --model BANK`) drops the blocks that recover best")
    ap.add_argument("--sensitivity", default="progressive", choices=("progressive", "isolated"),
                    help="which of the profile's sensitivities orders the blocks (default progressive)")
    ap.add_argument("--calib", default="wikitext2:valid")
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--block-samples", type=int, default=16, help="B2B training windows")
    ap.add_argument("--block-epochs", type=int, default=10)
    ap.add_argument("--block-lr", type=float, default=None, help="B2B learning rate (default: the scanned 1e-3)")
    ap.add_argument("--e2e-samples", type=int, default=64, help="end-to-end training windows")
    ap.add_argument("--e2e-epochs", type=int, default=1)
    ap.add_argument("--e2e-lr", type=float, default=3e-5)
    ap.add_argument("--e2e-adapter", default="full", choices=("full", "lora"))
    ap.add_argument("--e2e-seq-len", type=int, default=None,
                    help="e2e training and held-out window length (default --calib-seq-len): WikiText-2 valid "
                         "windows of this length, the held-out ones after the training ones")
    ap.add_argument("--e2e-gutenberg", type=int, default=0,
                    help="further e2e training windows from the data folder's Gutenberg books (default 0): round "
                         "robin over the books sorted by path, each book's first window (its header) skipped")
    ap.add_argument("--heldout", type=int, default=4, help="held-out calibration windows (after the training ones)")
    ap.add_argument("--seq-len", type=int, default=1024, help="test window length")
    ap.add_argument("--windows", type=int, default=64, help="test windows (WikiText-2 test has 304 of 1024)")
    ap.add_argument("--chunk", type=int, default=4, help="windows evaluated between two writes")
    ap.add_argument("--work", default=None, help="model directories (default runs/recovery/tp{tp})")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    work = Path(args.work or f"runs/recovery/tp{args.tp}")
    (out / "nll").mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        parse_method(m)
    fractions = [float(f) for f in args.fractions.split(",")]
    source = resolve_model(args.model)
    cfg = source.config
    L = cfg.num_layers
    tok = source.load_tokenizer()
    profile = load_profile(args.profile or f"results/spd_sweep_tp{args.tp}/profile.json", L)
    prof_calib = profile.data.get("calib", {})
    if "valid" not in str(prof_calib.get("dataset", "")):
        raise SystemExit(f"--profile: calibrated on {prof_calib}, not on a validation split (it must not see test)")
    order = drop_order(profile.sensitivity(args.sensitivity))
    default_order = order
    if args.profile is not None or args.sensitivity != "progressive":
        default_order = drop_order(load_profile(f"results/spd_sweep_tp{args.tp}/profile.json", L)
                                   .sensitivity("progressive"))

    def tag(plan: SyncPlan) -> str:
        """Model directory suffix of a plan that is not the default order's at its fraction (so that
        directories trained for different blocks never share a name)."""
        if sorted(default_order[: len(plan.dropped)]) == plan.dropped:
            return ""
        return "_b" + hashlib.sha256(json.dumps(plan.dropped).encode()).hexdigest()[:8]
    times = Times(out / "times.json")

    calib = load_text(args.calib)
    n_e2e = max(args.e2e_samples, args.block_samples) + args.heldout
    cw = make_windows(tok(calib.text, add_special_tokens=False)["input_ids"], args.calib_seq_len, n_e2e)
    if cw.shape[0] < n_e2e:
        raise SystemExit(f"--calib {args.calib}: {cw.shape[0]} windows of {args.calib_seq_len}, {n_e2e} needed")
    # training windows first, the held-out ones last (the same held-out windows for every stage)
    held = cw[-args.heldout :]
    calib_meta = {"dataset": calib.name, "path": calib.path, "seq_len": args.calib_seq_len}
    lr = args.block_lr if args.block_lr is not None else max(default_lr(cfg), 1e-3)
    test = load_text("wikitext2")
    tw = make_windows(tok(test.text, add_special_tokens=False)["input_ids"], args.seq_len, args.windows)

    e2e_len = args.e2e_seq_len or args.calib_seq_len
    e2e_meta = {**calib_meta, "seq_len": e2e_len}
    e2e_train, e2e_held = cw[: args.e2e_samples], held
    if e2e_len != args.calib_seq_len:
        ew = make_windows(tok(calib.text, add_special_tokens=False)["input_ids"], e2e_len,
                          args.e2e_samples + args.heldout)
        if ew.shape[0] < args.e2e_samples + args.heldout:
            raise SystemExit(f"--e2e-seq-len {e2e_len}: {args.calib} has only {ew.shape[0]} windows")
        e2e_train, e2e_held = ew[: args.e2e_samples], ew[args.e2e_samples :]
    if args.e2e_gutenberg:
        e2e_train = torch.cat([e2e_train, gutenberg_windows(tok, e2e_len, args.e2e_gutenberg)])
        e2e_meta["e2e_gutenberg_windows"] = args.e2e_gutenberg

    def e2e_name(block: str, f: float, plan: SyncPlan) -> str:
        return (f"{block}+e2e_f{f:g}_{args.e2e_adapter}_lr{args.e2e_lr:g}_n{args.e2e_samples}_ep{args.e2e_epochs}"
                + (f"_g{args.e2e_gutenberg}" if args.e2e_gutenberg else "")
                + (f"_es{e2e_len}" if e2e_len != args.calib_seq_len else "") + block_cfg + tag(plan))

    # the block stage's settings in its directory name (the first runs' 8 x 512 x 10 epochs keep the short one)
    block_cfg = ("" if (args.block_samples, args.block_epochs, args.calib_seq_len) == (8, 10, 512)
                 else f"_n{args.block_samples}_ep{args.block_epochs}_s{args.calib_seq_len}")

    def block_name(block: str, f: float, plan: SyncPlan) -> str:
        return f"bank_{block}{block_cfg}" if BLOCK_METHODS[block][2] else f"{block}_f{f:g}{block_cfg}{tag(plan)}"

    def block_stage(block: str, f: float, plan: SyncPlan) -> Path:
        tier, method, banked = BLOCK_METHODS[block]
        d = work / block_name(block, f, plan)
        key = f"distill:{d.name}"
        s = DistillSettings(lr, args.block_epochs, 1, 0.0, 0, method=method)
        the_plan = SyncPlan.uniform(L, "drop") if banked else plan
        # a directory another sweep trained (its time is in that sweep's times.json): reused, not timed
        record = not (d / "syncdrop.json").exists()
        times.run(key, record=record, fn=lambda: distill(source, args.tp, the_plan,
                                                         dict.fromkeys(the_plan.dropped, tier),
                                                         cw[: args.block_samples], held, d, s, calib_meta))
        return d

    def e2e_stage(block: str, f: float, plan: SyncPlan, start: Path) -> Path:
        s = E2ESettings(args.e2e_lr, args.e2e_epochs, args.e2e_adapter)
        d = work / e2e_name(block, f, plan)
        if not (d / "syncdrop.json").exists():
            times.run(f"e2e:{d.name}", lambda: e2e_distill(str(start), args.tp, plan, e2e_train, e2e_held, d, s,
                                                           e2e_meta))
        return d

    base_nll = evaluate(args.model, args.tp, SyncPlan.uniform(L), tw, out / "nll" / "dense.json", args.chunk)
    rows = []
    results = out / "recovery.json"
    earlier = {(r["fraction"], r["method"]): r for r in
               (json.loads(results.read_text()).get("rows", []) if results.exists() else [])}
    for f in fractions:
        plan = SyncPlan.dropping(L, sorted(order[: round(f * L)]))
        for m in methods:
            block, e2e = parse_method(m)
            nll_path = out / "nll" / f"{m}_f{f:g}.json"
            spec = args.model
            if block is not None:
                name = e2e_name(block, f, plan) if e2e else block_name(block, f, plan)
                nll = kept_result(str(work / name), args.tp, plan, tw, nll_path)
                if nll is not None:
                    log.info("F=%.2f %s: kept result of %s (its directory is gone; not retrained)", f, m, name)
                else:
                    spec_dir = block_stage(block, f, plan)
                    if e2e:
                        spec_dir = e2e_stage(block, f, plan, spec_dir)
                    spec = str(spec_dir)
            if block is None or nll is None:
                nll = evaluate(spec, args.tp, plan, tw, nll_path, args.chunk)
            curve = e2e_curve(Path(spec)) if e2e else None
            if e2e and curve is None:  # the model directory is gone: what the earlier run of this file recorded
                curve = earlier.get((f, m), {}).get("e2e")
            ratio, ci = paired_ppl_ratio(nll, base_nll)
            bank = block is not None and BLOCK_METHODS[block][2]
            secs = {k: v for k, v in times.d.items()
                    if block is not None and (k == f"distill:{block_name(block, f, plan)}"
                                              or (e2e and k == f"e2e:{e2e_name(block, f, plan)}"))}
            rows.append({"fraction": f, "method": m, "dropped": plan.dropped, "ppl": math.exp(sum(nll) / len(nll)),
                         "ratio": ratio, "ratio_ci": list(ci) if ci else None, "windows": len(nll),
                         "stage_seconds": secs, "stage_conditions": {k: times.cond.get(k) for k in secs},
                         "seconds_note": "the bank is distilled once for every block (all fractions)" if bank else "",
                         **({"e2e": curve} if curve else {})})
            log.info("F=%.2f %-14s ppl %.3f  x%.4f %s", f, m, rows[-1]["ppl"], ratio, ci)
            atomic_write_json(results, {"command": sys.argv, "provenance": provenance(), "rows": rows})
    dense = math.exp(sum(base_nll) / len(base_nll))
    settings = {k: v for k, v in vars(args).items()}
    settings.update({"test": test.path, "tokens_scored": int(tw.shape[0] * (args.seq_len - 1)), "block_lr": lr,
                     "calib": calib_meta, "drop_order": order, "profile_calib": prof_calib, "profile": profile.path})
    atomic_write_json(results, {"command": sys.argv, "provenance": provenance(), "settings": settings,
                                "dense_ppl": dense, "dense_window_nll": base_nll, "rows": rows, "times": times.d})
    lines = [f"{source.name} TP={args.tp}: WikiText-2 test perplexity, {tw.shape[0]} windows of {args.seq_len} "
             f"(dense {dense:.3f}); ratio to dense with its 95% paired bootstrap interval over windows. "
             f"Calibration: {calib.name}, B2B {args.block_samples} x {args.calib_seq_len} tokens x {args.block_epochs} "
             f"epochs (lr {lr:g}), e2e {args.e2e_samples} x {e2e_len} tokens"
             + (f" + {args.e2e_gutenberg} Gutenberg windows" if args.e2e_gutenberg else "")
             + f" x {args.e2e_epochs} epoch(s) (lr {args.e2e_lr:g}, {args.e2e_adapter}).", "",
             "| SPD | blocks | method | ppl | vs dense | 95% interval | stage time |",
             "|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        ci = r["ratio_ci"]
        secs = ", ".join(f"{k.split(':')[0]} {v / 60:.1f} min" for k, v in r["stage_seconds"].items())
        lines.append(f"| {r['fraction']:.0%} | {len(r['dropped'])} | {r['method']} | {r['ppl']:.3f} | "
                     f"{(r['ratio'] - 1) * 100:+.2f}% | "
                     + (f"[{(ci[0] - 1) * 100:+.2f}%, {(ci[1] - 1) * 100:+.2f}%]" if ci else "-")
                     + f" | {secs or '-'} |")
    atomic_write_text(out / "recovery.md", "\n".join(lines) + "\n")
    plot(rows, out / "recovery.png", f"{source.name} TP={args.tp}: recovery methods, WikiText-2 test")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
