"""The ``syncdrop`` command.

Every user mistake raises :class:`~syncdrop.errors.SyncdropError`; :func:`main` prints it as one
line and exits with code 2 (argparse's own errors also exit 2).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from syncdrop.errors import SyncdropError
from syncdrop.plan import DROP_VARIANTS, PLAN_SPEC_HELP

log = logging.getLogger("syncdrop")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default) | PATH.gguf | transformers directory | hub id")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree N (default 1)")
    p.add_argument("--plan", default="none", help=f"sync plan: {PLAN_SPEC_HELP} (default none)")
    p.add_argument("--drop-variant", default="drop", choices=DROP_VARIANTS,
                   help="what a dropped block does for spec plans: drop = the SPD block (default); "
                        "naive, desync, bias-in-sum = ablations")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def cmd_ppl(args: argparse.Namespace) -> int:
    from syncdrop.eval.data import load_text
    from syncdrop.eval.perplexity import make_windows, perplexity
    from syncdrop.io_utils import atomic_write_json, provenance
    from syncdrop.runtime import build

    if args.batch_size < 1:
        raise SyncdropError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.seq_len < 2:
        raise SyncdropError(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.max_windows is not None and args.max_windows < 1:
        raise SyncdropError(f"--max-windows must be at least 1, got {args.max_windows}")
    data = load_text(args.dataset, args.data_dir)  # fail fast before loading the model
    built = build(args.model, args.tp, args.plan, args.dtype, args.executor, args.drop_variant,
                  progress=not args.quiet)
    tok = built.source.load_tokenizer()
    ids = tok(data.text, add_special_tokens=False)["input_ids"]
    windows = make_windows(ids, args.seq_len, args.max_windows)
    t0 = time.perf_counter()
    res = perplexity(built.model, windows, args.batch_size, progress=not args.quiet)
    elapsed = time.perf_counter() - t0
    print(f"{built.source.name} tp={args.tp} plan={built.plan.summary()} {data.name}: "
          f"ppl {res.ppl:.4f} ({res.tokens} tokens, {res.windows} windows of {res.seq_len}, {elapsed:.1f}s)")
    if args.json:
        atomic_write_json(args.json, {
            "ppl": res.ppl, "nll_mean": res.nll_sum / res.tokens, "tokens": res.tokens, "windows": res.windows,
            "seq_len": res.seq_len, "model": built.source.name, "model_spec": args.model, "tp": args.tp,
            "plan": built.plan.to_dict(), "plan_summary": built.plan.summary(), "executor": args.executor,
            "dtype": args.dtype, "dataset": data.name, "dataset_path": data.path,
            "max_windows": args.max_windows, "elapsed_s": elapsed, "window_nll": res.window_nll,
            "provenance": provenance(),
        })
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel.sharding import ShardLayout
    from syncdrop.plan import parse_plan

    src = resolve_model(args.model)
    cfg = src.config
    layout = ShardLayout.build(cfg, args.tp)
    plan = parse_plan(args.plan, cfg.num_layers, args.drop_variant)
    print(f"model {src.name} ({src.kind}: {src.path})")
    print(f"  {cfg.arch}: {cfg.num_layers} blocks, hidden {cfg.hidden_size}, heads {cfg.num_heads} "
          f"(kv {cfg.num_kv_heads}, dim {cfg.head_dim}), mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}")
    print(f"  TP={args.tp}: " + layout.describe())
    print(f"  plan: {plan.summary()}; all-reduces per forward: {2 * cfg.num_layers - len(plan.dropped)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="syncdrop", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ppl", help="perplexity under a sync plan (simulated tensor parallelism)")
    _add_model_args(p)
    p.add_argument("--dataset", default="auto",
                   help="wikitext2 | wikitext2:valid | shakespeare | auto (default: wikitext2 if present) | PATH")
    p.add_argument("--data-dir", default=None, help="data folder (default $SYNCDROP_DATA or ../shared/data)")
    p.add_argument("--seq-len", type=int, default=1024, help="window length in tokens (default 1024)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first K windows")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--executor", default="simulated", choices=["simulated", "hf"],
                   help="simulated TP (default) or transformers' dense model as a reference")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("info", help="show a model's shape, the TP layout and a plan")
    _add_model_args(p)
    p.set_defaults(func=cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SyncdropError as e:
        print(f"syncdrop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("syncdrop: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
