"""Zero-shot accuracy parity: syncdrop's lm-eval model (dense, plan none, TP=1 and TP=3 simulated)
against lm-eval's own ``hf`` model (HFLM over transformers' LlamaForCausalLM loaded from the same
GGUF), on the same local tasks, documents and prompts.

Each run goes through ``lm_eval.simple_evaluate`` (zero-shot) with the local task configs
(:mod:`syncdrop.eval.tasks`) and logs every request's response, so besides the task metrics the
comparison reports the largest per-request log-likelihood difference and the documents whose
prediction differs. Writes ``OUT/parity.json`` (command, commit, settings, per-run metrics, the
comparison, ``all_accuracies_identical``) and ``OUT/parity.md``. Example (the full check):

    OMP_NUM_THREADS=2 python experiments/lm_eval_parity.py --limit 50 --out results/lm_eval_parity
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from syncdrop.eval.cli import clean_metrics
from syncdrop.eval.tasks import DEFAULT_TASKS, check_data, parse_tasks, task_manager
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

ACC_METRICS = ("acc", "acc_norm")


def hf_lm(source: Any, batch_size: int) -> Any:
    """lm-eval's HFLM over transformers' own model of ``source`` (GGUF or checkpoint directory)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"dtype": torch.float32}
    path = source.path
    if source.kind == "gguf":
        kw["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, **kw).eval()
    tokenizer = dataclasses.replace(source).load_tokenizer()  # a fresh instance (HFLM may set its pad token)
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)


def syncdrop_lm(model: str, tp: int, batch_size: int) -> Any:
    from syncdrop.eval.harness import SyncdropLM
    from syncdrop.runtime import build

    return SyncdropLM(built=build(model, tp, "none", executor="simulated", progress=False), batch_size=batch_size)


def run(lm: Any, names: list[str], root: Path, limit: int, bootstrap_iters: int) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    t0 = time.perf_counter()
    raw = simple_evaluate(model=lm, tasks=names, limit=limit, bootstrap_iters=bootstrap_iters,
                          task_manager=task_manager(root), log_samples=True)
    elapsed = time.perf_counter() - t0
    metrics = {t: clean_metrics(m) for sec in ("results", "groups") for t, m in raw.get(sec, {}).items()}
    responses = {t: {s["doc_id"]: [_flat(r) for r in s["resps"]] for s in samples}
                 for t, samples in raw["samples"].items()}
    return {"metrics": metrics, "n": {t: v["effective"] for t, v in raw["n-samples"].items()},
            "elapsed_s": elapsed, "responses": responses}


def _flat(resp: list[Any]) -> float:
    """A logged response (``[(loglik, is_greedy)]`` or ``[loglik]``) -> its log-likelihood."""
    r = resp[0]
    return float(r[0] if isinstance(r, (tuple, list)) else r)


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for task, m in ref["metrics"].items():
        o = other["metrics"][task]
        accs = {k: (m[k], o.get(k)) for k in ACC_METRICS if k in m}
        row: dict[str, Any] = {"accuracies_identical": all(a == b for a, b in accs.values()),
                               "accuracies": {k: {"hf": a, "syncdrop": b} for k, (a, b) in accs.items()}}
        if task in ref["responses"]:
            diffs, changed = [], 0
            for doc, lls in ref["responses"][task].items():
                mine = other["responses"][task][doc]
                diffs += [abs(a - b) for a, b in zip(lls, mine, strict=True)]
                changed += len(lls) > 1 and _argmax(lls) != _argmax(mine)
            row["max_abs_loglik_diff"] = max(diffs) if diffs else 0.0
            row["docs_with_different_argmax"] = changed
        out[task] = row
    return out


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


