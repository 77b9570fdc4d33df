"""Summarise an end-to-end learning-rate scan of ``recovery_sweep.py`` runs: per e2e model, the held-out KL
curve and the epoch kept, and the perplexity ratio to dense with its interval where a sweep under ``--scan``
evaluated it. The curve comes from the sweep's ``recovery.json`` row where it recorded one, else from the
model directory's manifest under ``--work`` (which a fresh clone does not have).

    python experiments/recovery_scan_summary.py --work runs/recovery/tp3 --fraction 0.5 \\
        --scan results/recovery/tp3_e2e_scan results/recovery/tp3 --out results/recovery/tp3_e2e_scan/scan
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--scan", nargs="+", required=True, help="result folders holding recovery.json files")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = ap.parse_args(argv)
    evaluated: dict[str, dict] = {}  # e2e model directory name -> its evaluation
    named: set[str] = set()  # every e2e directory a scanned sweep trained at this fraction
    rows = []
    tag = f"+e2e_f{args.fraction:g}_"
    for root in args.scan:
        for f in sorted(Path(root).rglob("recovery.json")):
            d = json.loads(f.read_text())
            named.update(k.removeprefix("e2e:") for k in d.get("times", {}) if k.startswith("e2e:") and tag in k)
            for r in d.get("rows", []):
                if not (r["method"].endswith("+e2e") and r["fraction"] == args.fraction):
                    continue
                nll = f.parent / "nll" / f"{r['method']}_f{r['fraction']:g}.json"
                if not nll.exists():
                    continue
                spec = json.loads(nll.read_text())["key"]["model"]  # the model directory the sweep evaluated
                name = Path(spec).name
                named.add(name)
                evaluated[name] = {"ratio": r["ratio"], "ratio_ci": r["ratio_ci"], "file": str(f)}
                if "e2e" in r and name not in {Path(x["dir"]).name for x in rows}:
                    # the sweep recorded the stage's curve: no model directory needed (one row per model, however
                    # many scanned sweeps evaluated it)
                    e = r["e2e"]
                    rows.append({"dir": spec, "adapter": e["adapter"], "lr": e["lr"], "epochs": e["epochs"],
                                 "train_windows": e["train_windows"], "heldout_curve": e["heldout_curve"],
                                 "selected_epoch": e["selected_epoch"], "seconds": e["seconds"],
                                 **evaluated[name]})
    recorded = {Path(r["dir"]).name for r in rows}
    for man in sorted(Path(args.work).glob(f"*{tag}*/syncdrop.json")):
        name = man.parent.name
        if name not in named or name in recorded:
            continue  # trained by a sweep not scanned here (another recipe), or already read from a results file
        m = json.loads(man.read_text())
        d = m["distill"]
        st = d["e2e"]
        row = {"dir": str(man.parent), "adapter": d["adapter"], "lr": d["lr"], "epochs": d["epochs"],
               "train_windows": d["train_windows"], "heldout_curve": st["heldout_curve"],
               "selected_epoch": st["selected_epoch"], "seconds": st["seconds"]}
        row.update(evaluated.get(name, {}))
        rows.append(row)
    rows.sort(key=lambda r: (r["adapter"], r["lr"], r["epochs"]))
    missing = sorted(named - {Path(r["dir"]).name for r in rows})
    if (missing or not rows) and Path(args.out + ".json").exists():
        # model directories gone (a fresh clone, another checkout) and results rows that predate their recorded
        # curves: a summary without those models would silently lose rows, so the existing one stays
        print(f"no end-to-end curve under {args.work} or in the results rows for {', '.join(missing) or 'any model'}: "
              f"{args.out}.json kept as it is")
        return 0
    if missing:
        print(f"no end-to-end curve for {', '.join(missing)}: left out of {args.out}.json")
    lines = [f"End-to-end distillation scan at SPD {args.fraction:.0%} (held-out KL to the original model on the "
             "held-out calibration windows; epoch 0 = the start, kept when no epoch improves on it).", "",
             "| adapter | lr | epochs | held-out KL (start -> per epoch) | epoch kept | ppl vs dense | min |",
             "|---|---:|---:|---|---:|---|---:|"]
    for r in rows:
        ci = r.get("ratio_ci")
        ppl = "-" if "ratio" not in r else f"{(r['ratio'] - 1) * 100:+.2f}%" + (
            f" [{(ci[0] - 1) * 100:+.2f}, {(ci[1] - 1) * 100:+.2f}]" if ci else "")
        lines.append(f"| {r['adapter']} | {r['lr']:g} | {r['epochs']} | "
                     + " -> ".join(f"{x:.4f}" for x in r["heldout_curve"])
                     + f" | {r['selected_epoch']} | {ppl} | {r['seconds'] / 60:.1f} |")
    atomic_write_json(args.out + ".json", {"command": sys.argv, "provenance": provenance(), "rows": rows})
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
