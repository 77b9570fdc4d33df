"""Forward time of the simulated executor under several plans, this tree against another checkout,
interleaved (A B A B ...), to show that a change of code left speed alone.

Each tree runs in a worker process of its own (``PYTHONPATH`` set to that tree) that loads the
model once and then times one forward per request; the driver alternates the requests, so both
trees see the same machine state and only one computes at a time. Writes ``OUT.json`` (settings,
provenance of both trees, raw samples, medians, the B/A ratio of medians with a paired bootstrap
95% interval per plan) and ``OUT.md``. Example::

    git worktree add /tmp/before <commit>
    python benchmarks/tree_ab.py --other /tmp/before --out results/plan_parity/timing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from syncdrop.bench.stats import bootstrap_ci
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

WORKER = r"""
import json, sys, time, torch
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import parse_plan
src = resolve_model("smollm2")
cfg = src.config
model = simulated_model(cfg, src.reader.get, TP)
ids = torch.randint(0, cfg.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    model.plan = parse_plan(line.strip(), cfg.num_layers)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids)
        dt = time.perf_counter() - t0
    print(json.dumps({"s": dt}), flush=True)
"""


def start(root: str, tp: int, tokens: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": root}
    code = WORKER.replace("TP", str(tp)).replace("TOKENS", str(tokens))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env, cwd=root)
    assert json.loads(p.stdout.readline()).get("ready")
    return p


def ask(p: subprocess.Popen, plan: str) -> float:
    p.stdin.write(plan + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())["s"]


def tree_commit(root: str) -> str:
    r = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=40"], capture_output=True,
                       text=True)
    return r.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="the other checkout (A); this tree is B")
    ap.add_argument("--plans", default="none,frac:0.5,all,partial:0.5")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    plans = args.plans.split(",")
    workers = {"A": start(args.other, args.tp, args.tokens), "B": start(here, args.tp, args.tokens)}
    samples = {f"{t} {pl}": [] for pl in plans for t in "AB"}
    for rep in range(args.warmup + args.reps):
        for pl in plans:
            for t in ("AB" if rep % 2 == 0 else "BA"):
                s = ask(workers[t], pl)
                if rep >= args.warmup:
                    samples[f"{t} {pl}"].append(s)
        print(f"rep {rep + 1}/{args.warmup + args.reps}", file=sys.stderr, flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    rows = []
    for pl in plans:
        a, b = samples[f"A {pl}"], samples[f"B {pl}"]
        ratio = statistics.median(b) / statistics.median(a)
        ci = bootstrap_ci(lambda idx, a=a, b=b: statistics.median([b[i] for i in idx])
                          / statistics.median([a[i] for i in idx]), len(a))
        rows.append({"plan": pl, "median_a_s": statistics.median(a), "median_b_s": statistics.median(b),
                     "ratio_b_over_a": ratio, "ci95": ci})
    settings = {"tp": args.tp, "tokens": args.tokens, "reps": args.reps, "warmup": args.warmup,
                "model": "smollm2", "executor": "simulated", "dtype": "float32",
                "a": {"commit": tree_commit(args.other)}, "b": {"commit": tree_commit(here)}}
    atomic_write_json(args.out + ".json", {"command": "python benchmarks/tree_ab.py " + " ".join(sys.argv[1:]),
                                           "settings": settings, "provenance": provenance(), "samples_s": samples,
                                           "rows": rows})
    lines = [f"SmolLM2 forward, simulated executor TP={args.tp}, 1 x {args.tokens} tokens, fp32, medians of "
             f"{args.reps} interleaved reps; A = {settings['a']['commit'][:12]}, B = {settings['b']['commit'][:12]}.",
             "", "| plan | A median (s) | B median (s) | B / A [95% interval] |", "|---|---:|---:|---:|"]
    for r in rows:
        ci = r["ci95"]
        lines.append(f"| {r['plan']} | {r['median_a_s']:.3f} | {r['median_b_s']:.3f} | {r['ratio_b_over_a']:.3f} "
                     + (f"[{ci[0]:.3f}, {ci[1]:.3f}] |" if ci else "|"))
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
