"""SPD accuracy sweep on real weights: WikiText-2 test perplexity against the SPD fraction, for
zero-shot drops, B2B and HG+B2B (issue 4, item 5).

Steps, each cached under ``--out`` and skipped when its file exists with the same settings:

1. profile: per-block sensitivity on WikiText-2 valid (``profile.json``), the drop order;
2. banks: every block distilled once per variant (``bank_<variant>/``, a ``syncdrop distill``
   directory for plan ``all``). Distillation inputs come from the original model, so block i's
   distilled weights do not depend on which other blocks are dropped: the bank restricted to a
   plan's blocks *is* ``syncdrop distill --plan PLAN`` with the same settings (same seed per block);
3. perplexity for fractions 0, 0.1, ..., 1.0 (the ``round(f * L)`` least sensitive blocks dropped)
   with each variant, on the first ``--windows`` test windows; rows are appended as they finish.

Writes ``sweep.json`` (settings, provenance, profile summary, raw rows, summary), ``sweep.md`` and
``sweep.png``. Example (what results/spd_sweep_tp3 was made with)::

    python experiments/spd_sweep.py --tp 3 --out results/spd_sweep_tp3
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from pathlib import Path

from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import make_windows, perplexity
from syncdrop.io_utils import atomic_write_json, atomic_write_png, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import TPModel, simulated_model
from syncdrop.parallel.sharding import distilled_layouts
from syncdrop.plan import SyncPlan
from syncdrop.spd.distill import DistillSettings, default_lr, distill
from syncdrop.spd.planning import drop_order, load_profile
from syncdrop.spd.profile import plot_profile, profile_sensitivity

log = logging.getLogger("spd_sweep")

# name -> (tier, head-grouping unit, MLP matching)
VARIANTS = {"b2b": ("b2b", "group", "shard"), "hg+b2b": ("hg+b2b", "group", "shard"),
            "hg-head-channel+b2b": ("hg+b2b", "head", "channel"), "hg-head-shard+b2b": ("hg+b2b", "head", "shard"),
            "hg-group-channel+b2b": ("hg+b2b", "group", "channel")}


def _cached(path: Path, settings: dict) -> dict | None:
    if path.exists():
        d = json.loads(path.read_text())
        if d.get("sweep_settings") == settings:
            return d
    return None


def _compose(orig: TPModel, bank: TPModel | None, dropped: list[int], L: int) -> TPModel:
    """The original model with the dropped blocks' weights and layouts taken from ``bank``."""
    m = copy.copy(orig)
    if bank is not None:
        m.blocks = [bank.blocks[i] if i in dropped else orig.blocks[i] for i in range(L)]
        m.geos = [bank.geos[i] if i in dropped else orig.geos[i] for i in range(L)]
        m.layouts = [bank.layouts[i] if i in dropped else orig.layouts[i] for i in range(L)]
    m.plan = SyncPlan.dropping(L, dropped)
    return m


