"""Zero-shot accuracy of SPD plans through lm-evaluation-harness (issue 5, item 3).

For one model and TP degree: the dense model, and for each SPD fraction the zero-shot plan and the
HG+B2B-distilled model (the best variant of the SPD sweep, results/spd_sweep_tp3), each scored by
lm-eval (0-shot) on the local tasks through syncdrop's adapter in the simulated executor.

Steps, each cached under ``--out`` and reused when rerun with the same settings:

1. drop order: the progressive sensitivity of ``--profile`` (the sweep's profile), so fraction f
   drops the same ``round(f * L)`` blocks as the perplexity sweep;
2. bank: every block distilled once (HG+B2B, best epoch) into ``OUT/bank`` (``syncdrop distill``
   directory for plan ``all``); each fraction's model ``OUT/models/spdNNN`` points at the bank's
   blocks for its plan (:func:`syncdrop.spd.checkpoint.write_subset`);
3. evaluation: one ``OUT/runs/<config>.json`` per configuration with lm-eval's metrics and each
   document's accuracy (for paired differences against dense).

Writes ``OUT/zero_shot.json`` (command, commit, settings, per config and task: acc, acc_norm,
stderr, n; averages; paired differences against dense with their standard error) and
``OUT/zero_shot.md``. The committed results were made with::

    OMP_NUM_THREADS=1 python experiments/zero_shot_spd.py --tp 3 --limit 100 --mmlu-limit 5 \\
        --out results/zero_shot_spd
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from syncdrop.eval.cli import clean_metrics, evaluate
from syncdrop.eval.data import load_text
from syncdrop.eval.perplexity import text_windows
from syncdrop.eval.tasks import SIMPLE_TASKS, check_data, parse_tasks
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.spd.checkpoint import write_subset
from syncdrop.spd.distill import DistillSettings, base_spec, distill
from syncdrop.spd.planning import drop_order, load_profile

log = logging.getLogger("zero_shot_spd")
PAPER = ("SPD paper (Kim et al., ICML 2025, arXiv:2502.20727): LLaMA2-70B on 8 GPUs, 70% SPD, all zero-shot: "
         "0.94% average zero-shot accuracy loss on ARC, HellaSwag, LAMBADA, PIQA, SciQ, WinoGrande.")
PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "lambada_openai", "piqa", "sciq", "winogrande")


def _eval_task(lm: Any, task: str, limit: int, data_root: Any) -> dict[str, Any]:
    """lm-eval metrics and per-document accuracy of one task (``mmlu``: the group, ``limit`` per subject)."""
    raw = evaluate(lm, [task], data_root, limit, bootstrap_iters=100, quiet=True, log_samples=True)
    assert raw is not None  # one process: always the main one
    out: dict[str, Any] = {}
    for section in ("results", "groups"):
        for name, metrics in raw.get(section, {}).items():
            if name == task or (section == "results" and not name.startswith("mmlu_")):
                out = {**clean_metrics(metrics), "limit": limit}
    docs = {f"{name}/{smp['doc_id']}": float(smp["acc"]) for name, samples in raw["samples"].items()
            for smp in samples}
    out.update(doc_acc=docs, n=len(docs))
    return out


def _eval_config(name: str, spec: str, tp: int, plan: str | None, tasks: list[str], limit: int, mmlu_limit: int,
                 data_root: Any, batch_size: int, out: Path, key: dict[str, Any]) -> dict[str, Any]:
    """One configuration, resumable per task: ``out/runs/<name>/<task>.json`` holds each finished task
    (reused when its key matches); the model is built only when a task is missing."""
    import time

    from syncdrop.eval.harness import SyncdropLM
    from syncdrop.runtime import build

    res: dict[str, Any] = {"tasks": {}, "seconds": {}}
    lm = None
    for task in tasks:
        lim = mmlu_limit if task == "mmlu" else limit
        path = out / "runs" / name / f"{task}.json"
        tkey = {**key, "task": task, "limit": lim}
        if (d := _stored_task(path)).get("key") == tkey:
            _take_stored(res, task, d)
            continue
        if lm is None:
            built = build(spec, tp, plan, executor="simulated", progress=False)
            lm = SyncdropLM(built=built, batch_size=batch_size, progress=True)
            res.update(plan=built.plan.to_dict(), plan_summary=built.plan.summary())
        log.info("evaluating %s on %s (limit %d)", name, task, lim)
        t0 = time.perf_counter()
        m = _eval_task(lm, task, lim, data_root)
        secs = time.perf_counter() - t0
        log.info("%s %s: acc %.4f (n=%d, %.0f s)", name, task, m["acc"], m["n"], secs)
        atomic_write_json(path, {"key": tkey, "metrics": m, "seconds": secs, "plan": res["plan"],
                                 "plan_summary": res["plan_summary"], "provenance": provenance()})
        res["tasks"][task], res["seconds"][task] = m, secs
    return res


def _kept_config(name: str, spec: str, tasks: list[str], limit: int, mmlu_limit: int,
                 out: Path) -> dict[str, Any] | None:
    """A ``--model-dirs`` configuration whose directory is gone (a fresh clone: model directories are not
    committed) but whose per-task files are: ``out/runs/<name>/<task>.json`` for every task, each scored from
    ``spec`` at this limit. Returns :func:`_eval_config`'s result from those files, or None when any is missing
    or was scored from another directory or limit (its manifest cannot be checked: the directory is gone)."""
    res: dict[str, Any] = {"tasks": {}, "seconds": {}}
    for task in tasks:
        lim = mmlu_limit if task == "mmlu" else limit
        d = _stored_task(out / "runs" / name / f"{task}.json")
        k = d.get("key", {})
        if (k.get("spec"), k.get("task"), k.get("limit")) != (spec, task, lim):
            return None
        _take_stored(res, task, d)
    return res


def _stored_task(path: Path) -> dict[str, Any]:
    """One finished task's file (``{key, metrics, seconds, plan, plan_summary, provenance}``), or {}."""
    return json.loads(path.read_text()) if path.exists() else {}


