"""Peak memory of ``syncdrop export`` against the model's bytes, on a random-weight Llama-shaped model in bfloat16.

Builds (under ``--work``, deleted afterwards unless ``--keep``) a Llama of ``--layers`` blocks (hidden 2048,
16 heads / 8 KV heads of 128, MLP 8192, vocab 32000, untied head: 1.64B parameters, 3.28 GB at 24 blocks) with
seeded random bfloat16 weights, written by syncdrop's own streaming writer (``hf_writer.write_sharded``, a
chunk of rows at a time: no full copy, no float32 copy, ever in memory) as a transformers directory sharded at
2GB (two shards and an index, as hub checkpoints come), plus the tests' byte-level tokenizer. Then runs, in a
process of its own::

    syncdrop export --model MODEL --tp 2 --plan frac:0.5 --out OUT -q     (default dtype: the source's, bf16)

under ``/usr/bin/time -v``, whose "Maximum resident set size" is the figure reported, while sampling
``/proc/PID/status`` every 20 ms for the split of that peak: ``RssAnon`` (what
the process holds itself) and ``RssFile`` (pages of the memory-mapped checkpoint, which the kernel may drop at
will). A process that only imports what the export imports (torch, transformers, safetensors, syncdrop) is
measured the same way: the baseline. The export is checked against the source (every tensor, bit for bit,
compared a row block at a time). Writes ``OUT.json`` (command, commit, settings, model bytes, peaks, ratios with
and without the baseline) and ``OUT.md``. Example::

    python benchmarks/memory_export.py --out results/memory/export
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

SHAPE = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 8192, "vocab": 32000}
TARGET = 0.25  # issue 28: peak RSS at most this fraction of the model's bytes


def build_model(path: Path, layers: int, seed: int = 0) -> int:
    """The random bfloat16 Llama at ``path``, streamed to disk; returns its tensor bytes."""
    import torch

    from syncdrop.models.hf_writer import TensorSpec, dtype_keys, write_sharded
    from syncdrop.tiny_models import tiny_tokenizer

    h, heads, kv, d, inter, vocab = (SHAPE[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                        "vocab"))
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    gen = torch.Generator().manual_seed(seed)

    def chunks(spec: TensorSpec):
        if len(spec.shape) == 1:
            yield (1.0 + 0.1 * torch.randn(spec.shape, generator=gen)).to(torch.bfloat16)
            return
        rows, cols = spec.shape
        step = max(1, (1 << 22) // cols)
        for lo in range(0, rows, step):
            yield (0.02 * torch.randn(min(step, rows - lo), cols, generator=gen)).to(torch.bfloat16)

    path.mkdir(parents=True, exist_ok=True)
    specs = [TensorSpec(k, s, torch.bfloat16) for k, s in shapes.items()]
    written = write_sharded(path, specs, chunks, max_shard_size="2GB")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "intermediate_size": inter,
           "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
           **dtype_keys("bfloat16")}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tiny_tokenizer().save_pretrained(str(path))
    return written.total_size


def measure(cmd: list[str], log: Path) -> dict[str, float]:
    """Run ``cmd`` under ``/usr/bin/time -v``: its "Maximum resident set size" (``ru_maxrss`` of ``cmd`` alone;
    the same field read from this Python's own children would also count this process's pages, which a child
    holds between fork and exec), the peaks of ``RssAnon``/``RssFile`` sampled from ``/proc/PID/status`` of
    ``cmd``'s process, and the wall time. Sizes in bytes."""
    t0 = time.perf_counter()
    timing = log.with_suffix(".time")
    with open(log, "w") as f:
        p = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(timing), *cmd], stdout=f, stderr=subprocess.STDOUT)
        anon = file = 0
        while p.poll() is None:
            try:
                child = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()[0]
                kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path(f"/proc/{child}/status").read_text()
                      .splitlines() if ln.endswith(" kB")}
                anon, file = max(anon, kb.get("RssAnon", 0) * 1024), max(file, kb.get("RssFile", 0) * 1024)
            except (OSError, IndexError):
                pass
            time.sleep(0.02)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}); see {log}")
    report = timing.read_text()
    maxrss = next(int(ln.split(":")[1]) for ln in report.splitlines() if "Maximum resident set size" in ln)
    return {"max_rss_bytes": maxrss * 1024, "peak_anon_bytes": anon, "peak_file_bytes": file,
            "wall_s": time.perf_counter() - t0}


