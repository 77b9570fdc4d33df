"""``syncdrop profile`` and ``syncdrop plan``: registration functions for the main parser.

Wire them in :func:`syncdrop.cli.build_parser`::

    from syncdrop.spd.cli import add_plan_parser, add_profile_parser

    add_profile_parser(sub)
    add_plan_parser(sub)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from syncdrop.cli_args import add_device_args
from syncdrop.errors import SyncdropError
from syncdrop.plan import SyncPlan

# --method of `syncdrop distill`: the block stage, then optionally end-to-end KL distillation
METHODS = ("b2b", "sequential", "b2b+e2e", "sequential+e2e", "e2e")

def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``profile`` on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "profile", help="per-block SPD sensitivity (perplexity deltas on calibration data)",
        description="Per-block sensitivity to dropping the attention sync (SPD): progressive "
                    "s_i = ppl(SPD on i..L-1) - ppl(SPD on i+1..L-1) and isolated s_i = ppl(SPD on i) - ppl(none), "
                    "on --samples windows of --seq-len tokens of --calib (after the first --skip). Runs all --tp "
                    "ranks in this process (the simulated executor). With a `syncdrop distill` directory as --model "
                    "(a bank: `distill --plan all`), the recovered sensitivity: a dropped block runs its distilled "
                    "weights, so the plan drops the blocks that recover best.")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default) | PATH.gguf | transformers directory | hub id | a `syncdrop distill` "
                        "directory (recovered sensitivity)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree N (>= 2: at N=1 SPD changes nothing)")
    p.add_argument("--calib", default="auto:valid",
                   help="calibration text: auto:valid (default: WikiText-2 valid, else the Shakespeare comedies) | "
                        "wikitext2:valid | wikitext2 | shakespeare | shakespeare:valid | PATH")
    p.add_argument("--data-dir", default=None, help="data folder (default $SYNCDROP_DATA or ../shared/data)")
    p.add_argument("--samples", type=int, default=8, help="calibration windows K: the first K after --skip (default 8)")
    p.add_argument("--skip", type=int, default=0,
                   help="calibration windows skipped before the K (default 0; e.g. the windows a bank was trained on)")
    p.add_argument("--seq-len", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--stream", action="store_true",
                   help="hold one block's weights at a time: every evaluation goes through a block before the "
                        "next is read (each block read once; activations: up to 2L streams of the windows; the "
                        "same profile, bit for bit)")
    p.add_argument("--wire", default=None,
                   help="profile sensitivity to compression instead of SPD: every sync point (attention and MLP "
                        "of each block) in wire format WIRE (int8, int4:g32, fp8, bf16; docs/compression.md), "
                        "progressive from the last point and isolated")
    add_device_args(p, backend=False)
    p.add_argument("--out", required=True, help="profile JSON to write (e.g. profile.json)")
    p.add_argument("--png", default=None, help="bar chart of the sensitivities (default: --out with .png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the bar chart")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    from syncdrop.cli_args import runtime_from_args
    from syncdrop.eval.data import load_text
    from syncdrop.eval.perplexity import text_windows
    from syncdrop.io_utils import atomic_write_json, portable_path
    from syncdrop.spd.profile import plot_profile, profile_sensitivity

    if args.tp < 2:
        raise SyncdropError(f"--tp must be at least 2 (at --tp {args.tp} dropping the attention sync changes nothing)")
    if args.samples < 1:
        raise SyncdropError(f"--samples must be at least 1, got {args.samples}")
    if args.skip < 0:
        raise SyncdropError(f"--skip must be at least 0, got {args.skip}")
    if args.seq_len < 2:
        raise SyncdropError(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.batch_size < 1:
        raise SyncdropError(f"--batch-size must be at least 1, got {args.batch_size}")
    wire = None
    if args.wire is not None:
        from syncdrop.plan.wire import parse_wire

        wire = parse_wire(args.wire, "--wire")
        if args.stream:
            raise SyncdropError("--wire profiles hold every block's input: drop --stream")
    data = load_text(args.calib, args.data_dir)  # fail fast before loading the model
    built = runtime_from_args(args, executor="simulated").build(args.model, args.tp, "none", progress=not args.quiet)
    if wire is not None:
        return _compression_profile(args, built, data, wire)
    spd = built.source.spd
    donor = None
    if spd is not None:  # recovered sensitivity: the distilled blocks, built once, lent to the base model
        L = built.source.config.num_layers
        base = built.model
        donor = built.use_plan(SyncPlan.dropping(L, sorted(spd.blocks)), progress=not args.quiet)
        built.use_plan(SyncPlan.uniform(L))
        assert built.model is base
    n = args.skip + args.samples
    windows = text_windows(built.source.load_tokenizer(), data.text, args.seq_len, n,
                           f"--calib {args.calib} (for --skip {args.skip} --samples {args.samples})")[args.skip :]
    prof = profile_sensitivity(built.model, windows, args.batch_size, progress=not args.quiet, donor=donor)
    extra = {"recovered": {"bank": portable_path(spd.path), "blocks": sorted(spd.blocks),
                           "method": spd.data.get("distill", {})}} if spd is not None else {}
    d = prof.to_dict(built.source.name, args.tp, {"dataset": data.name, "path": data.path, "skip": args.skip},
                     model_spec=args.model, dtype=args.dtype, batch_size=args.batch_size, **extra)
    atomic_write_json(args.out, d)
    png = None if args.no_png else (args.png or str(Path(args.out).with_suffix(".png")))
    if png:
        plot_profile(d, png)
    bf = d["block_forwards"]
    print(f"{built.source.name} tp={args.tp} {data.name} ({prof.windows} windows of {prof.seq_len}): "
          f"baseline ppl {prof.baseline_ppl:.4f}, all blocks SPD {prof.blocks[0].ppl_progressive:.4f}; "
          f"{bf['done']} block forwards ({bf['naive']} from scratch), cache {prof.cache_bytes / 2**20:.1f} MiB, "
          f"{prof.elapsed_s:.1f}s")
    print(" block  progressive     isolated")
    for b in prof.blocks:
        print(f"{b.index:6d} {b.progressive:12.5f} {b.isolated:12.5f}")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


def _compression_profile(args: argparse.Namespace, built, data, wire) -> int:
    """``syncdrop profile --wire``: every sync point's sensitivity to ``wire`` (:mod:`syncdrop.compression.profile`)."""
    from syncdrop.compression.profile import profile_compression
    from syncdrop.eval.perplexity import text_windows
    from syncdrop.io_utils import atomic_write_json

    wire.check(built.source.config.hidden_size)
    n = args.skip + args.samples
    windows = text_windows(built.source.load_tokenizer(), data.text, args.seq_len, n,
                           f"--calib {args.calib} (for --skip {args.skip} --samples {args.samples})")[args.skip :]
    prof = profile_compression(built.model, windows, wire, args.batch_size, progress=not args.quiet)
    d = prof.to_dict(built.source.name, args.tp, {"dataset": data.name, "path": data.path, "skip": args.skip},
                     model_spec=args.model, dtype=args.dtype, batch_size=args.batch_size)
    atomic_write_json(args.out, d)
    print(f"{built.source.name} tp={args.tp} {data.name} ({prof.windows} windows of {prof.seq_len}), wire {wire}: "
          f"baseline ppl {prof.baseline_ppl:.4f}, every point compressed {prof.all_compressed_ppl:.4f}; "
          f"{prof.block_forwards} block forwards, {prof.elapsed_s:.1f}s")
    print(" block  point  progressive     isolated")
    for p in prof.points:
        print(f"{p.block:6d}  {p.point:5s} {p.progressive:12.5f} {p.isolated:12.5f}")
    print(f"wrote {args.out}")
    return 0


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on ``subparsers`` (from ``add_subparsers``)."""
    from syncdrop.spd import SENSITIVITIES
    from syncdrop.spd.planning import DEFAULT_TAU1, DEFAULT_TAU2

    p = subparsers.add_parser(
        "plan", help="a sync plan from a sensitivity profile (least sensitive blocks dropped)",
        description="Sort blocks by sensitivity (ascending) and drop the least sensitive: a fraction (--spd) "
                    "or as many as fit a predicted perplexity budget (--max-ppl-increase; a prediction from "
                    "the profile, measure it with `syncdrop ppl --plan OUT`). Dropped blocks get a tier "
                    "(zs / b2b / hg+b2b) by --tau1/--tau2, stored in the plan's meta.")
    p.add_argument("--profile", required=True, help="profile JSON written by `syncdrop profile`")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--spd", type=float, default=None, help="fraction of blocks to drop, e.g. 0.7")
    g.add_argument("--max-ppl-increase", type=float, default=None,
                   help="relative predicted perplexity increase allowed, e.g. 0.01 = 1%%")
    p.add_argument("--sensitivity", default="progressive", choices=SENSITIVITIES,
                   help="which sensitivity to sort by (default progressive)")
    tau1, tau2 = (t.replace("%", "%%") for t in (DEFAULT_TAU1, DEFAULT_TAU2))  # argparse expands % in help
    p.add_argument("--tau1", default=DEFAULT_TAU1,
                   help=f"zero-shot tier bound: ppl delta or %% of baseline (default {tau1}, see docs/spd.md)")
    p.add_argument("--tau2", default=DEFAULT_TAU2,
                   help=f"B2B tier bound: ppl delta, or %% of baseline ppl (default {tau2}, see docs/spd.md)")
    p.add_argument("--out", required=True, help="plan JSON to write (usable as --plan everywhere)")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    from syncdrop.io_utils import provenance
    from syncdrop.spd import TIERS
    from syncdrop.spd.planning import load_profile, make_plan, tiers

    prof = load_profile(args.profile)
    plan = make_plan(prof, args.spd, args.max_ppl_increase, args.sensitivity, args.tau1, args.tau2)
    plan.meta["provenance"] = provenance()
    plan.save(args.out)
    m = plan.meta
    t = tiers(plan)
    counts = {k: sum(v == k for v in t.values()) for k in TIERS}
    print(f"{prof.data.get('model')} tp={prof.data.get('tp')} ({args.sensitivity}): {plan.summary()}")
    print(f"tiers (tau1 {m['tau1']:.4g}, tau2 {m['tau2']:.4g} ppl): "
          + ", ".join(f"{k} {n}" for k, n in counts.items()))
    print(f"predicted ppl {m['predicted_ppl']:.4f} (baseline {prof.baseline_ppl:.4f}, "
          f"+{m['predicted_ppl_increase']:.4f}); measure with: syncdrop ppl --plan {args.out}")
    print(f"wrote {args.out}")
    return 0


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``distill`` on ``subparsers`` (from ``add_subparsers``)."""
    from syncdrop.plan import PLAN_SPEC_HELP
    from syncdrop.spd import HG_MLP as MLP_MATCHING
    from syncdrop.spd import HG_UNITS as UNITS
    from syncdrop.spd import TIERS

    p = subparsers.add_parser(
        "distill", help="block-to-block distillation (B2B, optionally after head grouping) of a plan's dropped blocks",
        description="For each dropped block of tier b2b or hg+b2b, train the SPD form of the block to match the "
                    "original block's output (MSE) on the hidden states entering it, on --calib windows; only that "
                    "block's weights change. hg+b2b blocks first get a head-grouping layout. Writes OUT/syncdrop.json "
                    "and OUT/blocks/*.safetensors (each block as soon as it is done: rerun the same command to "
                    "resume). OUT is accepted as --model by ppl, generate, bench and eval, with its plan.")
    p.add_argument("--model", default="smollm2", help="smollm2 (default) | PATH.gguf | transformers directory | hub id")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree N the blocks are distilled for")
    p.add_argument("--plan", required=True, help=f"plan to distil for: {PLAN_SPEC_HELP} (tiers from `syncdrop plan`)")
    p.add_argument("--tier", default="auto", choices=("auto", *TIERS),
                   help="tier of every dropped block: auto = the plan's tiers, b2b where it has none (default)")
    p.add_argument("--calib", default="auto:valid",
                   help="calibration text: auto:valid (default: WikiText-2 valid, else the Shakespeare comedies) | "
                        "wikitext2:valid | wikitext2 | shakespeare | shakespeare:valid | PATH")
    p.add_argument("--data-dir", default=None, help="data folder (default $SYNCDROP_DATA or ../shared/data)")
    p.add_argument("--samples", type=int, default=16, help="training windows (default 16; the paper: 128 x 2048)")
    p.add_argument("--heldout", type=int, default=2, help="held-out windows after them (loss report; default 2)")
    p.add_argument("--seq-len", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the paper's, 5e-5; OPT 1e-6)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training windows (default 10, the paper's)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per step (default 1)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hg-unit", default="group", choices=UNITS,
                   help="head grouping moves whole KV groups (default) or single heads (KV heads replicated)")
    p.add_argument("--hg-mlp", default="shard", choices=MLP_MATCHING,
                   help="MLP matching: whole shards (default), single channels, or none")
    p.add_argument("--hg-samples", type=int, default=2, help="calibration windows for head grouping (default 2)")
    p.add_argument("--last-epoch", action="store_true",
                   help="keep the last epoch's weights (default: the epoch with the lowest held-out loss, "
                        "the original weights included)")
    p.add_argument("--method", default="b2b", choices=METHODS,
                   help="b2b (default): each block on the original model's residual (the paper's); sequential: each "
                        "block on the residual of the model converted so far; +e2e: then every dropped block end to "
                        "end, KL to the original model's next-token distribution (block stage in OUT/blockwise); e2e: "
                        "end to end only, from --model as it is, every block the plan changes (dropped or "
                        "compressed sync points: the way to recover a low-bit wire, docs/compression.md)")
    p.add_argument("--e2e-epochs", type=int, default=1, help="+e2e: passes over the training windows (default 1)")
    p.add_argument("--e2e-lr", type=float, default=3e-5,
                   help="+e2e: AdamW learning rate (default 3e-5, the best of 1e-5/3e-5/1e-4 in docs/spd.md)")
    p.add_argument("--e2e-lr-schedule", default="constant", choices=("constant", "linear"),
                   help="+e2e: constant rate (default) or linear decay to 0 over the run (docs/spd.md)")
    p.add_argument("--e2e-adapter", default="full", choices=("full", "lora"),
                   help="+e2e: train all weights of the dropped blocks (default) or LoRA factors, merged after")
    p.add_argument("--lora-rank", type=int, default=8, help="+e2e with lora: rank r (default 8; alpha = 2r)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype of the teacher and the students (default float32); trained weights are "
                        "float32 master copies either way, and the block files hold them")
    add_device_args(p, backend=False)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_distill)
    return p


