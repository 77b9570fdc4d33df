"""Latency vs SPD fraction on real ranks, with no emulation and two emulated slow links.

1. ``syncdrop bench --launch`` at SPD fractions 0, 0.25, 0.5, 0.75, 1 (plans ``frac:F``) with no
   link emulation; from it, the compute time of a prefill (TTFT of plan none minus its measured
   all-reduce time) and one all-reduce's time.
2. Two emulated links whose bandwidth is chosen so that communication is ``--shares`` (default 30%
   and 55%) of the prefill time of plan none, at ``--link-latency``; bench again with each.
3. ``OUT/summary.json`` (all three runs and the chosen links), ``OUT/summary.md`` and
   ``OUT/latency_vs_spd.png``.

    python benchmarks/latency_sweep.py --tp 2 --prompt-len 256 --decode-tokens 16 --reps 7 --out results/latency
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

FRACTIONS = [0.0, 0.25, 0.5, 0.75, 1.0]


def run_bench(args: argparse.Namespace, out: Path, bandwidth: float | None, latency_us: float | None) -> dict:
    cmd = [sys.executable, "-m", "syncdrop", "bench", "--launch", "--model", args.model, "--tp", str(args.tp),
           "--plans", ",".join(f"frac:{f:g}" for f in FRACTIONS), "--prompt-len", str(args.prompt_len),
           "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps), "--json", str(out), "-q"]
    if bandwidth is not None:
        cmd += ["--link-bandwidth", f"{bandwidth:.6g}B/s"]
    if latency_us:
        cmd += ["--link-latency", f"{latency_us:g}us"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def link_for_share(base: dict, share: float, latency_s: float) -> float | None:
    """Bandwidth (B/s) making communication ``share`` of plan none's prefill time, or None if the
    measured link is already that slow."""
    L = base["settings"]["num_layers"]
    none = next(p for p in base["plans"] if p["dropped"] == 0)
    t_ar = base["allreduce"]["prefill"]["median_ms"] / 1e3
    nbytes = base["allreduce"]["prefill"]["bytes"]
    compute = none["ttft_ms"] / 1e3 - 2 * L * t_ar
    per_ar = share / (1 - share) * compute / (2 * L)  # target seconds per all-reduce
    extra = per_ar - t_ar - latency_s
    return nbytes / extra if extra > 0 else None


def comm_share(run: dict) -> float:
    L = run["settings"]["num_layers"]
    none = next(p for p in run["plans"] if p["dropped"] == 0)
    return 2 * L * run["allreduce"]["prefill"]["median_ms"] / none["ttft_ms"]


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, run in runs.items():
        rows = sorted(run["plans"], key=lambda r: r["spd_fraction"])
        f = [r["spd_fraction"] * 100 for r in rows]
        label = f"{name} ({run['settings']['link_description']})"
        axes[0].plot(f, [r["ttft_ms"] for r in rows], "o-", label=label)
        axes[1].plot(f, [r["decode_ms"] for r in rows], "o-", label=label)
        eff = [(x, r["realised_over_ideal"]) for x, r in zip(f, rows, strict=True) if r["realised_over_ideal"]]
        axes[2].plot([x for x, _ in eff], [y for _, y in eff], "o-", label=label)
    axes[0].set(xlabel="SPD fraction (%)", ylabel="time to first token (ms)", title="prefill")
    axes[1].set(xlabel="SPD fraction (%)", ylabel="ms per decode step", title="decode")
    axes[2].set(xlabel="SPD fraction (%)", ylabel="realised / ideal saving", title="TTFT saving efficiency")
    axes[2].axhline(0.8, color="grey", ls="--", lw=0.8)
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
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shares", default="0.30,0.55", help="target communication shares of prefill")
    ap.add_argument("--link-latency", type=float, default=50.0, help="emulated latency in microseconds")
    ap.add_argument("--out", default="results/latency")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stems = {"no emulation": f"tp{args.tp}_none"}
    runs = {"no emulation": run_bench(args, out / f"{stems['no emulation']}.json", None, None)}
    links: dict[str, dict] = {}
    for share in (float(s) for s in args.shares.split(",")):
        bw = link_for_share(runs["no emulation"], share, args.link_latency * 1e-6)
        name = f"comm {share:.0%}"
        links[name] = {"target_share": share, "bandwidth_Bps": bw, "latency_us": args.link_latency}
        stems[name] = f"tp{args.tp}_share{round(share * 100)}"
        runs[name] = run_bench(args, out / f"{stems[name]}.json", bw, args.link_latency)
    for name, run in runs.items():
        links.setdefault(name, {})["measured_share"] = comm_share(run)
    lines = [f"SmolLM2, TP={args.tp}, prompt {args.prompt_len} tokens, {args.decode_tokens} decode tokens, "
             f"median of {args.reps} interleaved repetitions; plans `frac:F` drop the last F of blocks.", ""]
    for name, run in runs.items():
        lines += [f"### {name}: {run['settings']['link_description']} (communication = "
                  f"{links[name]['measured_share']:.0%} of plan none's TTFT, measured)", ""]
        lines.append((out / f"{stems[name]}.md").read_text().strip())
        lines.append("")
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    atomic_write_json(out / "summary.json", {"provenance": provenance(), "links": links, "runs": runs})
    plot(runs, out / "latency_vs_spd.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
