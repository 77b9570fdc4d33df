"""``syncdrop auto`` command-line registration (torch-free until the command runs)."""

from __future__ import annotations

import argparse

from syncdrop.cli_args import add_device_args


def add_auto_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "auto", help="profile -> plan -> distil -> evaluate -> benchmark -> choose -> report, cached in --out",
        description="Answer 'which sync points can I drop on my link, how much faster is it, and what does it "
                    "cost in accuracy?'. Each stage is cached in --out and skipped when rerun with the same "
                    "inputs; an interrupted run resumes.")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--link-bandwidth", default=None, help="the deployment link, e.g. 1GB/s (emulated here)")
    p.add_argument("--link-latency", default=None, help="per all-reduce latency, e.g. 50us")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--max-ppl-increase", type=float, default=None,
                   help="accuracy budget: relative perplexity increase (default 0.05 = 5%%)")
    g.add_argument("--spd", type=float, default=None, help="fixed SPD fraction instead of a budget")
    p.add_argument("--fractions", default="0,0.25,0.5,0.75,1", help="candidate SPD fractions")
    p.add_argument("--wire", default=None,
                   help="wire formats for the sync points each candidate keeps, comma-separated: none (full "
                        "precision), int8, fp8, int4, int8h/int4h (Hadamard-rotated groups), bf16, with :gG for the "
                        "group size, e.g. none,int8,int4h:g32 "
                        "(default none,int8, leaving int8 out with a warning where its groups of 64 do not divide "
                        "the hidden size); every SPD fraction is a candidate with each")
    p.add_argument("--max-acc-drop", default="5",
                   help="zero-shot limit: points of average accuracy over --zs-tasks a candidate may lose to dense, "
                        "judged on the upper end of a paired 95%% interval over the same documents (default 5; "
                        "none: not judged)")
    p.add_argument("--calib-samples", type=int, default=2, help="profiling windows (default 2)")
    p.add_argument("--seq-len", type=int, default=256, help="window length for profile/distil/ppl (default 256)")
    p.add_argument("--distill-samples", type=int, default=4)
    p.add_argument("--distill-epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3, help="B2B learning rate (default 1e-3, see docs/spd.md)")
    p.add_argument("--recovery-budget", default="10m",
                   help="time for recovery training, e.g. 30m, 1h, 0 (default 10m): the block stage (B2B / HG+B2B) "
                        "first, then end-to-end distillation for the candidates that drop most, while the time "
                        "predicted from step times measured here fits; 0 = zero-shot only")
    p.add_argument("--e2e-samples", default="auto",
                   help="end-to-end distillation windows per candidate (default auto: as many as the recovery "
                        "budget left after the block stage pays for, shared by the candidates that get the stage; "
                        "more windows were worth more than more epochs, docs/spd.md)")
    p.add_argument("--e2e-epochs", type=int, default=1, help="end-to-end distillation epochs (default 1)")
    p.add_argument("--e2e-lr-schedule", default="constant", choices=("constant", "linear"),
                   help="end-to-end learning rate: constant (default) or linear decay to 0 over the run "
                        "(docs/spd.md: the window order's effect on the result)")
    p.add_argument("--e2e-lr", type=float, default=3e-5,
                   help="end-to-end distillation learning rate (default 3e-5, scanned: docs/spd.md)")
    p.add_argument("--tau1", default="0", help="zero-shot tier bound (default 0: see docs/spd.md)")
    p.add_argument("--tau2", default="1%", help="B2B tier bound (default 1%% of baseline ppl)")
    p.add_argument("--eval-windows", type=int, default=8, help="WikiText-2 test windows for perplexity")
    p.add_argument("--zs-tasks", default="arc_easy,piqa")
    p.add_argument("--zs-limit", type=int, default=20,
                   help="documents per zero-shot task, the same for every candidate (default 20)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=4)
    p.add_argument("--reps", type=int, default=7,
                   help="interleaved repetitions per plan in the latency benchmark, at least (default 7)")
    p.add_argument("--max-reps", type=int, default=30,
                   help="repeat the benchmark up to this many reps until every median TTFT has a 95%% interval "
                        "within +-3%% (default 30)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--engine", default="syncdrop", choices=["syncdrop", "vllm"],
                   help="benchmark candidates in syncdrop's runtime (default) or served in vLLM; vllm also writes "
                        "the chosen plan with `syncdrop export` to OUT/export and gives the vllm serve command")
    add_device_args(p, backend=False)
    p.add_argument("--out", required=True, help="run directory (stages cached here; report.html, report.md)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_auto)
    return p


def _number_or(text: str, keyword: str, convert, flag: str, what: str):
    """``convert(text)``, or None when ``text`` is ``keyword``; a usage error naming ``flag`` otherwise."""
    from syncdrop.errors import SyncdropError

    if str(text).strip().lower() == keyword:
        return None
    try:
        return convert(text)
    except ValueError:
        raise SyncdropError(f"{flag} {text!r}: expected {what} or {keyword}") from None


def cmd_auto(args: argparse.Namespace) -> int:
    from syncdrop.auto.pipeline import AutoSettings, run_auto
    from syncdrop.errors import SyncdropError

    try:
        fractions = tuple(float(x) for x in args.fractions.split(",") if x.strip())
    except ValueError:
        raise SyncdropError(f"--fractions {args.fractions!r}: expected comma-separated numbers") from None
    from syncdrop.spd.recovery import parse_duration

    parse_duration(args.recovery_budget)
    if not args.e2e_lr > 0:
        raise SyncdropError(f"--e2e-lr must be a positive number, got {args.e2e_lr}")
    e2e_samples = _number_or(args.e2e_samples, "auto", int, "--e2e-samples", "a number of windows")
    if e2e_samples is not None and e2e_samples < 1:
        raise SyncdropError(f"--e2e-samples must be at least 1, got {e2e_samples}")
    for name in ("calib_samples", "seq_len", "distill_samples", "distill_epochs", "eval_windows", "zs_limit",
                 "prompt_len", "decode_tokens", "reps", "max_reps", "e2e_epochs"):
        if getattr(args, name) < 1:
            raise SyncdropError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_reps < args.reps:
        raise SyncdropError(f"--max-reps must be at least --reps ({args.reps}), got {args.max_reps}")
    acc_limit = _number_or(args.max_acc_drop, "none", float, "--max-acc-drop", "a number of points")
    wires = None if args.wire is None else tuple(w.strip() for w in args.wire.split(",") if w.strip())
    if wires == ():
        raise SyncdropError(f"--wire {args.wire!r}: expected wire formats, e.g. none,int8")
    budget = args.max_ppl_increase if args.max_ppl_increase is not None else (None if args.spd is not None else 0.05)
    s = AutoSettings(args.model, args.tp, args.link_bandwidth, args.link_latency, budget, args.spd, fractions,
                     args.calib_samples, args.seq_len, args.distill_samples, args.distill_epochs, args.lr, args.tau1,
                     args.tau2, args.eval_windows, args.zs_tasks, args.zs_limit, args.prompt_len, args.decode_tokens,
                     args.reps, args.data_dir, args.device, args.max_reps, args.engine,
                     recovery_budget=args.recovery_budget, e2e_samples=e2e_samples, e2e_epochs=args.e2e_epochs,
                     e2e_lr=args.e2e_lr, wires=wires, max_acc_drop=acc_limit,
                     e2e_lr_schedule=args.e2e_lr_schedule)
    res = run_auto(s, args.out, progress=not args.quiet)
    c = res["chosen"]
    ttft = "" if c["measured_ttft_ms"] is None else f", measured TTFT {c['measured_ttft_ms']:.1f} ms"
    wire = "" if c.get("wire", "none") == "none" else f" with {c['wire']} on the wire"
    print(f"chosen: SPD fraction {c['fraction']:g}{wire} ({c['variant']}), perplexity {c['ppl']:.3f} "
          f"({c['ppl_increase']:+.2%}){ttft}")
    print(f"reason: {res['reason']}")
    if res.get("served"):
        print(f"serve it: {res['served']['serve']['gpu']}  (CPU: {res['served']['serve']['cpu']})")
    print(f"report: {res['report_html']} (and {res['report_md']})")
    return 0
