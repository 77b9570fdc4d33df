"""``syncdrop train``: a partial-sync model from scratch (see :mod:`syncdrop.caat.train`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from syncdrop.errors import SyncdropError


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    from syncdrop.caat.settings import TrainSettings

    d = TrainSettings()
    p = subparsers.add_parser(
        "train", help="train a Llama-style model from scratch with partial channel sync (CAAT-Net)",
        description="Every attention and MLP sync point all-reduces only the first round(p*h) channels; the rest "
                    "stay per rank, scaled by sqrt(N). Simulated executor (exact gradients) by default; --launch "
                    "or torchrun runs one process per rank (gloo/NCCL). Resumable: rerun the same command.")
    p.add_argument("--tp", type=int, default=d.tp, help=f"tensor-parallel degree N (default {d.tp})")
    p.add_argument("--sync-fraction", type=float, default=d.sync_fraction,
                   help="p: fraction of hidden channels synchronised (1 = ordinary TP, 0 = none)")
    p.add_argument("--corpus", default=None, help="directory of .txt books or a file (default: the Gutenberg texts)")
    p.add_argument("--data-dir", default=None, help="data folder (default $SYNCDROP_DATA or ../shared/data)")
    for f in dataclasses.fields(TrainSettings):
        if f.name in ("tp", "sync_fraction", "scale"):
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"(default {f.default})")
    p.add_argument("--no-scale", dest="scale", action="store_false",
                   help="ablation: do not scale private channels by sqrt(N)")
    p.add_argument("--out", required=True, help="run directory (checkpoint, tokenizer, exported model)")
    p.add_argument("--json", default=None, help="also write the result JSON here (train_loss, val_loss lists)")
    p.add_argument("--launch", action="store_true", help="start --tp worker processes (gloo on CPU) and train there")
    p.add_argument("--dist-timeout", type=float, default=120.0, help="collective timeout in seconds (default 120)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_train, launch_func=launch_train)
    return p


def _settings(args: argparse.Namespace):
    from syncdrop.caat.settings import TrainSettings

    s = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)})
    s.check()
    return s


def launch_train(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate here, then start --tp worker processes running the same command."""
    from syncdrop.parallel.launch import launch

    s = _settings(args)
    if args.dist_timeout <= 0:
        raise SyncdropError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    return launch([a for a in argv if a != "--launch"], s.tp, grace_s=min(args.dist_timeout, 30.0))


def cmd_train(args: argparse.Namespace) -> int:
    from syncdrop.caat.train import train
    from syncdrop.eval.data import data_dir
    from syncdrop.io_utils import atomic_write_json
    from syncdrop.parallel import dist

    s = _settings(args)
    corpus = args.corpus or str(data_dir(args.data_dir) / "gutenberg")
    if args.corpus is None and not Path(corpus).is_dir():
        raise SyncdropError("--corpus: not given, and the data folder ($SYNCDROP_DATA, --data-dir or ../shared/data) "
                            "has no gutenberg/ folder; pass --corpus DIR (a folder of .txt books) or FILE.txt")
    ctx = None
    if dist.launched_by_torchrun():
        ctx = dist.init(args.dist_timeout)
        if ctx.world != s.tp:
            raise SyncdropError(f"--tp {s.tp} but the job has {ctx.world} ranks")
    res = train(s, corpus, args.out, progress=not args.quiet, dist_ctx=ctx)
    if ctx is None or ctx.is_main:
        if args.json:
            atomic_write_json(args.json, res)
        print(f"trained {s.steps} steps at tp={s.tp}, p={s.sync_fraction:g}: final val loss "
              f"{res['final_val_loss']:.4f}; model in {args.out}/model")
    return 0  # the process group is left by syncdrop.cli.main's one shutdown path
