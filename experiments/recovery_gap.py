"""What limits recovery: where an SPD model's perplexity gap to dense comes from (issue 16, point 3).

Each configuration (a ``syncdrop distill`` directory under its own plan) is scored beside the dense
model on five window sets, so that three gaps can be told apart:

* ``valid-train@512``: WikiText-2 valid windows 0..7 of 512 tokens, the ones every block stage trained on;
* ``valid-unseen@512`` and ``valid-unseen@1024``: the *same tokens* of WikiText-2 valid, never used for
  any training or selection (512-token windows ``--unseen-start``.., i.e. 1024-token windows from half
  that index), cut into windows of 512 and of 1024;
* ``test@512`` and ``test@1024``: the first tokens of WikiText-2 test, cut the same two ways.

train vs unseen (same length): what the calibration windows were fitted to; 512 vs 1024 on the same
tokens: what longer contexts cost an SPD block trained at 512; valid vs test: the split.

Per configuration and set: perplexity / dense with its 95% paired percentile bootstrap interval over
windows (the same windows for both). Writes ``OUT.json`` (command, provenance, per-window NLLs) and
``OUT.md``; per-set NLLs are cached in ``OUT_nll/`` keyed by the model's blocks and plan, so a rerun only
scores what changed.

    python experiments/recovery_gap.py --tp 3 \\
        --configs "hg+b2b=runs/recovery/tp3/bank_hg+b2b@0.5,e2e=runs/recovery/tp3/hg+b2b+e2e_f0.5_..." \\
        --out results/recovery/tp3_gap/gap
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
from pathlib import Path

import torch

from syncdrop.bench.stats import paired_ppl_ratio
from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import make_windows, window_nll
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.distilled import blocks_digest
from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.runtime import choose_runtime
from syncdrop.spd.planning import drop_order, load_profile

log = logging.getLogger("recovery_gap")


def window_sets(tok, unseen_start: int, n512: int) -> dict[str, torch.Tensor]:
    """The five sets (module docstring): name -> ``(W, S)`` token windows."""
    valid = tok(load_text("wikitext2:valid").text, add_special_tokens=False)["input_ids"]
    test = tok(load_text("wikitext2").text, add_special_tokens=False)["input_ids"]
    if unseen_start % 2:
        raise SystemExit(f"--unseen-start must be even (1024-token windows cover two 512-token ones), got "
                         f"{unseen_start}")
    sets = {"valid-train@512": make_windows(valid, 512, 8)}
    for name, ids, start in (("valid-unseen", valid, unseen_start), ("test", test, 0)):
        for L in (512, 1024):
            k = 512 * start // L  # the first window, in windows of L
            w = make_windows(ids, L, k + n512 * 512 // L)[k:]
            if w.shape[0] * L != n512 * 512:
                raise SystemExit(f"{name}: not enough text for {n512} windows of 512 from window {start}")
            sets[f"{name}@{L}"] = w
    return sets


def score(spec: str, tp: int, plan: SyncPlan, windows: torch.Tensor, path: Path) -> list[float]:
    """Per-window mean NLL of ``spec`` under ``plan`` on ``windows``, cached in ``path`` (keyed by the
    model's blocks and plan digest, the plan and the windows' digest)."""
    key = {"model": spec, "manifest_sha256": blocks_digest(spec), "tp": tp, "plan": plan.to_dict()["blocks"],
           "windows_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest()}
    if path.exists() and (d := json.loads(path.read_text())).get("key") == key:
        return d["window_nll"]
    built = choose_runtime("simulated").build(spec, tp, plan, progress=False)
    L = windows.shape[1]
    with torch.inference_mode():
        nll = [window_nll(built.model, windows[i : i + 1]).item() / (L - 1) for i in range(windows.shape[0])]
    atomic_write_json(path, {"key": key, "window_nll": nll})
    return nll


def slug(name: str) -> str:
    """A configuration name as a file name (runs of other characters -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9+.-]+", "_", name)


def parse_configs(text: str, L: int, order: list[int]) -> dict[str, tuple[str, SyncPlan]]:
    """``NAME=DIR`` (the directory's own plan) or ``NAME=DIR@F`` (the default order's plan at fraction F,
    e.g. a bank), comma-separated."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, rest = item.partition("=")
        spec, at, frac = rest.partition("@")
        if not sep or not name or not (Path(spec) / "syncdrop.json").is_file():
            raise SystemExit(f"--configs: expected NAME=DIR[@FRACTION] with DIR a `syncdrop distill` directory, "
                             f"got {item!r}")
        plan = (SyncPlan.dropping(L, sorted(order[: round(float(frac) * L)])) if at
                else resolve_model(spec).spd.plan)
        out[name] = (spec, plan)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="the dense reference")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--configs", required=True, help="NAME=DIR[@FRACTION],... (see parse_configs)")
    ap.add_argument("--profile", default=None, help="the order of NAME=DIR@F (default results/spd_sweep_tp{tp})")
    ap.add_argument("--unseen-start", type=int, default=100,
                    help="first unseen 512-token window of WikiText-2 valid (default 100: after every training and "
                         "held-out window of the recovery sweep)")
    ap.add_argument("--windows", type=int, default=32, help="512-token windows per set (default 32)")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    cache = out.parent / f"{out.name}_nll"
    cache.mkdir(parents=True, exist_ok=True)
    source = resolve_model(args.model)
    L = source.config.num_layers
    profile = load_profile(args.profile or f"results/spd_sweep_tp{args.tp}/profile.json", L)
    configs = parse_configs(args.configs, L, drop_order(profile.sensitivity("progressive")))
    sets = window_sets(source.load_tokenizer(), args.unseen_start, args.windows)
    rows, nlls = [], {}
    for sname, w in sets.items():
        base = score(args.model, args.tp, SyncPlan.uniform(L), w, cache / f"dense_{sname}.json")
        nlls[f"dense/{sname}"] = base
        for cname, (spec, plan) in configs.items():
            nll = score(spec, args.tp, plan, w, cache / f"{slug(cname)}_{sname}.json")
            nlls[f"{cname}/{sname}"] = nll
            r, ci = paired_ppl_ratio(nll, base)
            rows.append({"config": cname, "set": sname, "windows": list(w.shape), "ratio": r,
                         "ratio_ci": list(ci) if ci else None, "dropped": plan.dropped, "model": spec})
            log.info("%-12s %-18s x%.4f %s", cname, sname, r, ci)
    atomic_write_json(out.with_suffix(".json"), {"command": sys.argv, "provenance": provenance(),
                                                 "settings": vars(args), "rows": rows, "window_nll": nlls})
    names = list(sets)
    lines = [f"{source.name} TP={args.tp}: perplexity / dense on five window sets (95% paired bootstrap interval "
             f"over windows); {args.windows} windows of 512 tokens or half as many of 1024 over the same tokens; "
             f"valid-unseen from 512-token window {args.unseen_start} of WikiText-2 valid.", "",
             "| config | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for cname in configs:
        cells = []
        for sname in names:
            r = next(x for x in rows if x["config"] == cname and x["set"] == sname)
            ci = r["ratio_ci"]
            cells.append(f"{(r['ratio'] - 1) * 100:+.2f}%" + (f" [{(ci[0] - 1) * 100:+.2f}, {(ci[1] - 1) * 100:+.2f}]"
                                                                if ci else ""))
        lines.append(f"| {cname} | " + " | ".join(cells) + " |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