def markdown(runs: dict[str, dict[str, Any]], comparison: dict[str, dict[str, Any]]) -> str:
    names = list(runs)
    lines = ["| task | metric | " + " | ".join(names) + " | identical | max abs Δ loglik |",
             "|---|---|" + "---:|" * len(names) + "---|---|"]
    for task in runs["hf"]["metrics"]:
        for metric, value in runs["hf"]["metrics"][task].items():
            if metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            vals = [runs[n]["metrics"][task].get(metric) for n in names]
            cells = " | ".join(f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else str(v) for v in vals)
            same = ("yes" if all(v == vals[0] for v in vals) else "**no**") if metric in ACC_METRICS else ""
            delta = ", ".join(f"{k}: {c[task]['max_abs_loglik_diff']:.2e}" for k, c in comparison.items()
                              if "max_abs_loglik_diff" in c[task])
            lines.append(f"| {task} | {metric} | {cells} | {same} | {delta} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    ap.add_argument("--limit", type=int, default=50, help="first K documents of each task (default 50)")
    ap.add_argument("--tp", default="1,3", help="TP degrees of the syncdrop runs (default 1,3)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bootstrap-iters", type=int, default=1000,
                    help="bootstrap resamples for the perplexity stderr (default 1000; lm-eval's is 100000)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True, help="output folder (parity.json and parity.md)")
    args = ap.parse_args()
    from syncdrop.models.loading import resolve_model

    names = parse_tasks(args.tasks)
    root = check_data(names, args.data_dir)
    source = resolve_model(args.model)
    tps = [int(t) for t in args.tp.split(",")]
    runs: dict[str, dict[str, Any]] = {}
    makers = {"hf": lambda: hf_lm(source, args.batch_size)}
    makers |= {f"syncdrop_tp{n}": (lambda n=n: syncdrop_lm(args.model, n, args.batch_size)) for n in tps}
    out = Path(args.out)
    key = {"model": args.model, "tasks": names, "limit": args.limit, "batch_size": args.batch_size,
           "bootstrap_iters": args.bootstrap_iters, "data_dir": str(root)}
    for name, make in makers.items():
        cache = out / f"run_{name}.json"  # each finished run is kept, so an interrupted check resumes
        if cache.exists() and (c := json.loads(cache.read_text())).get("key") == key:
            runs[name] = c["run"]
            print(f"== {name}: reused {cache}", flush=True)
            continue
        print(f"== {name}", flush=True)
        lm = make()
        runs[name] = run(lm, names, root, args.limit, args.bootstrap_iters)
        runs[name]["responses"] = {t: {str(k): v for k, v in r.items()} for t, r in runs[name]["responses"].items()}
        atomic_write_json(cache, {"key": key, "run": runs[name]})
        del lm
        gc.collect()
        print(f"   {runs[name]['elapsed_s']:.1f}s", flush=True)
    comparison = {n: compare(runs["hf"], runs[n]) for n in runs if n != "hf"}
    identical = all(row["accuracies_identical"] for c in comparison.values() for row in c.values())
    settings = {"model": source.name, "model_spec": args.model, "tasks": names, "limit": args.limit,
                "num_fewshot": 0, "syncdrop_tp": tps, "plan": "none", "executor": "simulated",
                "dtype": "float32", "batch_size": args.batch_size, "bootstrap_iters": args.bootstrap_iters,
                "data_dir": str(root), "threads": torch.get_num_threads()}
    table = markdown(runs, comparison)
    prov = provenance()
    result = {"command": prov["command"], "commit": prov["commit"], "settings": settings,
              "runs": {n: {k: v for k, v in r.items() if k != "responses"} for n, r in runs.items()},
              "comparison": comparison, "all_accuracies_identical": identical, "provenance": prov}
    atomic_write_json(out / "parity.json", result)
    header = (f"lm-eval parity: {source.name}, zero-shot, first {args.limit} docs per task; lm-eval `hf` vs "
              f"syncdrop (plan none, TP {', '.join(map(str, tps))}). All accuracies identical: {identical}.\n\n")
    atomic_write_text(out / "parity.md", header + table)
    print(header + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
