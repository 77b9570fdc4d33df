"""Perplexity of compressed sync plans against dense, paired per window, zero-shot (no recovery).

Each configuration is a plan: a wire format on every sync point (``int8``, ``int4:g32``...), SPD at a
fraction of the blocks chosen by the sensitivity profile's order (``spd:0.5``), or both
(``spd:0.5+int8``: the kept sync points, including the SPD blocks' one all-reduce, compressed). Each is
scored on the same WikiText-2 test windows as dense, in the simulated executor (exact), and reported as
perplexity / dense with a 95% paired percentile-bootstrap interval over windows
(:func:`syncdrop.bench.stats.paired_ppl_ratio`).

``--model`` may be a ``syncdrop distill`` directory (e.g. end-to-end recovery through a compressed plan):
each plan then runs the distilled blocks trained for its form and the base blocks elsewhere
(:func:`syncdrop.runtime.for_plan`), so dense is the base model.

Per-window NLLs are cached under ``OUT_nll/`` keyed by plan (and, for a distilled directory, the directory
and the distilled blocks that run) and window, so a run can be stopped and
resumed, or extended to more windows (``--windows 304`` is all of WikiText-2 test at 1024 tokens).
Writes ``OUT.json`` (settings, provenance, per-window NLLs, ratios) and ``OUT.md``. Example::

    python benchmarks/compressed_ppl.py --tp 3 --windows 24 --out results/compressed_ppl/tp3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path

import torch

from syncdrop.bench.stats import paired_ppl_ratio
from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import make_windows, window_nll
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.progress import progress_bar
from syncdrop.runtime import choose_runtime
from syncdrop.spd.planning import config_plans

log = logging.getLogger("compressed_ppl")

DEFAULT_CONFIGS = ("bf16,fp8,int8,int4,int4:g32,spd:0.25,spd:0.5,spd:0.7,spd:0.25+int8,spd:0.5+int8,spd:0.7+int8,"
                   "spd:0.7+int4:g32")


def scores(built, plan: SyncPlan, windows: torch.Tensor, cache: Path, what: str) -> list[float]:
    """Per-window mean NLL (nats per predicted token) of ``plan`` on ``built`` (a runtime's built model),
    cached per window in ``cache``."""
    from syncdrop.runtime import for_plan

    ident = plan.to_dict()["blocks"]
    src = for_plan(built.source, plan, warn=False)
    if src.spd is not None and src.spd.blocks:  # distilled blocks run: the key names them
        ident = {"plan": ident, "model": built.source.spec, "blocks": sorted(src.spd.blocks)}
    key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
    path = cache / f"{key}.json"
    done = json.loads(path.read_text())["nll"] if path.exists() else {}
    model = built.use_plan(plan)
    L = windows.shape[1]
    out = []
    with torch.inference_mode():
        for i in progress_bar(range(windows.shape[0]), desc=what, unit="win"):
            w = windows[i : i + 1]
            wkey = hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]
            if wkey not in done:
                done[wkey] = window_nll(model, w).item() / (L - 1)
                atomic_write_json(path, {"plan": plan.to_dict()["blocks"], "ident": ident, "nll": done})
            out.append(done[wkey])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated (default {DEFAULT_CONFIGS})")
    ap.add_argument("--profile", default=None, help="the SPD order (default results/spd_sweep_tp{tp}/profile.json)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=304, help="WikiText-2 test windows (default 304: all at 1024)")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    cache = out.parent / f"{out.name}_nll"
    cache.mkdir(parents=True, exist_ok=True)
    source = resolve_model(args.model)
    L = source.config.num_layers
    profile_path = args.profile or f"results/spd_sweep_tp{args.tp}/profile.json"
    configs = config_plans(args.configs, L, profile_path, source.config.hidden_size)
    ids = source.load_tokenizer()(load_text("wikitext2").text, add_special_tokens=False)["input_ids"]
    windows = make_windows(ids, args.seq_len, args.windows)
    built = choose_runtime("simulated").build(args.model, args.tp, SyncPlan.uniform(L), progress=False)
    base = scores(built, SyncPlan.uniform(L), windows, cache, "dense")
    rows, nlls = [], {"dense": base}
    for name, plan in configs.items():
        nll = scores(built, plan, windows, cache, name)
        nlls[name] = nll
        r, ci = paired_ppl_ratio(nll, base)
        rows.append({"config": name, "plan": plan.summary(), "ratio": r, "ratio_ci": list(ci) if ci else None,
                     "wire_bytes_per_token": plan.wire_bytes(1, source.config.hidden_size, 2),
                     "dense_bf16_bytes_per_token": SyncPlan.uniform(L).wire_bytes(1, source.config.hidden_size, 2)})
        log.info("%-16s ppl x%.4f %s", name, r, ci)
    dense_ppl = float(torch.tensor(base).mean().exp())
    res = {"settings": vars(args) | {"profile": profile_path, "windows_shape": list(windows.shape)},
           "provenance": provenance(), "dense_ppl": dense_ppl, "rows": rows, "window_nll": nlls}
    atomic_write_json(out.with_suffix(".json"), res)
    distilled = built.source.spd is not None
    what = ("each plan with the distilled blocks trained for its form (`syncdrop distill`), the base blocks elsewhere"
            if distilled else "zero-shot (no recovery)")
    lines = [f"{args.model} TP={args.tp}, WikiText-2 test, {windows.shape[0]} windows of {args.seq_len}, {what}; "
             f"dense perplexity {dense_ppl:.3f}. Ratio: perplexity / dense, 95% paired bootstrap "
             "interval over windows. Bytes: what each rank hands the sync points per token, over dense with bf16 "
             "on the wire.", "", "| config | perplexity / dense | 95% CI | bytes vs bf16 dense |",
             "|---|---:|---|---:|"]
    for r in rows:
        ci = f"[{r['ratio_ci'][0]:.4f}, {r['ratio_ci'][1]:.4f}]" if r["ratio_ci"] else "-"
        lines.append(f"| {r['config']} | {r['ratio']:.4f} | {ci} | "
                     f"{r['wire_bytes_per_token'] / r['dense_bf16_bytes_per_token']:.3f} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