def plot(rows: list[dict], variants: list[str], title: str, path: Path) -> None:

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for v in ["zs", *variants]:
        pts = sorted((r["fraction"], r["ppl"]) for r in rows if r["variant"] in (v, "zs") and (r["variant"] == v
                                                                                             or r["fraction"] == 0))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
    ax.set_yscale("log")
    ax.set_xlabel("SPD fraction (blocks without the attention sync)")
    ax.set_ylabel("WikiText-2 test perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_png(path, fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--variants", default="b2b,hg+b2b", help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--fractions", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    ap.add_argument("--profile-samples", type=int, default=4)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-heldout", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16, help="test windows evaluated")
    ap.add_argument("--last-epoch", action="store_true",
                    help="distilled blocks keep their last epoch (how results/spd_sweep_tp* were made, before "
                         "best-epoch selection existed)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")
    fractions = [float(f) for f in args.fractions.split(",")]
    source = resolve_model(args.model)
    cfg = source.config
    L = cfg.num_layers
    tok = source.load_tokenizer()

    # 1. profile (drop order) on WikiText-2 valid
    prof_path = out / "profile.json"
    prof_settings = {"model": args.model, "tp": args.tp, "samples": args.profile_samples, "seq_len": args.seq_len}
    if _cached(prof_path, prof_settings) is None:
        valid = load_text("wikitext2:valid")
        win = make_windows(tok(valid.text, add_special_tokens=False)["input_ids"], args.seq_len, args.profile_samples)
        model = simulated_model(cfg, source.reader, args.tp)
        prof = profile_sensitivity(model, win)
        d = prof.to_dict(source.name, args.tp, {"dataset": valid.name, "path": valid.path}, model_spec=args.model,
                         dtype="float32", batch_size=1, sweep_settings=prof_settings)
        atomic_write_json(prof_path, d)
        plot_profile(d, out / "profile.png")
        del model
    profile = load_profile(prof_path, L)
    order = drop_order(profile.sensitivity("progressive"))
    log.info("drop order: %s", order)

    # 2. banks
    calib = load_text("wikitext2:valid")
    n = args.calib_samples + args.calib_heldout
    cw = make_windows(tok(calib.text, add_special_tokens=False)["input_ids"], args.seq_len, n)
    lr = args.lr if args.lr is not None else default_lr(cfg)
    banks = {}
    for v in variants:
        tier, unit, mlp = VARIANTS[v]
        bank_dir = out / f"bank_{v}"
        s = DistillSettings(lr, args.epochs, 1, 0.0, 0, unit, mlp, keep_best=not args.last_epoch)
        log.info("bank %s: distilling (or reusing) all %d blocks", v, L)
        distill(source, args.tp, SyncPlan.uniform(L, "drop"), dict.fromkeys(range(L), tier), cw[: args.calib_samples],
                cw[args.calib_samples :], bank_dir, s, {"dataset": calib.name, "path": calib.path,
                                                         "seq_len": args.seq_len})
        banks[v] = bank_dir

    # 3. perplexity sweep
    test = load_text("wikitext2")
    tw = make_windows(tok(test.text, add_special_tokens=False)["input_ids"], args.seq_len, args.windows)
    settings = {"model": args.model, "tp": args.tp, "seq_len": args.seq_len, "windows": int(tw.shape[0]),
                "tokens_scored": int(tw.shape[0] * (args.seq_len - 1)), "test": test.path,
                "calib": {"path": calib.path, "train_windows": args.calib_samples, "heldout": args.calib_heldout},
                "profile_samples": args.profile_samples, "epochs": args.epochs, "lr": lr}
    res_path = out / "sweep.json"
    prev = json.loads(res_path.read_text()) if res_path.exists() else {}
    rows = prev.get("rows", []) if prev.get("settings") == settings else []
    done = {(r["fraction"], r["variant"]) for r in rows}
    orig = simulated_model(cfg, source.reader, args.tp)
    loaded = {}
    for f in fractions:
        dropped = sorted(order[: round(f * L)])
        for v in ["zs", *variants]:
            if (f, v) in done or (f == 0 and v != "zs"):
                continue
            if v != "zs" and v not in loaded:
                b = resolve_model(str(banks[v]))
                loaded[v] = simulated_model(cfg, b.reader, args.tp, block_layouts=distilled_layouts(b.spd, cfg))
            m = _compose(orig, loaded.get(v), dropped, L)
            r = perplexity(m, tw, progress=False)
            rows.append({"fraction": f, "variant": v, "dropped": dropped, "ppl": r.ppl, "window_nll": r.window_nll})
            log.info("fraction %.1f %-22s ppl %.4f", f, v, r.ppl)
            atomic_write_json(res_path, {"settings": settings, "provenance": provenance(), "rows": rows})
    dense = next(r["ppl"] for r in rows if r["fraction"] == 0)

    def ppl(f: float, v: str) -> float | None:
        if f == 0:
            return dense
        return next((r["ppl"] for r in rows if r["fraction"] == f and r["variant"] == v), None)

    ok = [f for f in fractions if (p := ppl(f, "zs")) is not None and p <= dense * 1.01]
    summary = {"baseline_ppl": dense, "largest_zs_fraction_within_1pct": max(ok) if ok else 0.0, "recovery": {}}
    for f in (0.5, 1.0):
        zs = ppl(f, "zs")
        for v in variants:
            pv = ppl(f, v)
            if zs is not None and pv is not None and zs > dense:
                summary["recovery"][f"{v}@{f}"] = (zs - pv) / (zs - dense)
    atomic_write_json(res_path, {"settings": settings, "variants": VARIANTS, "provenance": provenance(),
                                 "profile": {"path": str(prof_path), "baseline_ppl_calib": profile.baseline_ppl,
                                             "drop_order": order}, "rows": rows, "summary": summary})
    head = "| SPD fraction | blocks dropped | " + " | ".join(["zero-shot", *variants]) + " |"
    lines = [f"SPD sweep, {source.name} TP={args.tp}: WikiText-2 test perplexity, first {settings['windows']} windows "
             f"of {args.seq_len} tokens ({settings['tokens_scored']} scored); dense {dense:.3f}.", "", head,
             "|" + "---|" * (2 + 1 + len(variants))]
    for f in fractions:
        cells = [ppl(f, v) for v in ["zs", *variants]]
        lines.append(f"| {f:.1f} | {round(f * L)} | " + " | ".join("" if c is None else f"{c:.3f}" for c in cells)
                     + " |")
    best_zs = summary["largest_zs_fraction_within_1pct"]
    lines += ["", f"Largest zero-shot fraction within +1% perplexity: {best_zs:.1f}.",
              "Share of the zero-shot perplexity increase recovered: "
              + ", ".join(f"{k} {v:.1%}" for k, v in summary["recovery"].items()) + "."]
    atomic_write_text(out / "sweep.md", "\n".join(lines) + "\n")
    plot(rows, variants, f"{source.name} TP={args.tp}: SPD fraction vs WikiText-2 test ppl", out / "sweep.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
