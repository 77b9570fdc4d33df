"""``syncdrop train``: a partial-sync model from scratch (see :mod:`syncdrop.caat.train`)."""

from __future__ import annotations

import argparse
import dataclasses

from syncdrop.cli_args import add_device_args, add_timeout_arg, check_launch_devices
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
    add_device_args(p)
    p.add_argument("--launch", action="store_true", help="start --tp worker processes and train there")
    add_timeout_arg(p, 120.0)
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
    check_launch_devices(args.device, args.backend, s.tp)
    return launch([a for a in argv if a != "--launch"], s.tp, grace_s=min(args.dist_timeout, 30.0))


def cmd_train(args: argparse.Namespace) -> int:
    from syncdrop.caat.train import train
    from syncdrop.cli_args import runtime_from_args
    from syncdrop.eval.data import resolve_corpus
    from syncdrop.io_utils import atomic_write_json

    s = _settings(args)
    corpus = str(resolve_corpus(args.corpus, args.data_dir))
    runtime = runtime_from_args(args)  # training runs in float32
    res = train(s, corpus, args.out, progress=not args.quiet, runtime=runtime)
    if runtime.start() is None or runtime.start().is_main:
        if args.json:
            atomic_write_json(args.json, res)
        print(f"trained {s.steps} steps at tp={s.tp}, p={s.sync_fraction:g}: final val loss "
              f"{res['final_val_loss']:.4f}; model in {args.out}/model")
    return 0  # the process group is left by syncdrop.cli.main's one shutdown path
