"""Latency vs SPD fraction on real ranks: no emulation, then emulated links at given communication shares.

1. ``syncdrop bench --launch`` at SPD fractions ``--fractions`` (plans ``frac:F``) with no link
   emulation. From it: the time of plan none's sync points *measured inside its forward* (the
   slowest rank's time in each collective, ``sync_points.prefill_total_ms``) and the rest of its TTFT
   (compute).
2. For each target share ``s`` of ``--shares``: the emulated link (``--link-latency`` per ring step,
   bandwidth solved from the ring formula of :mod:`syncdrop.bench.ring`) whose extra wait per sync
   point makes in-forward communication ``s`` of plan none's TTFT, ``C = s / (1 - s) x compute``;
   bench again with it. Rank skew grows with the link, so the measured share can miss the target:
   with ``--refine`` (default) the link is corrected once from that run's own measurement and
   benched again (the final run is the one kept).
3. ``OUT/summary.json`` (every run, the links, target and measured shares), ``OUT/summary.md`` (per
   link: TTFT, TTFT / dense, decode and realised / ideal, each with its 95% interval; the TTFT cut at
   70% SPD beside the paper's 19.7%) and ``OUT/latency_vs_spd.png``.

    python benchmarks/latency_sweep.py --tp 2 --shares 0.55 --out results/operating_point/tp2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

PAPER_TTFT_CUT_AT_70 = 0.197  # SPD paper (arXiv:2502.20727): LLaMA2-70B, 8 GPUs, 70% SPD


def run_bench(args: argparse.Namespace, out: Path, bandwidth: float | None, latency_us: float | None) -> dict:
    if getattr(args, "reuse", False) and out.is_file():
        print("reusing", out, flush=True)
        return json.loads(out.read_text())
    cmd = [sys.executable, "-m", "syncdrop", "bench", "--launch", "--model", args.model, "--tp", str(args.tp),
           "--plans", ",".join(f"frac:{f:g}" for f in args.fractions), "--prompt-len", str(args.prompt_len),
           "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps), "--max-reps", str(args.max_reps),
           "--warmup", str(args.warmup), "--json", str(out), "-q"]
    if bandwidth is not None:
        cmd += ["--link-bandwidth", f"{bandwidth:.6g}B/s"]
    if latency_us:
        cmd += ["--link-latency", f"{latency_us:g}us"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def _none(run: dict) -> dict:
    return next(p for p in run["plans"] if p["plan"] == run["baseline_plan"])


def comm_share(run: dict) -> float:
    """In-forward communication of the baseline plan over its TTFT (medians)."""
    return run["sync_points"]["prefill_total_ms"] / _none(run)["ttft_ms"]


def extra_per_point_for_share(run: dict, share: float) -> float:
    """Seconds to add to each of the baseline's sync points so that in-forward communication becomes
    ``share`` of its TTFT, taking the rest of this run's TTFT as the compute (held fixed)."""
    sync_s = run["sync_points"]["prefill_total_ms"] / 1e3
    compute = _none(run)["ttft_ms"] / 1e3 - sync_s
    target = share / (1 - share) * compute
    return (target - sync_s) / len(run["sync_points"]["points"])


def bandwidth_for_extra(extra_s: float, n_bytes: float, tp: int, latency_s: float) -> float | None:
    """The bandwidth at which a ring all-reduce of ``n_bytes`` over ``tp`` ranks waits ``extra_s`` on top
    of its ``2 (tp - 1) latency_s`` (None when the latency alone already exceeds it)."""
    steps = 2 * (tp - 1)
    rest = extra_s - steps * latency_s
    return steps / tp * n_bytes / rest if rest > 0 else None


def _ci(x: list[float] | None, fmt: str) -> str:
    return "" if not x else " [" + fmt.format(x[0]) + ", " + fmt.format(x[1]) + "]"