def _e2e_settings(args: argparse.Namespace):
    from syncdrop.spd.e2e import E2ESettings

    return E2ESettings(args.e2e_lr, args.e2e_epochs, args.e2e_adapter, args.lora_rank, 2.0 * args.lora_rank,
                       args.weight_decay, args.seed, lr_schedule=args.e2e_lr_schedule)


def _print_e2e(args: argparse.Namespace, manifest: dict) -> None:
    st = manifest["distill"]["e2e"]
    print(f"end to end ({args.e2e_adapter}): held-out KL to the original model {st['heldout_kl_start']:.5g} -> "
          f"{st['heldout_kl']:.5g} (epoch {st['selected_epoch']} kept, {st['seconds']:.0f} s)")


def _distill_e2e(args: argparse.Namespace, source, plan, data) -> int:
    """``--method e2e``: end-to-end distillation of every block ``plan`` changes (dropped or compressed sync
    points), starting from ``--model`` itself (no block stage)."""
    from syncdrop.cli_args import runtime_from_args
    from syncdrop.eval.perplexity import text_windows
    from syncdrop.spd.e2e import e2e_distill

    if plan.has_partial or not plan.changed:
        raise SyncdropError(f"--plan {args.plan}: end-to-end distillation needs a plan that drops or compresses "
                            "sync points (no partial sync)")
    settings = _e2e_settings(args)
    settings.check()
    windows = text_windows(source.load_tokenizer(), data.text, args.seq_len, args.samples + args.heldout,
                           f"--calib {args.calib} (for --samples {args.samples} + --heldout {args.heldout})")
    rt = runtime_from_args(args, executor="simulated")
    calib = {"dataset": data.name, "path": data.path, "seq_len": args.seq_len}
    m = e2e_distill(args.model, args.tp, plan, windows[: args.samples], windows[args.samples :], args.out, settings,
                    calib, progress=not args.quiet, device=rt.device, dtype=rt.dtype)
    print(f"{source.name} tp={args.tp}: {plan.summary()}; trained blocks {m['distill']['trained_blocks']} end to end")
    _print_e2e(args, m)
    print(f"wrote {args.out} (use it as --model with its plan, e.g. syncdrop ppl --model {args.out} --tp {args.tp})")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from syncdrop.cli_args import runtime_from_args
    from syncdrop.eval.data import load_text
    from syncdrop.eval.perplexity import text_windows
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel.sharding import check_tp
    from syncdrop.plan import DROP, resolve_plan
    from syncdrop.spd.distill import DistillSettings, default_lr, distill
    from syncdrop.spd.planning import tiers as plan_tiers

    if args.tp < 2:
        raise SyncdropError(f"--tp must be at least 2 (at --tp {args.tp} dropping the attention sync changes nothing)")
    for name in ("samples", "heldout"):
        if getattr(args, name) < 1:
            raise SyncdropError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if os.path.isfile(args.out):
        raise SyncdropError(f"--out {args.out} is a file; expected a directory")
    data = load_text(args.calib, args.data_dir)
    source = resolve_model(args.model)
    check_tp(source.config, args.tp)
    plan = resolve_plan(args.plan, source.config.num_layers, tp=args.tp, hidden=source.config.hidden_size)
    if args.method == "e2e":  # end to end only, from the model as it is: any plan that changes a block
        return _distill_e2e(args, source, plan, data)
    if not plan.dropped:
        raise SyncdropError(f"--plan {args.plan} drops no block: nothing to distil block by block (--method e2e "
                            "trains a plan's compressed sync points end to end)")
    if plan.has_partial or any(b.attn.drops and b.attn != DROP for b in plan.blocks):
        raise SyncdropError("--plan: distillation trains the SPD block (attn: drop, mlp: full); the plan uses an "
                            "ablation variant or partial sync")
    given = plan_tiers(plan)
    tiers = {i: (args.tier if args.tier != "auto" else given.get(i, "b2b")) for i in plan.dropped}
    block_method, e2e = args.method.removesuffix("+e2e"), args.method.endswith("+e2e")
    settings = DistillSettings(args.lr if args.lr is not None else default_lr(source.config), args.epochs,
                               args.batch_size, args.weight_decay, args.seed, args.hg_unit, args.hg_mlp,
                               args.hg_samples, keep_best=not args.last_epoch, method=block_method)
    settings.check()
    e2e_settings = _e2e_settings(args)
    if e2e:
        e2e_settings.check()
    windows = text_windows(source.load_tokenizer(), data.text, args.seq_len, args.samples + args.heldout,
                           f"--calib {args.calib} (for --samples {args.samples} + --heldout {args.heldout})")
    rt = runtime_from_args(args, executor="simulated")
    device = rt.device
    calib = {"dataset": data.name, "path": data.path, "seq_len": args.seq_len}
    block_out = os.path.join(args.out, "blockwise") if e2e else args.out
    m = distill(source, args.tp, plan, tiers, windows[: args.samples], windows[args.samples :], block_out, settings,
                calib, progress=not args.quiet, device=device, dtype=rt.dtype)
    print(f"{source.name} tp={args.tp}: {plan.summary()}; trained {len(m['blocks'])} blocks "
          f"({sum(t != 'zs' for t in tiers.values())} b2b/hg+b2b, {sum(t == 'zs' for t in tiers.values())} zero-shot)")
    if m["blocks"]:
        print(" block  tier      held-out MSE: zero-shot -> distilled")
        for k, e in m["blocks"].items():
            st = e["stats"]
            print(f"{int(k):6d}  {e['tier']:8s}  {st['heldout_loss_zs']:12.5g} -> {st['heldout_loss']:.5g}")
    if e2e:
        from syncdrop.spd.e2e import e2e_distill

        m2 = e2e_distill(block_out, args.tp, plan, windows[: args.samples], windows[args.samples :], args.out,
                         e2e_settings, calib, progress=not args.quiet, device=device, dtype=rt.dtype)
        _print_e2e(args, m2)
    print(f"wrote {args.out} (use it as --model, e.g. syncdrop ppl --model {args.out} --tp {args.tp})")
    return 0
