"""Forward-pass speed: the simulated executor (N=1 and N=3, plan none) vs transformers' own
forward on the same tokens, interleaved (A B C A B C ...) so machine noise hits all variants alike.

Writes ``OUT.json`` (settings, provenance, raw samples in seconds, medians, ratios to
transformers) and ``OUT.md``. Example:

    python benchmarks/bench_forward.py --tokens 1024 --reps 7 --out results/bench_forward
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from syncdrop.eval.data import load_text
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.runtime import HFReference, parse_dtype


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", default="1,3", help="comma-separated TP degrees for the simulated executor")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="results/bench_forward")
    args = ap.parse_args()
    dtype = parse_dtype(args.dtype)
    source = resolve_model(args.model)
    text = load_text("auto").text
    ids = source.load_tokenizer()(text[:200_000], add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids[: args.batch * args.tokens]).view(args.batch, args.tokens)

    hf = HFReference(source, dtype)
    variants = {"transformers": lambda: hf.logits(hf.hidden_states(ids))}
    for n in (int(t) for t in args.tp.split(",")):
        m = simulated_model(source.config, source.reader.get, n, dtype=dtype)
        variants[f"simulated N={n}"] = (lambda m=m: m(ids))
    samples: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for rep in range(args.warmup + args.reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if rep >= args.warmup:
                    samples[name].append(dt)
            print(f"rep {rep + 1}/{args.warmup + args.reps}: "
                  + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in samples.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {k: med[k] / med["transformers"] for k in med}
    settings = {"model": source.name, "tokens": args.tokens, "batch": args.batch, "dtype": args.dtype,
                "reps": args.reps, "warmup": args.warmup, "threads": torch.get_num_threads()}
    atomic_write_json(args.out + ".json", {"settings": settings, "provenance": provenance(),
                                           "samples_s": samples, "median_s": med, "ratio_to_transformers": ratios})
    lines = [f"{source.name}, batch {args.batch} x {args.tokens} tokens, {args.dtype}, "
             f"{torch.get_num_threads()} threads, median of {args.reps} interleaved reps.", "",
             "| variant | median forward (s) | ratio to transformers |", "|---|---:|---:|"]
    lines += [f"| {k} | {med[k]:.3f} | {ratios[k]:.3f} |" for k in med]
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