def table(run: dict) -> list[str]:
    lines = ["| plan | SPD | TTFT ms | TTFT / dense | TTFT cut | decode ms/token | ideal saving ms (in forward) "
             "| realised / ideal | isolated-ideal ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(run["plans"], key=lambda r: r["spd_fraction"]):
        cut = 1 - r["ttft_over_baseline"]
        ratio = "-" if r["realised_over_ideal"] is None else (
            f"{r['realised_over_ideal']:.2f}{_ci(r['realised_over_ideal_ci'], '{:.2f}')}")
        lines.append(f"| {r['plan']} | {r['spd_fraction']:.0%} | {r['ttft_ms']:.1f}{_ci(r['ttft_ci_ms'], '{:.1f}')} | "
                     f"{r['ttft_over_baseline']:.3f}{_ci(r['ttft_over_baseline_ci'], '{:.3f}')} | {cut:.1%} | "
                     f"{r['decode_ms']:.1f}{_ci(r['decode_ci_ms'], '{:.1f}')} | {r['ideal_saving_ms']:.1f} | {ratio} | "
                     f"{r['ideal_saving_isolated_ms']:.1f} |")
    return lines


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, run in runs.items():
        rows = sorted(run["plans"], key=lambda r: r["spd_fraction"])
        f = [r["spd_fraction"] * 100 for r in rows]
        label = f"{name} ({run['settings']['link_description']})"
        for ax, key in ((axes[0], "ttft"), (axes[1], "decode")):
            y = [r[f"{key}_ms"] for r in rows]
            err = [[r[f"{key}_ms"] - r[f"{key}_ci_ms"][0] for r in rows], [r[f"{key}_ci_ms"][1] - r[f"{key}_ms"]
                                                                            for r in rows]]
            ax.errorbar(f, y, yerr=err, marker="o", capsize=3, label=label)
        eff = [(x, r) for x, r in zip(f, rows, strict=True) if r["realised_over_ideal"] is not None]
        if eff:
            y = [r["realised_over_ideal"] for _, r in eff]
            ci = [r["realised_over_ideal_ci"] or [v, v] for (_, r), v in zip(eff, y, strict=True)]
            axes[2].errorbar([x for x, _ in eff], y, yerr=[[v - c[0] for v, c in zip(y, ci, strict=True)],
                                                           [c[1] - v for v, c in zip(y, ci, strict=True)]],
                             marker="o", capsize=3, label=label)
    axes[0].set(xlabel="SPD fraction (%)", ylabel="time to first token (ms)", title="prefill (95% intervals)")
    axes[1].set(xlabel="SPD fraction (%)", ylabel="ms per decode step", title="decode (95% intervals)")
    axes[2].set(xlabel="SPD fraction (%)", ylabel="realised / ideal (in-forward ideal)", title="TTFT saving efficiency")
    axes[2].axhline(1.0, color="grey", ls="--", lw=0.8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7, help="minimum interleaved reps per bench")
    ap.add_argument("--max-reps", type=int, default=20, help="maximum reps (stops earlier at +-3%% intervals)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--fractions", default="0,0.25,0.5,0.7,1", help="SPD fractions (plans frac:F)")
    ap.add_argument("--shares", default="0.55", help="target in-forward communication shares of plan none's TTFT")
    ap.add_argument("--link-latency", type=float, default=50.0, help="emulated per-step latency, microseconds")
    ap.add_argument("--links", default=None,
                    help="explicit emulated links instead of --shares, e.g. 30MB/s,100MB/s (each at --link-latency): "
                         "where the share cannot be targeted (TP=3 on 2 cores: rank skew alone exceeds it)")
    ap.add_argument("--reuse", action="store_true", help="read a run's JSON back when it exists instead of rerunning")
    ap.add_argument("--no-refine", dest="refine", action="store_false",
                    help="do not correct the link once from the emulated run's own measured share")
    ap.add_argument("--out", default="results/operating_point/tp2")
    args = ap.parse_args()
    args.fractions = [float(x) for x in args.fractions.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lat = args.link_latency * 1e-6
    stems = {"no emulation": f"tp{args.tp}_none"}
    runs = {"no emulation": run_bench(args, out / f"{stems['no emulation']}.json", None, None)}
    links: dict[str, dict] = {"no emulation": {"target_share": None}}
    nbytes = runs["no emulation"]["allreduce"]["prefill"]["bytes"]
    from syncdrop.bench.ring import parse_bandwidth

    for text in (args.links.split(",") if args.links else []):
        bw = parse_bandwidth(text)
        name = f"{text.strip()} link"
        stems[name] = f"tp{args.tp}_{text.strip().replace('/', 'p')}"
        runs[name] = run_bench(args, out / f"{stems[name]}.json", bw, args.link_latency)
        links[name] = {"target_share": None, "bandwidth_Bps": bw, "latency_us": args.link_latency}
    for share in ((float(s) for s in args.shares.split(",")) if not args.links else ()):
        name = f"comm {share:.0%}"
        stems[name] = f"tp{args.tp}_share{round(share * 100)}"
        extra = extra_per_point_for_share(runs["no emulation"], share)
        bw = bandwidth_for_extra(extra, nbytes, args.tp, lat)
        tries = [{"bandwidth_Bps": bw}]
        run = run_bench(args, out / f"{stems[name]}.json", bw, args.link_latency)
        tries[-1]["measured_share"] = comm_share(run)
        if args.refine and bw is not None and abs(comm_share(run) - share) > 0.05:
            # what this link added per point, plus what is still missing at its own compute
            added = bw and (2 * (args.tp - 1) * lat + 2 * (args.tp - 1) / args.tp * nbytes / bw)
            bw = bandwidth_for_extra(added + extra_per_point_for_share(run, share), nbytes, args.tp, lat)
            tries.append({"bandwidth_Bps": bw})
            run = run_bench(args, out / f"{stems[name]}.json", bw, args.link_latency)
            tries[-1]["measured_share"] = comm_share(run)
        runs[name] = run
        links[name] = {"target_share": share, "bandwidth_Bps": bw, "latency_us": args.link_latency, "tries": tries}
    for name, run in runs.items():
        links[name]["measured_share"] = comm_share(run)
    lines = [f"{args.model}, TP={args.tp}, prompt {args.prompt_len} tokens, {args.decode_tokens} decode tokens; "
             f"medians over interleaved reps with 95% bootstrap intervals; plans `frac:F` drop the last F of blocks. "
             "Communication share = plan none's sync points timed inside its forward (slowest rank) / its TTFT.", ""]
    for name, run in runs.items():
        r70 = next((r for r in run["plans"] if abs(r["spd_fraction"] - 0.7) < 0.02), None)
        share = links[name]["measured_share"]
        lines += [f"### {name}: {run['settings']['link_description']} (communication {share:.0%} "
                  f"of plan none's TTFT; {run['reps_run']} reps"
                  + ("" if run["converged"] else ", intervals not all within +-3% at the rep limit") + ")", ""]
        lines += table(run)
        if r70 is not None:
            lines += ["", f"At {r70['spd_fraction']:.0%} SPD: TTFT cut {1 - r70['ttft_over_baseline']:.1%} "
                      f"(paper: {PAPER_TTFT_CUT_AT_70:.1%} for LLaMA2-70B on 8 GPUs)."]
        lines.append("")
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    atomic_write_json(out / "summary.json", {"provenance": provenance(), "command": sys.argv, "links": links,
                                             "runs": runs})
    plot(runs, out / "latency_vs_spd.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