def check_export(src: Path, out: Path) -> int:
    """Every tensor of the export equals the source's, bit for bit (read a block of rows at a time); returns the
    number of tensors compared."""
    import torch
    from safetensors import safe_open

    def where(d: Path) -> dict[str, Path]:
        index = d / "model.safetensors.index.json"
        if index.is_file():
            return {k: d / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), d / "model.safetensors")

    a, b = where(src), where(out)
    if sorted(a) != sorted(b):
        raise SystemExit(f"export holds other tensors than the source: {sorted(set(a) ^ set(b))[:3]}")
    for k in a:
        with safe_open(str(a[k]), "pt") as fa, safe_open(str(b[k]), "pt") as fb:
            sa, sb = fa.get_slice(k), fb.get_slice(k)
            rows = sa.get_shape()[0]
            if sb.get_shape() != sa.get_shape() or sb.get_dtype() != sa.get_dtype():
                raise SystemExit(f"{k}: {sb.get_dtype()} {sb.get_shape()} in the export, {sa.get_dtype()} "
                                 f"{sa.get_shape()} in the source")
            for lo in range(0, rows, 1024):
                if not torch.equal(sa[lo:lo + 1024], sb[lo:lo + 1024]):
                    raise SystemExit(f"{k}: rows {lo}.. differ between the export and the source")
    return len(a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--plan", default="frac:0.5")
    ap.add_argument("--work", default=None, help="folder for the model and the export (default: a new one under "
                    "the temporary directory), removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the generated model and its export")
    ap.add_argument("--out", default="results/memory/export")
    args = ap.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="syncdrop_memory_export_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = work / f"llama_random_{args.layers}l"
        t0 = time.perf_counter()
        model_bytes = build_model(model, args.layers)
        build_s = time.perf_counter() - t0
        print(f"model: {model_bytes / 1e9:.2f} GB of bfloat16 ({model_bytes // 2 / 1e9:.2f}B parameters) in "
              f"{build_s:.0f} s", flush=True)
        export_cmd = [sys.executable, "-m", "syncdrop.cli", "export", "--model", str(model), "--tp", str(args.tp),
                      "--plan", args.plan, "--out", str(work / "export"), "-q"]
        run = measure(export_cmd, work / "export.log")
        printed = (work / "export.log").read_text().strip().splitlines()
        print(f"export: {run}", flush=True)
        compared = check_export(model, work / "export")
        base = measure([sys.executable, "-c", "import torch, transformers, safetensors, syncdrop.cli, "
                        "syncdrop.serve.export"], work / "baseline.log")
        files = sorted(p.name for p in (work / "export").iterdir())
        export_bytes = sum(p.stat().st_size for p in (work / "export").glob("*.safetensors"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    peak, baseline = run["max_rss_bytes"], base["max_rss_bytes"]
    ratios = {"peak_over_model": peak / model_bytes, "peak_less_baseline_over_model": (peak - baseline) / model_bytes,
              "anon_over_model": run["peak_anon_bytes"] / model_bytes}
    settings = {"layers": args.layers, **SHAPE, "tied": False, "dtype": "bfloat16", "tp": args.tp, "plan": args.plan,
                "params": model_bytes // 2, "model_bytes": model_bytes, "source_shards": "2GB",
                "export_max_shard_size": "5GB (default)", "target_peak_over_model": TARGET}
    result = {"command": "python benchmarks/memory_export.py " + " ".join(sys.argv[1:]),
              "export_command": " ".join(["syncdrop", *export_cmd[3:]]).replace(str(work), "WORK"),
              "provenance": provenance(), "settings": settings, "export": run, "import_baseline": base,
              "ratios": ratios, "meets_target": ratios["peak_over_model"] <= TARGET,
              "export_printed": [ln.replace(str(work), "WORK") for ln in printed],
              "export_files": files, "export_weight_file_bytes": export_bytes, "tensors_checked_equal": compared,
              "build_s": build_s}
    atomic_write_json(args.out + ".json", result)
    gb = 1e9
    lines = [
        f"# Peak memory of `syncdrop export` (random Llama, {args.layers} blocks, bfloat16)", "",
        f"Model: hidden {SHAPE['hidden']}, {SHAPE['heads']} heads / {SHAPE['kv_heads']} KV heads of "
        f"{SHAPE['head_dim']}, MLP {SHAPE['intermediate']}, vocab {SHAPE['vocab']}, untied head: "
        f"{model_bytes // 2 / 1e9:.2f}B parameters, {model_bytes / gb:.3f} GB of bfloat16 in two 2GB shards. "
        f"Command: `{result['export_command']}` (dtype: the source's, bfloat16; shards of at most 5GB). "
        f"Commit {result['provenance']['commit']}; {result['provenance']['machine']}. The export was checked "
        f"tensor for tensor against the source ({compared} tensors, bit for bit).", "",
        "| process | peak RSS (GB) | / model bytes | peak RssAnon (GB) | peak RssFile (GB) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| export | {peak / gb:.3f} | {ratios['peak_over_model']:.3f} | {run['peak_anon_bytes'] / gb:.3f} | "
        f"{run['peak_file_bytes'] / gb:.3f} | {run['wall_s']:.0f} |",
        f"| imports only (torch, transformers, safetensors, syncdrop) | {baseline / gb:.3f} | "
        f"{baseline / model_bytes:.3f} | {base['peak_anon_bytes'] / gb:.3f} | {base['peak_file_bytes'] / gb:.3f} | "
        f"{base['wall_s']:.0f} |", "",
        "Peak RSS is the \"Maximum resident set size\" `/usr/bin/time -v` prints for the export process; "
        "RssAnon/RssFile are the largest values sampled every 20 ms from /proc (they need not peak "
        f"together). Ratio to the model's bytes: {ratios['peak_over_model']:.3f} with the interpreter's baseline "
        f"(target at most {TARGET}: {'met' if result['meets_target'] else 'NOT met'}), "
        f"{ratios['peak_less_baseline_over_model']:.3f} without it (peak less the imports-only process). "
        f"This export wrote {export_bytes / gb:.3f} GB (bfloat16, the source's dtype).",
    ]
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
