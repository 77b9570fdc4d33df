"""``syncdrop eval`` (zero-shot accuracy with lm-evaluation-harness on the local data folder, else the
Hugging Face hub when reachable: :func:`syncdrop.eval.tasks.resolve_task_data`) and the
``syncdrop-lm-eval`` console script (lm-eval's own CLI with the ``syncdrop`` model registered).

Wire ``eval`` in :func:`syncdrop.cli.build_parser`::

    from syncdrop.eval.cli import add_eval_parser

    add_eval_parser(sub)

The JSON written by ``--json``: ``results`` (task or group -> metric -> value, lm-eval's metric
names with the ``,none`` filter suffix dropped: ``acc``, ``acc_stderr``, ``acc_norm``, ``perplexity``...,
plus ``n``, the documents scored), ``groups`` (group -> member tasks), ``settings``, ``versions``
(task config versions), ``elapsed_s``, ``memory`` (distributed runtime) and ``provenance``.
``settings.data`` says where the documents came from without a machine-specific path:
``{"source": "data-dir", "files": [paths relative to the data folder]}`` or
``{"source": "datasets", "hub": {task: hub dataset}}``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from syncdrop.errors import SyncdropError

log = logging.getLogger(__name__)

LM_EVAL_BOOTSTRAP_ITERS = 100000  # lm-eval's default (bootstrap stderr of perplexity)


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on ``subparsers`` (from ``add_subparsers``)."""
    from syncdrop.cli_args import add_model_args
    from syncdrop.eval.tasks import DEFAULT_TASKS

    p = subparsers.add_parser(
        "eval", help="zero-shot accuracy (lm-evaluation-harness, official prompts) on the local data folder",
        description="Zero-shot evaluation through lm-evaluation-harness with lm-eval's official task configs "
                    "(prompts, metrics, group aggregation), reading the local data folder instead of the hub. "
                    "With --launch / torchrun every rank runs the same requests (tensor parallelism); rank 0 "
                    "prints and writes the results.")
    add_model_args(p)
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"comma-separated tasks (default {','.join(DEFAULT_TASKS)}); also mmlu_stem, "
                        "mmlu_humanities, mmlu_social_sciences, mmlu_other, mmlu_<subject>, ai2_arc")
    p.add_argument("--limit", type=int, default=None, help="score only the first K documents of each task")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest input in tokens, longer ones are cut from the left (default: the model's positions)")
    p.add_argument("--data-dir", default=None,
                   help="data folder (default $SYNCDROP_DATA or ../shared/data; without --data-dir, tasks missing "
                        "there are downloaded with datasets when the Hugging Face hub is reachable)")
    p.add_argument("--bootstrap-iters", type=int, default=LM_EVAL_BOOTSTRAP_ITERS,
                   help=f"bootstrap resamples for stderrs without a closed form, e.g. perplexity "
                        f"(default {LM_EVAL_BOOTSTRAP_ITERS}, lm-eval's; 0 = no stderrs at all)")
    p.add_argument("--json", default=None, help="write results, settings and provenance as JSON to this path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval)
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    from syncdrop.eval import tasks as local_tasks

    if args.limit is not None and args.limit < 1:
        raise SyncdropError(f"--limit must be at least 1, got {args.limit}")
    if args.batch_size < 1:
        raise SyncdropError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 2:
        raise SyncdropError(f"--max-length must be at least 2, got {args.max_length}")
    if args.bootstrap_iters < 0:
        raise SyncdropError(f"--bootstrap-iters must be >= 0, got {args.bootstrap_iters}")
    names = local_tasks.parse_tasks(args.tasks)
    data = local_tasks.resolve_task_data(names, args.data_dir)  # fail fast, before loading the model
    from syncdrop.cli_args import build_from_args
    from syncdrop.eval.harness import SyncdropLM

    built = build_from_args(args, progress=not args.quiet)
    lm = SyncdropLM(built=built, batch_size=args.batch_size, max_length=args.max_length, progress=not args.quiet)
    t0 = time.perf_counter()
    raw = evaluate(lm, names, data, args.limit, args.bootstrap_iters if built.is_main else 0, quiet=args.quiet)
    elapsed = time.perf_counter() - t0
    memory = built.memory()
    if not built.is_main or raw is None:
        return 0
    from lm_eval.utils import make_table

    runtime = built.runtime.executor
    print(f"{built.source.name} tp={args.tp} ({runtime}) plan={built.plan.summary()}, zero-shot, "
          f"limit {args.limit}, {lm.forwards} forwards, {elapsed:.1f}s")
    print(make_table(raw))
    if raw.get("groups"):
        print(make_table(raw, "groups"))
    if args.json:
        from syncdrop.io_utils import atomic_write_json

        atomic_write_json(args.json, report(raw, built, args, data, elapsed, lm, names, memory))
    return 0


def evaluate(lm: Any, names: list[str], data_dir: Any, limit: int | None, bootstrap_iters: int,
             quiet: bool = False, log_samples: bool = False) -> dict[str, Any] | None:
    """lm-eval's ``simple_evaluate`` on the local tasks ``names`` (zero-shot) reading ``data_dir`` (a
    folder, or a :class:`~syncdrop.eval.tasks.TaskData`); its raw result dict on the main process,
    None elsewhere. ``log_samples``: keep per-document results under
    ``samples`` (task -> list of ``{"doc_id", "acc", ...}``)."""
    import datasets
    from lm_eval import simple_evaluate

    from syncdrop.eval.tasks import task_manager

    if quiet:
        datasets.disable_progress_bar()
    res = simple_evaluate(model=lm, tasks=names, limit=limit, bootstrap_iters=bootstrap_iters,
                          task_manager=task_manager(data_dir), log_samples=log_samples)
    return res if lm.is_main else None


def clean_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``{"acc,none": x, "acc_stderr,none": s, "alias": ...}`` -> ``{"acc": x, "acc_stderr": s}``
    (stderr ``"N/A"`` -> None)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if key in ("alias", "name", "sample_len", "sample_count", "samples"):
            continue
        metric, _, filt = key.partition(",")
        name = metric if filt in ("", "none") else key
        out[name] = None if value == "N/A" else value
    return out


def report(raw: dict[str, Any], built: Any, args: argparse.Namespace, data: Any, elapsed: float,
           lm: Any, names: list[str] | None = None, memory: dict[str, Any] | None = None) -> dict[str, Any]:
    import lm_eval

    from syncdrop.eval.tasks import TaskData, data_record
    from syncdrop.io_utils import provenance

    if not isinstance(data, TaskData):  # a folder, as before
        data = TaskData("data-dir", data)
    names = names if names is not None else [t.strip() for t in args.tasks.split(",") if t.strip()]

    n = {t: v.get("effective") for t, v in raw.get("n-samples", {}).items()}
    results = {}
    for section in ("results", "groups"):
        for task, metrics in raw.get(section, {}).items():
            results[task] = {**clean_metrics(metrics), **({"n": n[task]} if task in n else {})}
    runtime = built.runtime.executor
    settings = {
        "model": built.source.name, "model_spec": args.model, "tp": args.tp, "plan": built.plan.to_dict(),
        "plan_summary": built.plan.summary(), "executor": runtime, "dtype": args.dtype,
        "device": str(built.runtime.device), "backend": built.runtime.backend,
        "tasks": args.tasks.split(","), "limit": args.limit, "num_fewshot": 0, "batch_size": args.batch_size,
        "max_length": lm.max_length, "data": data_record(names, data, raw.get("configs")),
        "bootstrap_iters": args.bootstrap_iters,
        "lm_eval": lm_eval.__version__, "forwards": lm.forwards,
    }
    return {"results": results, "groups": raw.get("group_subtasks", {}), "settings": settings,
            "versions": raw.get("versions", {}), "elapsed_s": elapsed, "memory": memory,
            "provenance": provenance()}


def lm_eval_main() -> None:
    """Console script ``syncdrop-lm-eval``: lm-eval's CLI (same arguments) with ``--model syncdrop``
    registered. ``--local-tasks`` adds ``--include_path`` for the local task configs (they then take
    precedence over lm-eval's hub-backed built-ins of the same names)."""
    import syncdrop.eval.harness  # noqa: F401  (registers the model)
    from syncdrop.eval.tasks import CONFIG_DIR

    if "--local-tasks" in sys.argv:
        sys.argv = [a for a in sys.argv if a != "--local-tasks"] + ["--include_path", str(CONFIG_DIR)]
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except SyncdropError as e:
        print(f"syncdrop-lm-eval: error: {e}", file=sys.stderr)
        sys.exit(2)
