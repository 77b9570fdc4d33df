"""Command line of the GPU check (``python3 benchmarks/gpu_check --help``).

Exit codes: 0 when every check passes or is skipped, 1 when one fails, 2 with one line when the check cannot
run: a package missing or outside its declared range (:mod:`gpu_check.preflight`), CUDA unavailable (unless
``--cpu-dry-run``), or bad arguments. Nothing is written in those cases.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import gpu_check
from gpu_check import preflight
from gpu_check.report import CHECKS as FUNCS  # imports nothing but the standard library before the preflight

CHECKS = tuple(FUNCS)
ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 benchmarks/gpu_check", description=gpu_check.__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the same pipeline on the CPU with tiny sizes and gloo (tests the script without a GPU)")
    ap.add_argument("--out", default=None, help="output folder (default: the tree's results/gpu; dry run: its "
                    "runs/gpu_dry_run)")
    ap.add_argument("--model", default="auto", help="auto (default: smollm2 where installed, else random) | random "
                    "(a random-weight Llama built on the spot) | smollm2 | a model path")
    ap.add_argument("--dataset", default="auto", help="text of the perplexity checks (default auto: WikiText-2 "
                    "from the data folder, else the Shakespeare text, else a synthetic text)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--drop-plan", default="blocks:3,7", help="the drop plan checked at TP=2 and benchmarked")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks of the distributed checks (default: the number of GPUs; dry run: 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a subprocess counts as hung")
    ap.add_argument("--fault-dist-timeout", type=float, default=20.0, help="--dist-timeout of the fault check")
    ap.add_argument("--vllm-python", default=None, help="interpreter with vLLM for the vLLM part (default: "
                    "$SYNCDROP_VLLM_PYTHON, else this one when it has vLLM; otherwise that part is skipped)")
    ap.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds for one vLLM engine (start, "
                    "compilation, graph capture, scoring)")
    ap.add_argument("--skip-version-check", action="store_true",
                    help="run with package versions outside pyproject.toml's ranges (recorded in the files)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.checks.split(",") if c.strip()]
    bad = [c for c in names if c not in CHECKS]
    if bad or not names:
        ap.error(f"--checks must be a comma-separated subset of {','.join(CHECKS)}, got {args.checks!r}")
    if args.world is not None and args.world < 1:
        ap.error(f"--world must be at least 1, got {args.world}")
    need = preflight.check(args.skip_version_check)
    if need:
        print(need, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("gpu_check").setLevel(logging.INFO)
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (torch.cuda.is_available() is False): run this on a machine with "
              "an NVIDIA GPU and a CUDA build of torch, or pass --cpu-dry-run", file=sys.stderr)
        return 2
    from gpu_check.context import make_settings, resolve_model
    from gpu_check.report import run_checks
    from syncdrop.cli_args import error_line
    from syncdrop.errors import SyncdropError
    from syncdrop.models.loading import resolve_model as load_source

    out = Path(args.out) if args.out else ROOT / ("runs/gpu_dry_run" if args.cpu_dry_run else "results/gpu")
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_work_") as work:
            model, name = resolve_model(args.model, Path(work), args.cpu_dry_run)
            cfg = load_source(model).config
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            settings = make_settings(args, gpus, cfg.num_heads, model, name)
            return run_checks(settings, names, out, Path(work))
    except SyncdropError as e:
        print(f"gpu_check: error: {error_line(e)}", file=sys.stderr)
        return 2
