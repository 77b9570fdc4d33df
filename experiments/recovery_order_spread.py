"""How much end-to-end recovery depends on the calibration windows' order, count and held-out window.

From an ``syncdrop auto`` run directory (its plan ``plans/NAME.json`` and block-stage model ``models/NAME``
of one SPD fraction), end-to-end distillation is repeated with only one thing changed at a time: the seed
of the window order, the learning-rate schedule (constant, linear decay to 0), the number of training
windows and which window is held out (the held-out KL picks the best epoch). Each recovered model is scored
on the run's test windows (``auto``: the first ``--eval-windows`` of WikiText-2 test, ``--seq-len`` tokens).
The spread over seeds is the recovery's own noise, which the choice's paired interval over test windows
does not contain. Writes ``OUT.json`` (provenance, per variant: settings, perplexity, window NLLs, held-out
curve) and ``OUT.md``; finished variants are reused from ``OUT.json`` (``OUT_models/`` keeps the models).

    python experiments/recovery_order_spread.py --run runs/demo --fraction 0.5 \\
        --out results/recovery_order_spread/demo_spd050
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from syncdrop.auto.candidates import candidate_name
from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import perplexity, text_windows
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.plan import resolve_plan
from syncdrop.runtime import choose_runtime
from syncdrop.spd.e2e import E2ESettings, e2e_distill

log = logging.getLogger("recovery_order_spread")


def variants(n: int, seeds: list[int]) -> dict[str, dict]:
    """name -> (training windows, held-out window: "next" = window n, "last" = the last calibration window,
    schedule, lr, seed)."""
    out = {f"constant 3e-5, seed {s}": {"n": n, "held": "next", "schedule": "constant", "lr": 3e-5, "seed": s}
           for s in seeds}
    out["constant 3e-5, seed 0, last window held out"] = {"n": n, "held": "last", "schedule": "constant",
                                                          "lr": 3e-5, "seed": 0}
    out[f"constant 3e-5, seed 0, {n + 2} windows"] = {"n": n + 2, "held": "last", "schedule": "constant",
                                                      "lr": 3e-5, "seed": 0}
    for lr in (6e-5, 3e-5):
        out |= {f"linear {lr:g}, seed {s}": {"n": n, "held": "next", "schedule": "linear", "lr": lr, "seed": s}
                for s in seeds}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/demo", help="a syncdrop auto run directory")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--windows", type=int, default=32, help="end-to-end training windows (default 32)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    run, name = Path(args.run), candidate_name(args.fraction)
    src = resolve_model(args.model)
    tok = src.load_tokenizer()
    plan = resolve_plan(str(run / "plans" / f"{name}.json"), src.config.num_layers, tp=args.tp)
    calib = load_text("auto:valid")
    calib_w = text_windows(tok, calib.text, args.seq_len, 4096, "calibration", required=args.windows + 3)
    test = text_windows(tok, load_text("auto").text, args.seq_len, args.eval_windows, "test")
    rt = choose_runtime("simulated")
    done = out.with_suffix(".json")
    prev = json.loads(done.read_text()).get("variants", {}) if done.exists() else {}
    dense = perplexity(rt.build(args.model, args.tp, "none", progress=False).model, test, progress=False)
    res = {}
    for label, v in variants(args.windows, [int(s) for s in args.seeds.split(",")]).items():
        if label in prev and prev[label]["settings"] == v:
            res[label] = prev[label]
            continue
        held = calib_w[v["n"] : v["n"] + 1] if v["held"] == "next" else calib_w[-1:]
        d = out.parent / f"{out.name}_models" / label.replace(" ", "_").replace(",", "")
        t0 = time.perf_counter()
        e2e_distill(str(run / "models" / name), args.tp, plan, calib_w[: v["n"]], held, d,
                    E2ESettings(v["lr"], 1, seed=v["seed"], lr_schedule=v["schedule"]), calib.info(), progress=False)
        p = perplexity(rt.build(str(d), args.tp, None, progress=False).model, test, progress=False)
        st = next(iter(json.loads((d / "syncdrop.json").read_text())["blocks"].values()))["stats"]["e2e"]
        res[label] = {"settings": v, "ppl": p.ppl, "window_nll": list(p.window_nll),
                      "heldout_curve": st["heldout_curve"], "selected_epoch": st["selected_epoch"],
                      "seconds": time.perf_counter() - t0}
        log.info("%s: ppl %.3f", label, p.ppl)
        atomic_write_json(out.with_suffix(".json"), {"settings": vars(args), "provenance": provenance(),
                                                     "dense_ppl": dense.ppl, "variants": res})
    doc = {"settings": vars(args), "provenance": provenance(), "dense_ppl": dense.ppl, "variants": res}
    atomic_write_json(out.with_suffix(".json"), doc)
    lines = [f"{args.model} TP={args.tp}, SPD {args.fraction:g} of `{run}` recovered end to end from its block stage "
             f"({args.windows} windows of {args.seq_len} unless stated, 1 epoch); perplexity on the first "
             f"{test.shape[0]} WikiText-2 test windows; dense {dense.ppl:.3f}.", "",
             "| variant | perplexity | vs dense |", "|---|---:|---:|"]
    lines += [f"| {k} | {r['ppl']:.3f} | {r['ppl'] / dense.ppl - 1:+.2%} |" for k, r in res.items()]
    for group in ("constant 3e-5, seed", "linear 6e-05, seed", "linear 3e-05, seed"):
        xs = [r["ppl"] for k, r in res.items() if k.startswith(group) and k.count(",") == 1]
        if len(xs) > 1:
            lines.append(f"\n{group.rsplit(',', 1)[0]} over {len(xs)} seeds: mean {statistics.mean(xs):.3f}, "
                         f"range {min(xs):.3f}-{max(xs):.3f} ({(max(xs) - min(xs)) / dense.ppl:.2%} of dense)")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
