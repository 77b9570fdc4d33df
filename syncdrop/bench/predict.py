"""``syncdrop predict``: the analytical cost model (:mod:`syncdrop.bench.cost`) from the CLI.

Two jobs, in one call or separately:

* ``--calibrate NOEMUL.json [...] [--check EMUL.json ...]``: fit alpha/beta and the compute rate to
  bench files run *without* link emulation, then predict every plan's TTFT (and decode step) of
  the ``--check`` files, emulated link added, and print predicted vs measured;
* ``--cluster llama2-70b --gpus 8 --links 300GB/s,50GB/s,10GB/s --prompt-lens 128,2048``: TTFT,
  decode-step and end-to-end latency for SPD 0..100% on a cluster of the default hardware profile
  (:data:`~syncdrop.bench.cost.cluster.HARDWARE_PROFILES`: A100-80GB, bf16), ``--peak-tflops``,
  ``--mfu``, ``--hbm`` and ``--layer-overhead`` overriding its numbers.

``--json OUT`` writes everything (with provenance) and a Markdown report ``OUT.md`` beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from syncdrop.bench.cost.arch import MODELS, get_model
from syncdrop.bench.cost.bench_files import load_bench
from syncdrop.bench.cost.check import check, check_summary
from syncdrop.bench.cost.cluster import (
    DEFAULT_PROFILE,
    HARDWARE_PROFILES,
    PAPER_POINT,
    ClusterLink,
    cluster_predict,
    default_alpha,
    paper_comparison,
)
from syncdrop.bench.cost.fit import Calibration, calibrate
from syncdrop.errors import SyncdropError

DEFAULT_LINKS = "300GB/s,50GB/s,10GB/s"
GPU = HARDWARE_PROFILES[DEFAULT_PROFILE]  # the numbers --peak-tflops, --mfu, --hbm, --layer-overhead default to


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``predict`` subcommand on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser("predict", help="analytical latency model: calibrate on bench files, predict clusters",
                              description="Analytical latency model of TP inference: calibrate on `syncdrop "
                                          "bench` files and check emulated-link runs, and/or predict a cluster.")
    g = p.add_argument_group("calibration on this machine")
    g.add_argument("--calibrate", nargs="+", default=[], metavar="BENCH.json",
                   help="bench results run WITHOUT link emulation to fit alpha/beta and the compute rate")
    g.add_argument("--check", nargs="+", default=[], metavar="BENCH.json",
                   help="bench results (usually emulated links) whose TTFT is predicted and compared")
    g.add_argument("--no-overhead", action="store_true", help="do not fit a per-layer compute overhead")
    g.add_argument("--no-sync", action="store_true", help="do not fit a per-sync-point overhead")
    g.add_argument("--tolerance", type=float, default=0.15, help="target |relative error| of TTFT (default 0.15)")
    g = p.add_argument_group("cluster prediction")
    g.add_argument("--cluster", default=None, metavar="MODEL", help=f"one of {', '.join(MODELS)}")
    g.add_argument("--gpus", type=int, default=8, help="tensor-parallel ranks (default 8)")
    g.add_argument("--links", default=DEFAULT_LINKS,
                   help="comma-separated link bandwidths, each optionally @alpha, e.g. 10GB/s@10us "
                        f"(default {DEFAULT_LINKS}; alpha by class: NVLink 1.5us, IB 5us, PCIe 10us)")
    g.add_argument("--prompt-lens", default="128,2048", help="comma-separated prompt lengths (default 128,2048)")
    g.add_argument("--batch", type=int, default=1, help="sequences per forward (default 1)")
    g.add_argument("--spd-step", type=float, default=0.1, help="SPD fractions 0, step, ..., 1 (default 0.1)")
    g.add_argument("--peak-tflops", type=float, default=GPU.peak_flops / 1e12,
                   help=f"per-GPU dense peak (default {GPU.peak_flops / 1e12:g}, {DEFAULT_PROFILE})")
    g.add_argument("--mfu", type=float, default=GPU.mfu,
                   help=f"fraction of peak when compute-bound (default {GPU.mfu:g})")
    g.add_argument("--hbm", default=f"{GPU.hbm_bw / 1e12:g}TB/s",
                   help=f"effective HBM bandwidth per GPU (default {GPU.hbm_bw / 1e12:g}TB/s)")
    g.add_argument("--layer-overhead", default=f"{GPU.layer_overhead_s * 1e6:g}us",
                   help=f"fixed time per block, e.g. 20us (default {GPU.layer_overhead_s * 1e6:g}us)")
    g.add_argument("--gen-tokens", type=int, default=128,
                   help="tokens generated for the end-to-end column (default 128)")
    p.add_argument("--json", default=None, help="write results JSON (and a .md report beside it)")
    p.set_defaults(func=cmd_predict)
    return p


def parse_links(text: str) -> list[ClusterLink]:
    """``'300GB/s,10GB/s@10us'`` -> links; alpha defaults by bandwidth class."""
    from syncdrop.bench.ring import parse_bandwidth, parse_latency

    out = []
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SyncdropError(f"--links {text!r}: give at least one bandwidth, e.g. 10GB/s")
    for item in items:
        bw_text, _, alpha_text = item.partition("@")
        try:
            beta = parse_bandwidth(bw_text)
            alpha = parse_latency(alpha_text) if alpha_text else default_alpha(beta)[0]
        except SyncdropError as e:
            raise SyncdropError(f"--links {item!r}: {str(e).split(': ', 1)[-1]}") from None
        out.append(ClusterLink(item, beta, alpha))
    return out


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SyncdropError(f"{flag} {text!r}: expected comma-separated positive integers") from None
    if not vals or min(vals) < 1:
        raise SyncdropError(f"{flag} {text!r}: expected comma-separated positive integers")
    return vals


def _fractions(step: float) -> list[float]:
    if not 0 < step <= 1:
        raise SyncdropError(f"--spd-step must be in (0, 1], got {step}")
    n = round(1 / step)
    if abs(n * step - 1) > 1e-9:
        raise SyncdropError(f"--spd-step {step} must divide 1 (e.g. 0.1, 0.25)")
    return [round(i * step, 10) for i in range(n + 1)]


def _pct(x: float) -> str:
    return f"{x * 100 + 0.0:+.1f}%"


def _drop(reduction: float) -> str:
    """A reduction as a signed change, ``0.298 -> '-29.8%'``."""
    v = -reduction * 100
    return f"{(0.0 if abs(v) < 0.05 else v):+.1f}%"


def _collectives_cell(row: dict[str, Any]) -> str:
    """The ``AR/fwd`` cell of a check row: the plan's all-reduces per forward, and its payload in
    full-all-reduce units when some syncs are partial (``8 (2.0 units)``)."""
    n, u = row["allreduces_per_forward"], row.get("comm_units")
    if n is None:
        return "-"
    return str(n) if u is None or u == n else f"{n} ({u:.1f} units)"


def _check_markdown(cal: Calibration, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    c = cal.compute
    lines = ["## Calibration (runs without link emulation)", "",
             f"Files: {', '.join(cal.files)}", "",
             f"- all-reduce: alpha = {cal.alpha * 1e6:.1f} us, beta = {cal.beta / 1e6:.1f} MB/s "
             f"({cal.allreduce_points} timings); in a forward each sync point costs "
             f"{cal.sync_s * 1e3:.3f} ms more",
             f"- compute: F_eff = {c.flops_per_s / 1e9:.2f} GFLOP/s per rank, per-layer overhead "
             f"{c.layer_overhead_s * 1e3:.3f} ms ({cal.compute_points} points)",
             *([f"- codec (compressed sync points): {cal.codec_s * 1e3:.3f} ms per sync point + "
                f"{cal.codec_s_per_byte * 1e9:.3f} ms per MB of its payload"] if cal.codec_s or cal.codec_s_per_byte
               else []),
             *[f"- fit note: {n}" for n in cal.fit_notes], "",
             "## Predicted vs measured", "",
             "| link | S | what | plan | SPD | AR/fwd | measured ms | predicted ms | error |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        spd = "-" if r["spd_fraction"] is None else f"{r['spd_fraction']:.0%}"
        n = _collectives_cell(r)
        tag = " (fit)" if r["calibration"] else ""
        lines.append(f"| {r['link']}{tag} | {r['prompt_len']} | {r['what']} | {r['plan']} | {spd} | {n} | "
                     f"{r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | {_pct(r['rel_err'])} |")
    lines.append("")
    for name, label in (("heldout_ttft", "held-out TTFT"), ("calibration_ttft", "calibration TTFT")):
        s = summary[name]
        if s["n"]:
            ok = "within" if s["within_tolerance"] else "NOT within"
            lines.append(f"- {label}: {s['n']} predictions, max |error| {s['max_abs_rel_err']:.1%}, median "
                         f"{s['median_abs_rel_err']:.1%} ({ok} {summary['tolerance']:.0%})")
    return "\n".join(lines) + "\n"


def _cluster_markdown(res: dict[str, Any]) -> str:
    rows, spec = res["rows"], res["assumptions"]
    links = list(dict.fromkeys(r["link"] for r in rows))
    lens = list(dict.fromkeys(r["prompt_len"] for r in rows))
    alphas = {r["link"]: r["alpha_s"] for r in rows}
    lines = [f"## Cluster: {res['model']} on {res['gpus']} GPUs", "",
             f"Assumptions: peak {spec['peak_flops'] / 1e12:.0f} TFLOP/s x MFU {spec['mfu']:.0%} when compute-bound, "
             f"HBM {spec['hbm_bw'] / 1e12:.2f} TB/s effective (roofline), per-layer overhead "
             f"{spec['layer_overhead_s'] * 1e6:.0f} us, {spec['dtype_bytes']}-byte payloads, batch {res['batch']}, "
             "flat ring all-reduce; alpha per link: "
             + ", ".join(f"{k} {v * 1e6:g} us" for k, v in alphas.items()) + ".", ""]
    for S in lens:
        sub = [r for r in rows if r["prompt_len"] == S]
        m = sub[0]
        lines += [f"### Prompt {S} tokens (prefill MFU {m['prefill_mfu']:.0%}, decode MFU {m['decode_mfu']:.2%})", "",
                  "| SPD | AR/fwd | " + " | ".join(f"TTFT ms {lk} | vs 0%" for lk in links) + " |",
                  "|---:|---:|" + "---:|---:|" * len(links)]
        fracs = list(dict.fromkeys(r["spd_fraction"] for r in sub))
        for f in fracs:
            cells = []
            n = None
            for lk in links:
                r = next(x for x in sub if x["link"] == lk and x["spd_fraction"] == f)
                n = r["allreduces_per_forward"]
                cells.append(f"{r['ttft_ms']:.1f} | {_drop(r['ttft_reduction'])}")
            lines.append(f"| {f:.0%} | {n} | " + " | ".join(cells) + " |")
        lines += ["", "Communication share of TTFT at SPD 0%: "
                  + ", ".join(f"{lk} {next(x for x in sub if x['link'] == lk)['ttft_comm_share']:.0%}" for lk in links),
                  ""]
    gen = res["gen_tokens"]
    lines += [f"### Decode step and end-to-end latency (TTFT + {gen - 1} decode steps)", "",
              "| link | S | decode ms @0% | decode Δ @70% | e2e ms @0% | e2e Δ @70% | TTFT Δ @70% |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for lk in links:
        for S in lens:
            r0 = next(x for x in rows if x["link"] == lk and x["prompt_len"] == S and x["spd_fraction"] == 0)
            r7 = [x for x in rows if x["link"] == lk and x["prompt_len"] == S and abs(x["spd_fraction"] - 0.7) < 1e-9]
            d = {k: _drop(r7[0][k]) if r7 else "-" for k in ("decode_reduction", "e2e_reduction", "ttft_reduction")}
            lines.append(f"| {lk} | {S} | {r0['decode_ms']:.2f} | {d['decode_reduction']} | {r0['e2e_ms']:.0f} | "
                         f"{d['e2e_reduction']} | {d['ttft_reduction']} |")
    if res["paper"]:
        lines += ["", "### Beside the paper", "",
                  f"Paper: {PAPER_POINT['latency_reduction']:.1%} lower latency at 70% SPD, LLaMA2-70B, 8 GPUs, "
                  "10 GB/s. Model at 70% SPD on the closest link:", ""]
        for r in res["paper"]:
            lines.append(f"- {r['link']}, prompt {r['prompt_len']}: TTFT {r['ttft_reduction']:.1%} lower, decode step "
                         f"{r['decode_reduction']:.1%}, end-to-end {r['e2e_reduction']:.1%}; communication is "
                         f"{r['ttft_comm_share']:.0%} of TTFT at SPD 0% here, the paper's figure implies "
                         f"{r['paper_implied_comm_share']:.0%} of its latency")
    return "\n".join(lines) + "\n"


def cmd_predict(args: argparse.Namespace) -> int:
    from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

    if args.check and not args.calibrate:
        raise SyncdropError("--check needs --calibrate NOEMUL.json to fit the model first")
    if not args.calibrate and not args.cluster:
        raise SyncdropError("predict needs --calibrate BENCH.json (with --check ...) and/or --cluster MODEL")
    if not 0 < args.tolerance < 1:
        raise SyncdropError(f"--tolerance must be in (0, 1), got {args.tolerance}")
    out: dict[str, Any] = {"provenance": provenance()}
    md = ["# syncdrop cost model", ""]

    if args.calibrate:
        cal_runs = [load_bench(p, "--calibrate") for p in args.calibrate]
        check_runs = [load_bench(p, "--check") for p in args.check]
        cal = calibrate(cal_runs, fit_overhead=not args.no_overhead, fit_sync=not args.no_sync)
        rows = check(cal, cal_runs + check_runs)
        summary = check_summary(rows, args.tolerance)
        notes = []
        for r in check_runs:
            ref = cal_runs[0]
            diffs = [k for k in ("tp", "model", "dtype_bytes", "threads_per_rank") if getattr(r, k) != getattr(ref, k)]
            if diffs:
                notes.append(f"{r.path}: differs from the calibration run in {', '.join(diffs)}")
        out["calibration"] = cal.to_dict()
        out["check"] = {"rows": rows, "summary": summary, "notes": notes}
        text = _check_markdown(cal, rows, summary) + "".join(f"\nNote: {n}\n" for n in notes)
        print(text)
        md.append(text)

    if args.cluster:
        from syncdrop.bench.ring import parse_bandwidth, parse_latency

        cfg = get_model(args.cluster)
        if args.gpus < 1:
            raise SyncdropError(f"--gpus must be at least 1, got {args.gpus}")
        if args.batch < 1:
            raise SyncdropError(f"--batch must be at least 1, got {args.batch}")
        if not 0 < args.mfu <= 1:
            raise SyncdropError(f"--mfu must be in (0, 1], got {args.mfu}")
        if args.peak_tflops <= 0:
            raise SyncdropError(f"--peak-tflops must be positive, got {args.peak_tflops}")
        if args.gen_tokens < 1:
            raise SyncdropError(f"--gen-tokens must be at least 1, got {args.gen_tokens}")
        links = parse_links(args.links)
        lens = _int_list(args.prompt_lens, "--prompt-lens")
        try:
            hbm = parse_bandwidth(args.hbm)
        except SyncdropError:
            raise SyncdropError(f"--hbm {args.hbm!r}: expected a rate like 1.5TB/s") from None
        try:
            overhead = parse_latency(args.layer_overhead)
        except SyncdropError:
            raise SyncdropError(f"--layer-overhead {args.layer_overhead!r}: expected a duration like 20us") from None
        spec = dataclasses.replace(GPU, peak_flops=args.peak_tflops * 1e12, mfu=args.mfu, hbm_bw=hbm,
                                   layer_overhead_s=overhead)
        rows = cluster_predict(cfg, args.gpus, links, lens, _fractions(args.spd_step), spec, args.batch,
                               args.gen_tokens)
        res = {"model": args.cluster.lower(), "gpus": args.gpus, "batch": args.batch, "gen_tokens": args.gen_tokens,
               "assumptions": spec.to_dict(),
               "links": [{"label": lk.label, "beta_Bps": lk.beta, "alpha_s": lk.alpha,
                          "class": default_alpha(lk.beta)[1]} for lk in links],
               "rows": rows, "paper": paper_comparison(rows, cfg.num_layers), "paper_point": PAPER_POINT}
        out["cluster"] = res
        text = _cluster_markdown(res)
        print(text)
        md.append(text)

    if args.json:
        atomic_write_json(args.json, out)
        atomic_write_text(args.json.removesuffix(".json") + ".md", "\n".join(md))
    return 0
