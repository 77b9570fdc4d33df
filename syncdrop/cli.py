"""The ``syncdrop`` command.

Every user mistake raises :class:`~syncdrop.errors.SyncdropError`; :func:`main` prints it as one
line and exits with code 2 (argparse's own errors also exit 2). A failed collective in the
distributed runtime (a peer rank died or hung) prints one line and exits with code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from syncdrop.cli_args import (
    add_model_args,
    at_least,
    build_from_args,
    check_launch_devices,
    error_line,
    link_from_args,
    runtime_from_args,
)
from syncdrop.errors import SyncdropError
from syncdrop.plan import SyncPlan

log = logging.getLogger("syncdrop")


def plans_to_bench(args: argparse.Namespace, source) -> list[tuple[str, SyncPlan]]:
    """``--plans`` as ``(spec, plan)`` pairs, each resolved against ``source`` (``model``: its own plan).
    ``--plan`` is refused: bench measures exactly the plans of ``--plans``."""
    from syncdrop.plan import split_plan_list
    from syncdrop.runtime import model_plan

    if args.plan is not None:
        raise SyncdropError(f"--plan {args.plan}: bench measures the plans listed in --plans; put it there "
                            f"(e.g. --plans none,{args.plan})")
    return [(s, model_plan(source, s, args.tp, args.drop_variant, what="plans"))
            for s in split_plan_list(args.plans)]


def _check_bench_link(args: argparse.Namespace, cfg, link=None) -> None:
    """The prefill all-reduce (batch x prompt x hidden) must be emulated in less than --dist-timeout
    (``link``: default the one of --link-bandwidth/--link-latency)."""
    from syncdrop.bench.run import check_link

    check_link(cfg, link or link_from_args(args), args.dtype, args.batch * args.prompt_len, args.tp,
               args.dist_timeout)


def _bench_links(args: argparse.Namespace, link):
    """``--links``: the parsed list, or None; refused beside --link-bandwidth/--link-latency and --engine vllm."""
    from syncdrop.bench.ring import parse_links

    if args.links is None:
        return None
    if link.active:
        raise SyncdropError("--links lists every link to interleave: drop --link-bandwidth/--link-latency "
                            "(or add that link to --links)")
    return parse_links(args.links)


def _bench_settings(args: argparse.Namespace):
    """The :class:`~syncdrop.bench.run.BenchSettings` of these flags."""
    from syncdrop.bench.run import BenchSettings
    from syncdrop.plan import split_plan_list

    if args.engine == "vllm" and args.links is not None:
        raise SyncdropError("--links interleaves links in syncdrop's runtime: with --engine vllm, run one "
                            "bench per link (--link-bandwidth/--link-latency)")
    link = link_from_args(args)
    links = _bench_links(args, link)
    return BenchSettings(
        model=args.model, tp=args.tp, plans=tuple(split_plan_list(args.plans)), prompt_len=args.prompt_len,
        batch=args.batch, decode_tokens=args.decode_tokens, reps=args.reps, max_reps=args.max_reps,
        target_ci=args.target_ci, warmup=args.warmup, threads=args.threads, link=link,
        links=None if links is None else tuple(links), dataset=args.dataset, data_dir=args.data_dir,
        dtype=args.dtype, device=args.device, backend=args.backend, executor=args.executor,
        exact_reduce=args.exact_reduce, dist_timeout=args.dist_timeout, drop_variant=args.drop_variant,
        engine=args.engine, stock=args.stock, work_dir=args.work_dir)


def cmd_bench(args: argparse.Namespace) -> int:
    """Check the flags, measure (:func:`syncdrop.bench.run.run_bench`), print and write on rank 0."""
    from syncdrop.bench.latency import markdown_table
    from syncdrop.bench.run import run_bench
    from syncdrop.io_utils import atomic_write_json, atomic_write_text
    from syncdrop.parallel import dist

    s = _bench_settings(args)
    if s.engine == "vllm" and args.launch:
        raise SyncdropError("--engine vllm measures batch 1 in vLLM's own runtime: drop --batch, --launch and "
                            "--executor")
    if s.engine == "syncdrop":
        if args.tp > 1 and not dist.launched_by_torchrun():
            raise SyncdropError("bench measures real communication: add --launch (or run under torchrun) for "
                                "--tp > 1")
        from syncdrop.models.loading import resolve_model

        plans_to_bench(args, resolve_model(args.model))  # --plan refused, every spec resolves: before any weights
    docs = run_bench(s, progress=not args.quiet)
    if docs is None:  # not rank 0
        return 0
    conds = s.conditions()
    for (label, _), doc in zip(conds, docs, strict=True):
        table = markdown_table(doc)
        print(_bench_header(doc, label, len(conds)))
        print(table)
        if args.json:
            path = bench_json_path(args.json, label)
            atomic_write_json(path, doc)
            atomic_write_text(path.removesuffix(".json") + ".md", table)
    return 0


def _bench_header(doc: dict, label: str | None, n_links: int) -> str:
    """The line printed above a result's table."""
    st = doc["settings"]
    if "engine" in st:  # vLLM
        return (f"{st['model']} in vLLM ({st['engine']}) TP={st['tp']}, prompt {st['prompt_len']}, "
                f"{st['decode_tokens']} decode tokens, link: {st['link_description']}, medians of {doc['reps_run']} "
                "interleaved reps [95% intervals]")
    return (f"{st['model']} TP={st['tp']}, prompt {st['prompt_len']} x batch {st['batch']}, "
            f"{st['decode_tokens']} decode tokens, link: {st['link_description']}"
            + ("" if label is None else f" (interleaved with {n_links - 1} other link(s))")
            + f", medians of {doc['reps_run']} interleaved reps [95% intervals], "
            f"{st['threads_per_rank']} thread(s) per rank")


