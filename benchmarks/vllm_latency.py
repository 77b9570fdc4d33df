"""SPD plans served in vLLM vs stock vLLM vs syncdrop's own runtime, on one emulated link, in one run.

1. ``syncdrop bench --engine vllm``: the plans ``frac:F`` through the syncdrop plugin, one vLLM engine per
   plan compiled as vLLM serves by default (a compiled engine cannot switch plans), the link emulated inside
   vLLM's all-reduce with the sync clock off; then a diagnostic engine measures the ideal saving inside
   vLLM's forward (:mod:`syncdrop.serve.vllm_bench`).
2. ``syncdrop bench --engine vllm --stock``: unmodified vLLM (original architecture), plan none, same link.
3. ``syncdrop bench --launch``: the same plans in syncdrop's runtime (gloo), same link.

The three parts run one after another. syncdrop's runtime interleaves its plans rep by rep, so the ratios
inside that part are paired; vLLM's plans run in engines one after another, so there, as across parts, only
medians compare. Writes ``OUT/<part>.json`` (+ ``.md``), ``OUT/summary.json`` and ``OUT/summary.md``.

    python benchmarks/vllm_latency.py --tp 3 --link-bandwidth 100MB/s --link-latency 50us --out results/vllm_latency
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from syncdrop.bench.stats import median_ratio_ci
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance


def bench(args: argparse.Namespace, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "syncdrop", "bench", "--model", args.model, "--tp", str(args.tp),
           "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps),
           "--max-reps", str(args.max_reps), "--warmup", str(args.warmup), "--link-bandwidth", args.link_bandwidth,
           "--link-latency", args.link_latency, "--json", str(out), "-q", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def make_synthetic(path: Path) -> None:
    """SmolLM2's depth, MLP and vocabulary with 8 heads of 64 (transformers' own N(0, 0.02) initialisation)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from syncdrop.tiny_models import tiny_tokenizer

    cfg = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=1e5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def _row(res: dict, plan: str) -> dict:
    return next(r for r in res["plans"] if r["plan"] == plan)


def _ci(c, fmt="{:.1f}") -> str:
    return "" if not c else f" [{fmt.format(c[0])}, {fmt.format(c[1])}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--fractions", default="0,0.25,0.5,0.7,1", help="SPD fractions: plans frac:F (unless --plans)")
    ap.add_argument("--plans", default=None,
                    help="comma-separated plan specs instead of --fractions, the first the dense reference, e.g. "
                         "none,bf16,frac:0.7,int8,frac:0.7+int8 (compressed sync points: docs/compression.md)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--link-bandwidth", default="100MB/s")
    ap.add_argument("--link-latency", default="50us")
    ap.add_argument("--out", default="results/vllm_latency")
    ap.add_argument("--parts", default="vllm,stock,syncdrop",
                    help="parts to (re)run; the others are read back ('' rewrites the summary only)")
    ap.add_argument("--synthetic", action="store_true",
                    help="--model is a directory to create (if absent) holding a random-weight Llama with SmolLM2's "
                         "widths but 8 query / 4 KV heads of 64 (hidden 512), which vLLM can shard at TP=2; latency "
                         "does not depend on the weights")
    args = ap.parse_args()
    if args.synthetic and not Path(args.model).exists():
        make_synthetic(Path(args.model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans = args.plans or ",".join(f"frac:{f}" for f in args.fractions.split(","))
    first = plans.split(",")[0]
    parts = [p for p in args.parts.split(",") if p]
    runs = {}
    argv = {"vllm": ["--engine", "vllm", "--plans", plans], "stock": ["--engine", "vllm", "--stock", "--plans", "none"],
            "syncdrop": ["--launch", "--plans", plans]}
    for part, extra in argv.items():  # parts not rerun are read back from their files, when there
        if part in parts:
            runs[part] = bench(args, out / f"{part}.json", extra)
        elif (out / f"{part}.json").is_file():
            runs[part] = json.loads((out / f"{part}.json").read_text())
    lines = [f"{args.model}, TP={args.tp}, prompt {args.prompt_len} tokens, {args.decode_tokens} decode tokens, link "
             f"{args.link_bandwidth} + {args.link_latency} per ring step (emulated); medians with 95% bootstrap "
             "intervals; syncdrop's runtime interleaves its plans rep by rep, vLLM runs one compiled engine per "
             "plan, one after another; the runtimes ran one after another.", "",
             "| runtime | plan | TTFT ms | TTFT / own dense | decode ms/token | in-forward comm of dense ms | "
             "ideal saving ms (in forward) | realised / ideal | "
             "realised / isolated all-reduce time (a diagnostic, not a bound) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in runs.items():
        comm = res["sync_points"]["prefill_total_ms"]
        for r in res["plans"]:
            rr, ri = r.get("realised_over_ideal"), r.get("realised_over_isolated_ideal")
            lines.append(f"| {name} | {r['plan']} | {r['ttft_ms']:.1f}{_ci(r['ttft_ci_ms'])} | "
                         f"{r['ttft_over_baseline']:.3f}{_ci(r.get('ttft_over_baseline_ci'), '{:.3f}')} | "
                         f"{r['decode_ms']:.2f}{_ci(r['decode_ci_ms'], '{:.2f}')} | {comm:.1f} | "
                         f"{r['ideal_saving_ms']:.1f} | "
                         + ("-" if rr is None else f"{rr:.2f}{_ci(r.get('realised_over_ideal_ci'), '{:.2f}')}") + " | "
                         + ("-" if ri is None else f"{ri:.2f}{_ci(r.get('realised_over_isolated_ideal_ci'), '{:.2f}')}")
                         + " |")
    ref = next((p for p in plans.split(",") if p == "bf16"), None)
    if ref:  # the target's reference: dense with bf16 on the wire
        lines += ["", f"Against dense with bf16 on the wire (plan {ref}), TTFT and decode ratios of medians with 95% "
                  "bootstrap intervals (paired over interleaved reps in syncdrop's runtime; resampled per engine in "
                  "vLLM, whose plans ran in separate engines):", "",
                  "| runtime | plan | TTFT / bf16-wire dense | decode / bf16-wire dense |", "|---|---|---:|---:|"]
        for name, res in runs.items():
            rows = {r["plan"]: r for r in res["plans"]}
            if ref not in rows:
                continue
            paired = name == "syncdrop"
            for r in res["plans"]:
                cells = []
                for what in ("ttft", "decode"):
                    a, b = r[f"{what}_samples_ms"], rows[ref][f"{what}_samples_ms"]
                    ratio = statistics.median(a) / statistics.median(b)
                    r.setdefault("over_bf16_wire", {})[what] = [ratio, median_ratio_ci(a, b, paired)]
                    cells.append(f"{ratio:.3f}{_ci(r['over_bf16_wire'][what][1], '{:.3f}')}")
                lines.append(f"| {name} | {r['plan']} | {cells[0]} | {cells[1]} |")
    if "vllm" in runs and "stock" in runs:
        a, b = _row(runs["vllm"], first), _row(runs["stock"], "none")
        lines += ["", f"Plugin under plan {first} vs stock vLLM: TTFT {a['ttft_ms']:.1f} vs {b['ttft_ms']:.1f} ms "
                  "(separate engines, run one after the other)."]
    table = "\n".join(lines) + "\n"
    atomic_write_json(out / "summary.json", {"provenance": provenance(), "command": " ".join(sys.argv),
                                             "settings": vars(args), "runs": runs})
    atomic_write_text(out / "summary.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
