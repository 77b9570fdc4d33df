"""Zero-shot accuracy of compressed sync plans against dense, paired per document.

The zero-shot side of ``benchmarks/compressed_ppl.py``: the same configurations (``int8``, ``fp8``,
``spd:0.5+int8``...; :func:`syncdrop.spd.planning.config_plan`), each scored by lm-eval (0-shot, the first
``--limit`` documents of every task) through syncdrop's adapter in the simulated executor, on the same
documents as dense. The accuracy drop is in points of the average over tasks, with its paired percentile
bootstrap interval over documents, stratified by task (:func:`syncdrop.bench.stats.paired_accuracy_drop`);
each task's own drop is shown too.

``--model`` may be a ``syncdrop distill`` directory: each plan then runs the distilled blocks trained for its
form (:func:`syncdrop.runtime.for_plan`) and dense is the base model, as in ``compressed_ppl.py``.

Each configuration's per-document accuracies are cached in ``OUT_docs/<key>.json`` (keyed by model, the blocks
that run, tasks and limit), so a stopped run resumes and a new configuration costs only itself. Writes
``OUT.json`` (settings, provenance, per task and config: accuracy and its drop with interval) and ``OUT.md``::

    python benchmarks/compressed_zero_shot.py --tp 3 --configs int8,fp8 --limit 500 \\
        --out results/compressed_zero_shot/tp3_500
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from syncdrop.bench.stats import paired_accuracy_drop
from syncdrop.eval.cli import LM_EVAL_BOOTSTRAP_ITERS, evaluate
from syncdrop.eval.harness import SyncdropLM
from syncdrop.eval.tasks import SIMPLE_TASKS, parse_tasks, resolve_task_data
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.runtime import choose_runtime, for_plan
from syncdrop.spd.planning import config_plans

log = logging.getLogger("compressed_zero_shot")

DEFAULT_TASKS = ",".join(SIMPLE_TASKS)


def doc_accuracies(model: str, tp: int, plan: SyncPlan, names: list[str], data: Any, limit: int, cache: Path,
                   what: str) -> dict[str, list[float]]:
    """Task -> each document's accuracy (0/1, in document order) of ``plan`` on ``model``, cached in ``cache``."""
    built = choose_runtime("simulated").build(model, tp, plan, progress=False)
    src = for_plan(built.source, plan, warn=False)
    blocks = sorted(src.spd.blocks) if src.spd is not None and src.spd.blocks else []
    # the model that runs: a distill directory's own blocks when any run under this plan, else its base model
    base = built.source.spd.base_model if built.source.spd is not None else built.source.spec
    ident = {"plan": plan.to_dict()["blocks"], "model": built.source.spec if blocks else base, "blocks": blocks,
             "tasks": names, "limit": limit}
    path = cache / f"{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())["doc_acc"]
    t0 = time.perf_counter()
    raw = evaluate(SyncdropLM(built=built, progress=True), names, data, limit, LM_EVAL_BOOTSTRAP_ITERS,
                   quiet=True, log_samples=True)
    acc = {t: [float(d["acc"]) for d in sorted(raw["samples"][t], key=lambda d: d["doc_id"])] for t in names}
    seconds = time.perf_counter() - t0
    log.info("%s: %s (%.0f s)", what, ", ".join(f"{t} {sum(a) / len(a):.3f}" for t, a in acc.items()), seconds)
    atomic_write_json(path, {"ident": ident, "config": what, "seconds": seconds, "doc_acc": acc})
    return acc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--configs", default="int8,fp8", help="comma-separated, as compressed_ppl.py (default int8,fp8)")
    ap.add_argument("--profile", default=None, help="the SPD order (default results/spd_sweep_tp{tp}/profile.json)")
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help=f"lm-eval tasks (default {DEFAULT_TASKS})")
    ap.add_argument("--limit", type=int, default=500, help="first N documents of each task (default 500)")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    cache = out.parent / f"{out.name}_docs"
    cache.mkdir(parents=True, exist_ok=True)
    cfg = resolve_model(args.model).config
    L = cfg.num_layers
    profile_path = args.profile or f"results/spd_sweep_tp{args.tp}/profile.json"
    configs = config_plans(args.configs, L, profile_path, cfg.hidden_size)
    names = parse_tasks(args.tasks)
    data = resolve_task_data(names, None)
    dense = doc_accuracies(args.model, args.tp, SyncPlan.uniform(L), names, data, args.limit, cache, "dense")
    acc = {"dense": dense}
    rows = []
    for name, plan in configs.items():
        acc[name] = a = doc_accuracies(args.model, args.tp, plan, names, data, args.limit, cache, name)
        drop, ci = paired_accuracy_drop(dense, a)
        per_task = {t: paired_accuracy_drop({t: dense[t]}, {t: a[t]}) for t in names}
        rows.append({"config": name, "plan": plan.summary(), "acc_drop_points": drop,
                     "acc_drop_ci": list(ci) if ci else None,
                     "task_drop_points": {t: [d, list(c) if c else None] for t, (d, c) in per_task.items()}})
        log.info("%-16s drop %+.2f points %s", name, drop, ci)
    mean = {k: {t: sum(v) / len(v) for t, v in a.items()} for k, a in acc.items()}
    res = {"settings": vars(args) | {"profile": profile_path, "data": data.source},
           "provenance": provenance(), "documents": {t: len(dense[t]) for t in names}, "accuracy": mean,
           "rows": rows, "doc_acc": acc}
    atomic_write_json(out.with_suffix(".json"), res)
    lines = [f"{args.model} TP={args.tp}, lm-eval 0-shot, first {args.limit} documents per task "
             f"({sum(len(v) for v in dense.values())} in all), simulated executor. Accuracy (`acc`) per task; "
             "drop: points of the average over tasks lost to dense, with its 95% paired bootstrap interval over "
             "documents (stratified by task).", "",
             "| config | " + " | ".join(names) + " | avg | drop vs dense [95% CI] |",
             "|---|" + "---:|" * (len(names) + 2)]
    for key in acc:
        m = mean[key]
        row = next((r for r in rows if r["config"] == key), None)
        drop = "" if row is None else (f"{row['acc_drop_points']:+.2f}" + (
            f" [{row['acc_drop_ci'][0]:+.2f}, {row['acc_drop_ci'][1]:+.2f}]" if row["acc_drop_ci"] else ""))
        lines.append(f"| {key} | " + " | ".join(f"{m[t]:.3f}" for t in names)
                     + f" | {sum(m.values()) / len(m):.3f} | {drop} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