def bench_json_path(json_path: str, link_label: str | None) -> str:
    """Where ``syncdrop bench --json OUT.json`` writes a link's result: ``OUT.json`` itself, or with
    ``--links`` one file per link, ``OUT_<link>.json`` (``100MB/s+50us`` -> ``OUT_100MBps+50us.json``)."""
    from syncdrop.bench.ring import link_slug

    if link_label is None:
        return json_path
    return f"{json_path.removesuffix('.json')}_{link_slug(link_label)}.json"


def cmd_ppl(args: argparse.Namespace) -> int:
    from syncdrop.eval.data import load_text
    from syncdrop.eval.perplexity import make_windows, perplexity
    from syncdrop.io_utils import atomic_write_json, provenance

    at_least(args, 1, "batch_size", "max_windows")
    at_least(args, 2, "seq_len")
    rt = runtime_from_args(args)  # bad --device/--backend/--dtype first: before any data lookup
    data = load_text(args.dataset, args.data_dir)  # fail fast before loading the model
    built = rt.build(args.model, args.tp, args.plan, args.drop_variant, progress=not args.quiet)
    log.info("rank %s ready", built.dist.rank if built.dist else 0)
    tok = built.source.load_tokenizer()
    ids = tok(data.text, add_special_tokens=False)["input_ids"]
    windows = make_windows(ids, args.seq_len, args.max_windows)
    t0 = time.perf_counter()
    res = perplexity(built.model, windows, args.batch_size, progress=not args.quiet and built.is_main)
    elapsed = time.perf_counter() - t0
    memory = built.memory()
    if not built.is_main:
        return 0
    runtime = built.runtime.executor
    print(f"{built.source.name} tp={args.tp} ({runtime}) plan={built.plan.summary()} {data.name}: "
          f"ppl {res.ppl:.4f} ({res.tokens} tokens, {res.windows} windows of {res.seq_len}, {elapsed:.1f}s)")
    if args.json:
        atomic_write_json(args.json, {
            "ppl": res.ppl, "nll_mean": res.nll_sum / res.tokens, "tokens": res.tokens, "windows": res.windows,
            "seq_len": res.seq_len, "model": built.source.name, "model_spec": args.model, "tp": args.tp,
            "plan": built.plan.to_dict(), "plan_summary": built.plan.summary(), "executor": runtime,
            "dtype": args.dtype, "dataset": data.name, "dataset_source": data.source, "dataset_path": data.path,
            "max_windows": args.max_windows, "elapsed_s": elapsed, "window_nll": res.window_nll,
            "device": str(built.runtime.device), "backend": built.runtime.backend, "stream": args.stream,
            "memory": memory, "provenance": provenance(),
        })
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from syncdrop.generate import SamplingParams, generate

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    params.validate()
    if args.max_new_tokens < 1:
        raise SyncdropError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.executor == "hf":
        raise SyncdropError("generate runs syncdrop's executors: use --executor auto or simulated")
    built = build_from_args(args, progress=False)
    tok = built.source.load_tokenizer()
    ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise SyncdropError("--prompt is empty after tokenization")
    # ranks' streams diverge under naive drops: every rank takes rank 0's tokens
    # ranks whose streams differ compute different logits unless the head all-gathers them: take rank 0's token
    diverge = built.plan.ranks_diverge and not built.plan.needs_vocab_gather
    agree = built.comm.broadcast if diverge else None
    eos = None if args.ignore_eos else tok.eos_token_id
    out = generate(built.model, torch.tensor([ids]), args.max_new_tokens, params, eos, agree)
    if built.is_main:
        text = tok.decode(out.tokens[0, len(ids):], skip_special_tokens=not args.show_special)
        print(args.prompt + text)
        per_tok = sum(out.decode_s) / max(1, len(out.decode_s))
        print(f"[{out.new_tokens} tokens; time to first token {out.ttft_s * 1e3:.1f} ms, "
              f"{per_tok * 1e3:.1f} ms per further token; tp={args.tp}, plan {built.plan.summary()}]",
              file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from syncdrop.parallel.sharding import ShardLayout, distilled_layouts
    from syncdrop.runtime import for_plan, prepare

    src, plan = prepare(args.model, args.tp, args.plan, args.drop_variant)
    cfg = src.config
    layout = ShardLayout.build(cfg, args.tp)
    distilled = sorted(src.spd.blocks) if src.spd is not None else []
    src = for_plan(src, plan)
    print(f"model {src.name} ({src.kind}: {src.path})")
    print(f"  {cfg.arch}: {cfg.num_layers} blocks, hidden {cfg.hidden_size}, heads {cfg.num_heads} "
          f"(kv {cfg.num_kv_heads}, dim {cfg.head_dim}), mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}")
    print(f"  TP={args.tp}: " + layout.describe())
    print(f"  plan: {plan.summary()}; all-reduces per forward: {len(plan.sync_points(cfg.hidden_size))} "
          f"({plan.comm_units(cfg.hidden_size):g} full all-reduce units)"
          + ("; plus one logits all-gather (vocab-parallel head)" if plan.needs_vocab_gather else ""))
    if src.spd is not None:
        print(f"  distilled for TP={src.spd.tp} from {src.spd.base_model}: blocks {distilled}; under this plan "
              f"blocks {sorted(src.spd.blocks)} run distilled, head-grouped {sorted(distilled_layouts(src.spd, cfg))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="syncdrop", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ppl", help="perplexity under a sync plan")
    add_model_args(p)
    p.add_argument("--dataset", default="auto",
                   help="auto (default: WikiText-2 test, else the Shakespeare tragedies) | wikitext2 | "
                        "wikitext2:valid | shakespeare | shakespeare:test | PATH")
    p.add_argument("--data-dir", default=None, help="data folder (default $SYNCDROP_DATA or ../shared/data)")
    p.add_argument("--seq-len", type=int, default=1024, help="window length in tokens (default 1024)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first K windows")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--stream", action="store_true",
                   help="hold one block's weights at a time, read from the checkpoint, and run every window "
                        "through a block before the next (memory: one block plus the windows' activations; "
                        "the same perplexity, bit for bit)")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("generate", help="generate text with a KV cache under a sync plan")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--show-special", action="store_true", help="print special tokens")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="time to first token and decode latency per plan (real ranks)")
    add_model_args(p)
    p.add_argument("--plans", default="none,all",
                   help="comma-separated plan specs (default none,all); `model` = the plan of a distilled --model")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions, at least (default 5)")
    p.add_argument("--max-reps", type=int, default=None,
                   help="keep repeating, up to this many reps, until every plan's median TTFT has a 95%% "
                        "interval within +-(--target-ci) (default: --reps, i.e. a fixed count)")
    p.add_argument("--target-ci", type=float, default=0.03,
                   help="relative half-width of the median TTFT interval to reach (default 0.03)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank, each rank pinned to its own cores (default: cores / ranks)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--engine", default="syncdrop", choices=["syncdrop", "vllm"],
                   help="syncdrop (default): syncdrop's runtime (--launch for --tp > 1); vllm: the plans served "
                        "in vLLM through the syncdrop plugin, one engine, link emulated inside vLLM's all-reduce")
    p.add_argument("--stock", action="store_true",
                   help="with --engine vllm: unmodified vLLM on the original architecture (plan none only)")
    p.add_argument("--work-dir", default="runs/vllm_bench",
                   help="with --engine vllm: where the served export and the engine log go (default runs/vllm_bench)")
    p.add_argument("--links", default=None,
                   help="interleave several emulated links in one run, e.g. none,inf+50us,100MB/s+50us (every rep "
                        "runs every plan on every link); --json OUT.json then writes OUT_<link>.json per link")
    p.add_argument("--dataset", default="auto", help="text the prompt is cut from (default auto)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None, help="write results JSON (and a .md table beside it)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_bench)

    from syncdrop.bench.predict import add_parser as add_predict_parser
    from syncdrop.eval.cli import add_eval_parser
    from syncdrop.spd.cli import add_distill_parser, add_plan_parser, add_profile_parser

    add_predict_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    add_distill_parser(sub)
    add_eval_parser(sub)
    from syncdrop.caat.cli import add_train_parser

    add_train_parser(sub)
    from syncdrop.auto.cli import add_auto_parser

    add_auto_parser(sub)
    from syncdrop.serve.cli import add_export_parser

    add_export_parser(sub)

    p = sub.add_parser("info", help="show a model's shape, the TP layout and a plan")
    add_model_args(p, distributed=False)
    p.set_defaults(func=cmd_info)
    return ap


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate cheaply here (so a usage error is printed once), then start --tp workers."""
    from syncdrop.parallel.launch import launch
    from syncdrop.runtime import prepare

    if getattr(args, "engine", "syncdrop") == "vllm":
        raise SyncdropError("--engine vllm starts vLLM's own ranks: drop --launch")
    source, _ = prepare(args.model, args.tp, getattr(args, "plan", None), args.drop_variant)
    cfg = source.config
    link_from_args(args)
    check_launch_devices(args.device, args.backend, args.tp)
    if hasattr(args, "plans"):
        plans_to_bench(args, source)
        links = _bench_links(args, link_from_args(args))
        for lk in [None] if links is None else [lk for _, lk in links]:
            _check_bench_link(args, cfg, lk)
    if args.dist_timeout <= 0:
        raise SyncdropError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    return launch([a for a in argv if a != "--launch"], args.tp, grace_s=min(args.dist_timeout, 30.0))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from syncdrop.parallel import dist

    code = 1
    try:
        if getattr(args, "launch", False) and not dist.launched_by_torchrun():
            code = getattr(args, "launch_func", _launch)(args, argv)
        else:
            code = args.func(args)
    except SyncdropError as e:
        print(f"syncdrop: error: {error_line(e)}", file=sys.stderr)
        code = 2
    except dist.RankFailure as e:
        print(f"syncdrop: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("syncdrop: interrupted", file=sys.stderr)
        code = 130
    finally:
        # the one way out of the distributed runtime (a no-op in a single process); an unexpected
        # exception still propagates after it, with its traceback
        code = _leave(code)
    return code


def _leave(code: int) -> int:
    """Shut the distributed runtime down (a barrier first when this rank succeeded); a rank that
    succeeded but whose peers never reached the final barrier exits 1 with the failure named."""
    from syncdrop.parallel import dist

    try:
        dist.shutdown(ok=code == 0)
    except dist.RankFailure as e:
        print(f"syncdrop: {e}", file=sys.stderr)
        return 1
    return code


def entry() -> None:
    """The ``syncdrop`` console script and ``python -m syncdrop``: :func:`main`, then exit. A
    distributed worker exits through :func:`syncdrop.parallel.dist.exit_worker` (no interpreter
    finalisation once the process group is gone)."""
    from syncdrop.parallel import dist

    code = main()
    if dist.launched_by_torchrun():
        dist.exit_worker(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