def _take_stored(res: dict[str, Any], task: str, d: dict[str, Any]) -> None:
    """Put a stored task's metrics, time and plan into a configuration's result."""
    res["tasks"][task], res["seconds"][task] = d["metrics"], d["seconds"]
    res.update(plan=d["plan"], plan_summary=d["plan_summary"])


def _paired(dense: dict[str, float], other: dict[str, float]) -> tuple[float, float]:
    """Mean per-document accuracy difference (other - dense) and its standard error (the 95% interval
    is the mean +- 1.96 standard errors: a normal approximation, good at hundreds of documents)."""
    keys = sorted(dense)
    d = [other[k] - dense[k] for k in keys]
    m = sum(d) / len(d)
    var = sum((x - m) ** 2 for x in d) / max(1, len(d) - 1)
    return m, math.sqrt(var / len(d))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--profile", default="results/spd_sweep_tp3/profile.json")
    ap.add_argument("--fractions", default="0.5,0.7,1.0",
                    help="SPD fractions evaluated zero-shot and with the HG+B2B bank (empty: none)")
    ap.add_argument("--variants", default="zs,hg+b2b",
                    help="what runs at each of --fractions: zs (the plan's blocks zero-shot), hg+b2b (the HG+B2B "
                         "bank's blocks; trains the bank), or both (default)")
    ap.add_argument("--model-dirs", default="",
                    help="further configurations NAME=DIR,...: `syncdrop distill` directories run under their own "
                         "plan (e.g. the best recovery at 50%% and 70%%); NAME labels the row")
    ap.add_argument("--tasks", default=",".join((*SIMPLE_TASKS, "mmlu")))
    ap.add_argument("--limit", type=int, default=100, help="first K documents of each task (default 100)")
    ap.add_argument("--mmlu-limit", type=int, default=5, help="first K questions of each MMLU subject (default 5)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-heldout", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    tasks = parse_tasks(args.tasks)
    data_root = check_data(tasks, None)
    fractions = [float(f) for f in args.fractions.split(",") if f]
    extra: dict[str, str] = {}
    kept: dict[str, dict[str, Any]] = {}  # --model-dirs whose directory is gone, from their committed files
    for item in filter(None, args.model_dirs.split(",")):
        name, sep, d = item.partition("=")
        bad = f"--model-dirs: expected NAME=DIR with DIR a `syncdrop distill` directory, got {item!r}"
        if not sep or not name:
            raise SystemExit(bad)
        if not (Path(d) / "syncdrop.json").is_file():
            if (r := _kept_config(name, d, tasks, args.limit, args.mmlu_limit, out)) is None:
                raise SystemExit(f"{bad} (and no scored results of it under {out / 'runs' / name})")
            log.info("%s: kept the per-task results of %s (its directory is gone; not rescored)", name, d)
            kept[name] = r
        extra[name] = d
    source = resolve_model(args.model)
    cfg = source.config
    L = cfg.num_layers
    profile = load_profile(args.profile, L)
    order = drop_order(profile.sensitivity("progressive"))

    # bank: every block distilled once with HG+B2B (group units, shard matching), best epoch
    calib = load_text("wikitext2:valid")
    cw = text_windows(source.load_tokenizer(), calib.text, args.seq_len, args.calib_samples + args.calib_heldout,
                      "wikitext2:valid")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - {"zs", "hg+b2b"}:
        raise SystemExit(f"--variants {args.variants!r}: expected zs, hg+b2b or both, comma-separated")
    bank = out / "bank"
    if fractions and "hg+b2b" in variants:
        distill(source, args.tp, SyncPlan.uniform(L, "drop"), dict.fromkeys(range(L), "hg+b2b"),
                cw[: args.calib_samples], cw[args.calib_samples:], bank,
                DistillSettings(args.lr, args.epochs, 1, 0.0, 0, "group", "shard", keep_best=True),
                {"dataset": calib.name, "path": calib.path, "seq_len": args.seq_len})

    configs: dict[str, tuple[str, str | None, float, str]] = {"dense": (args.model, "none", 0.0, "dense")}
    for f in fractions:
        plan = SyncPlan.dropping(L, sorted(order[: round(f * L)]))
        tag = f"spd{round(f * 100):03d}"
        plan_path = out / "plans" / f"{tag}.json"
        plan.save(plan_path)
        if "zs" in variants:
            configs[f"{tag}_zs"] = (args.model, str(plan_path), f, "zero-shot")
        if "hg+b2b" in variants:
            write_subset(out / "models" / tag, bank, plan, base_spec(args.model), args.tp)
            configs[f"{tag}_hg+b2b"] = (str(out / "models" / tag), None, f, "hg+b2b")
    for name, d in extra.items():
        plan_dropped = (SyncPlan.from_dict(kept[name]["plan"], L).dropped if name in kept
                        else resolve_model(d).spd.plan.dropped)
        configs[name] = (d, None, len(plan_dropped) / L, name)

    settings = {"model": source.name, "tp": args.tp, "tasks": tasks, "limit": args.limit,
                "mmlu_limit": args.mmlu_limit, "num_fewshot": 0, "executor": "simulated", "dtype": "float32",
                "batch_size": args.batch_size, "profile": args.profile, "drop_order": order,
                "distill": {"tier": "hg+b2b", "hg_unit": "group", "hg_mlp": "shard", "keep_best": True,
                            "lr": args.lr, "epochs": args.epochs, "calib_windows": args.calib_samples,
                            "heldout_windows": args.calib_heldout, "seq_len": args.seq_len}}
    settings["model_dirs"] = extra
    runs: dict[str, dict[str, Any]] = {}
    for name, (spec, plan_arg, f, variant) in configs.items():
        # what this configuration's numbers depend on (dense: not the drop order or the bank's settings)
        key = {k: settings[k] for k in ("model", "tp", "num_fewshot", "executor", "dtype", "batch_size")}
        key.update(config=name, spec=spec, plan_arg=plan_arg)
        if name in kept:
            r = kept[name]
        else:
            if name in extra:
                key["manifest_sha256"] = hashlib.sha256((Path(spec) / "syncdrop.json").read_bytes()).hexdigest()
            elif name != "dense":
                key.update(drop_order=order, distill=settings["distill"])
            r = _eval_config(name, spec, args.tp, plan_arg, tasks, args.limit, args.mmlu_limit, data_root,
                             args.batch_size, out, key)
        label = "dense" if name == "dense" else (f"{name} (SPD {f:.0%}, {Path(spec).name})" if name in extra
                                                 else f"SPD {f:.0%} {variant}")
        runs[name] = {"fraction": f, "variant": variant, "label": label, "spec": spec, **r}
    summary = _summarise(runs, tasks)
    atomic_write_json(out / "zero_shot.json", {"settings": settings, "provenance": provenance(), "paper": PAPER,
                                               "summary": summary,
                                               "runs": {n: {k: v for k, v in r.items() if k != "tasks"} | {
                                                   "tasks": {t: {k: v for k, v in m.items() if k != "doc_acc"}
                                                             for t, m in r["tasks"].items()}}
                                                   for n, r in runs.items()}})
    md = _markdown(summary, tasks, settings)
    atomic_write_text(out / "zero_shot.md", md)
    print(md)
    return 0


def _summarise(runs: dict[str, dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    dense = runs["dense"]["tasks"]
    rows = {}
    for name, r in runs.items():
        accs = {t: r["tasks"][t]["acc"] for t in tasks}
        deltas = {t: _paired(dense[t]["doc_acc"], r["tasks"][t]["doc_acc"]) for t in tasks}
        avg_d, avg_se = _avg_delta([deltas[t] for t in tasks])
        pt = [t for t in tasks if t in PAPER_TASKS]
        p_d, p_se = _avg_delta([deltas[t] for t in pt])
        p_avg = sum(accs[t] for t in pt) / len(pt) if pt else math.nan
        p_dense = sum(dense[t]["acc"] for t in pt) / len(pt) if pt else math.nan
        rows[name] = {"fraction": r["fraction"], "variant": r["variant"], "label": r["label"],
                      "plan": r["plan_summary"], "acc": accs,
                      "acc_norm": {t: r["tasks"][t].get("acc_norm") for t in tasks},
                      "n": {t: r["tasks"][t]["n"] for t in tasks},
                      "avg_acc": sum(accs.values()) / len(tasks),
                      "paired_delta_vs_dense": {t: {"delta": d, "stderr": se} for t, (d, se) in deltas.items()},
                      "avg_delta_vs_dense": avg_d, "avg_delta_stderr": avg_se,
                      "paper_tasks": pt, "paper_avg_acc": p_avg, "paper_avg_delta_vs_dense": p_d,
                      "paper_avg_delta_stderr": p_se, "paper_avg_relative_change": p_avg / p_dense - 1}
    return rows


def _avg_delta(deltas: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean of per-task paired differences and its standard error (tasks independent)."""
    if not deltas:
        return math.nan, math.nan
    return (sum(d for d, _ in deltas) / len(deltas), math.sqrt(sum(se * se for _, se in deltas)) / len(deltas))


def _markdown(summary: dict[str, Any], tasks: list[str], settings: dict[str, Any]) -> str:
    short = {"arc_easy": "ARC-e", "arc_challenge": "ARC-c", "hellaswag": "HS", "lambada_openai": "LAMBADA",
             "piqa": "PIQA", "sciq": "SciQ", "winogrande": "WG", "mmlu": "MMLU"}
    n = summary["dense"]["n"]
    lines = [f"Zero-shot accuracy (`acc`), {settings['model']} TP={settings['tp']} simulated, lm-eval 0-shot on the "
             f"local tasks: first {settings['limit']} documents per task, MMLU first {settings['mmlu_limit']} per "
             f"subject ({n.get('mmlu', 0)} questions). Δ avg: mean paired per-document difference from dense, "
             "averaged over tasks, with its 95% interval (± 1.96 standard errors). "
             "*paper avg*: the paper's six benchmarks (ARC-e and ARC-c, "
             "HellaSwag, LAMBADA, PIQA, SciQ, WinoGrande; no MMLU), with its change relative to dense.", "",
             "| config | " + " | ".join(short.get(t, t) for t in tasks) + " | avg | Δ avg vs dense | paper avg | "
             "Δ paper avg (relative) |",
             "|---|" + "---:|" * (len(tasks) + 4)]
    for name, r in summary.items():
        cells = " | ".join(f"{r['acc'][t]:.3f}" for t in tasks)
        d, se = r["avg_delta_vs_dense"], r["avg_delta_stderr"]
        delta = "" if name == "dense" else f"{d:+.3f} [{d - 1.96 * se:+.3f}, {d + 1.96 * se:+.3f}]"
        pdelta = "" if name == "dense" else (f"{r['paper_avg_delta_vs_dense']:+.3f} ± {r['paper_avg_delta_stderr']:.3f}"
                                             f" ({r['paper_avg_relative_change']:+.1%})")
        lines.append(f"| {r['label']} | {cells} | {r['avg_acc']:.3f} | {delta} | {r['paper_avg_acc']:.3f} | {pdelta} |")
    others = [r for name, r in summary.items() if name != "dense"]
    if others:
        lines += ["", "Per task: paired per-document accuracy difference from dense (points), with its 95% interval.",
                  "", "| config | " + " | ".join(short.get(t, t) for t in tasks) + " |",
                  "|---|" + "---:|" * len(tasks)]
        for r in others:
            cells = []
            for t in tasks:
                pd = r["paired_delta_vs_dense"][t]
                d, se = pd["delta"] * 100, pd["stderr"] * 100
                cells.append(f"{d:+.1f} [{d - 1.96 * se:+.1f}, {d + 1.96 * se:+.1f}]")
            lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    lines += ["", PAPER]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
