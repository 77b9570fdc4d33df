"""Command-line arguments shared by every ``syncdrop`` command, their validators, and the map from
library fields to flags.

Each command module (:mod:`syncdrop.cli`, :mod:`syncdrop.eval.cli`, :mod:`syncdrop.spd.cli`,
:mod:`syncdrop.caat.cli`, :mod:`syncdrop.auto.cli`) registers its parser with these helpers and
builds its models with :func:`runtime_from_args` / :func:`build_from_args`, so that ``--device``,
``--backend``, the link emulation and the plan mean the same everywhere. Torch-free at import.
"""

from __future__ import annotations

import argparse

from syncdrop.errors import SyncdropError
from syncdrop.plan import DROP_VARIANTS, PLAN_SPEC_HELP

MODEL_HELP = "smollm2 (default) | PATH.gguf | transformers directory | hub id"
DEVICE_HELP = ("auto (default: cuda:LOCAL_RANK when every rank has a GPU of its own, else cpu) | cpu | cuda | "
               "cuda:N")
BACKEND_HELP = ("distributed backend: auto (default: nccl when every local rank has its own GPU, else gloo) | "
                "gloo | nccl")

# library field -> flag, where the flag is not "--" + the field with dashes
_FLAGS = {"plan_spec": "--plan", "model_spec": "--model"}


def flag_for(field: str) -> str:
    """The command-line flag of library argument ``field`` (``dist_timeout`` -> ``--dist-timeout``)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def error_line(e: SyncdropError) -> str:
    """A :class:`SyncdropError` as the CLI prints it: its field named by its flag."""
    return e.named(flag_for(e.field)) if e.field else e.message


def add_device_args(p: argparse.ArgumentParser, backend: bool = True) -> None:
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    if backend:
        p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help=BACKEND_HELP)


def add_model_args(p: argparse.ArgumentParser, distributed: bool = True) -> None:
    """``--model --tp --plan --drop-variant --dtype``, and with ``distributed`` the runtime flags
    (``--executor --device --backend --launch --exact-reduce --link-* --dist-timeout``)."""
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree N (default 1)")
    p.add_argument("--plan", default=None,
                   help=f"sync plan: {PLAN_SPEC_HELP} (default: none, or the plan a `syncdrop distill` "
                        "directory given as --model was made for)")
    p.add_argument("--drop-variant", default="drop", choices=DROP_VARIANTS,
                   help="what a dropped block does for spec plans: drop = the SPD block (default); "
                        "naive, desync, bias-in-sum = ablations")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    if not distributed:
        return
    p.add_argument("--executor", default="auto", choices=["auto", "simulated", "hf"],
                   help="auto (default): one rank per process under torchrun/--launch, else all N ranks "
                        "simulated in this process; hf: transformers' dense model (reference)")
    add_device_args(p)
    p.add_argument("--launch", action="store_true",
                   help="start --tp worker processes on this machine (like torchrun --nproc-per-node N)")
    p.add_argument("--exact-reduce", action="store_true",
                   help="distributed: all-gather partials and sum in rank order (bitwise equal to the "
                        "simulation, N/2 x the traffic of a ring all-reduce)")
    p.add_argument("--link-bandwidth", default=None,
                   help="emulate a slow link (e.g. 1GB/s): each collective waits what a ring over the "
                        "ranks costs on it, 2(N-1)/N x bytes / bandwidth per all-reduce")
    p.add_argument("--link-latency", default=None,
                   help="emulated per-step latency of that ring (e.g. 50us): 2(N-1) steps per all-reduce")
    add_timeout_arg(p)


def add_timeout_arg(p: argparse.ArgumentParser, default: float = 60.0) -> None:
    p.add_argument("--dist-timeout", type=float, default=default,
                   help=f"seconds before a collective waiting on a dead or hung rank fails (default {default:g})")


def link_from_args(args: argparse.Namespace):
    """The emulated link of ``--link-bandwidth`` / ``--link-latency`` (inactive when neither is given)."""
    from syncdrop.bench.ring import Link, parse_bandwidth, parse_latency

    bw = getattr(args, "link_bandwidth", None)
    lat = getattr(args, "link_latency", None)
    return Link(parse_bandwidth(bw) if bw else None, parse_latency(lat) if lat else 0.0)


def runtime_from_args(args: argparse.Namespace, executor: str | None = None):
    """The :class:`~syncdrop.runtime.Runtime` these flags choose (``executor`` overrides ``--executor``:
    commands that always simulate pass ``"simulated"``)."""
    from syncdrop.runtime import choose_runtime

    return choose_runtime(executor or getattr(args, "executor", "auto"), getattr(args, "device", "auto"),
                          getattr(args, "backend", "auto"), getattr(args, "dtype", "float32"), link_from_args(args),
                          getattr(args, "exact_reduce", False), getattr(args, "dist_timeout", 60.0),
                          getattr(args, "stream", False))


def build_from_args(args: argparse.Namespace, progress: bool = True, executor: str | None = None,
                    plan: str | None = None):
    """``runtime_from_args(args).build(--model, --tp, --plan, --drop-variant)`` (``plan`` overrides ``--plan``)."""
    rt = runtime_from_args(args, executor)
    return rt.build(args.model, args.tp, plan if plan is not None else getattr(args, "plan", None),
                    getattr(args, "drop_variant", "drop"), progress=progress)


def at_least(args: argparse.Namespace, minimum: int | float, *names: str) -> None:
    """Each ``--name`` must be at least ``minimum`` (None is allowed: an unset optional)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise SyncdropError(f"{flag_for(name)} must be at least {minimum}, got {value}")


def positive(args: argparse.Namespace, *names: str) -> None:
    """Each ``--name`` must be > 0 (None is allowed)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SyncdropError(f"{flag_for(name)} must be positive, got {value}")


def check_launch_devices(device: str, backend: str, ranks: int) -> None:
    """Refuse before starting ranks what every rank would refuse: a bad --device, or nccl without a GPU
    per rank (each rank then chooses its own device and backend, :func:`syncdrop.runtime.choose_runtime`)."""
    import torch

    from syncdrop.runtime import _parse_device

    dev = _parse_device(device)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev is not None and dev.type == "cuda" and gpus == 0:
        raise SyncdropError(f"--device {device}: no CUDA device is available")
    if dev is not None and dev.index is not None and ranks > 1:
        raise SyncdropError(f"--device {device}: every rank would use the same GPU; use --device cuda "
                            "(rank r takes cuda:LOCAL_RANK)")
    if backend == "nccl" and (gpus < ranks or (dev is not None and dev.type == "cpu")):
        raise SyncdropError(f"--backend nccl needs a CUDA device per rank; this machine has {gpus} GPU(s) for "
                            f"{ranks} rank(s): use --backend gloo")
