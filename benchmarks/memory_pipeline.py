"""Peak memory of the accuracy pipeline against the model's bytes: profile, distil and perplexity on a
random-weight Llama-shaped model, streamed block by block.

Builds (once, under ``--work``) a Llama of ``--layers`` blocks (hidden 2048, 16 heads / 4 KV heads of 128,
MLP 5632, vocab 32000, untied head; 2.2B parameters at 48 layers) with seeded random bfloat16 weights,
written tensor by tensor as sharded safetensors with an index (no full copy is ever in memory), and the
tests' byte-level tokenizer. Then runs, each in a process of its own::

    syncdrop profile --stream --dtype bfloat16   (every block's sensitivity)
    syncdrop distill --dtype bfloat16            (B2B of a few blocks: fp32 masters, AdamW states)
    syncdrop ppl --stream --dtype bfloat16

and samples the process's memory from ``/proc/PID/status`` every 20 ms: the peak of ``VmHWM`` (resident,
file-backed pages of the memory-mapped checkpoint included, which the kernel can drop at will) and the
peak of ``RssAnon`` (what the process itself holds). Writes ``OUT.json`` (command, commit, settings, the
model's bytes, every sample's peaks, ratios) and ``OUT.md``. Example::

    python benchmarks/memory_pipeline.py --work /tmp/mem --out results/memory/pipeline
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

GIB = 2**30


def build_model(path: Path, layers: int, seed: int = 0) -> int:
    """The random bfloat16 Llama at ``path`` (one safetensors shard per 4 blocks, an index); its bytes."""
    import torch
    from safetensors.torch import save_file

    from syncdrop.tiny_models import tiny_tokenizer

    h, heads, kv, d, inter, vocab = 2048, 16, 4, 128, 5632, 32000
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
           "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    if (path / "model.safetensors.index.json").is_file():
        return json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    groups = [list(range(i, min(i + 4, layers))) for i in range(0, layers, 4)]
    n = len(groups) + 1
    weight_map, total = {}, 0
    for g, blocks in enumerate([None, *groups]):
        name = f"model-{g + 1:05d}-of-{n:05d}.safetensors"
        if blocks is None:
            tensors = {"model.embed_tokens.weight": rnd(vocab, h), "lm_head.weight": rnd(vocab, h),
                       "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
        else:
            tensors = {}
            for i in blocks:
                p = f"model.layers.{i}."
                tensors |= {p + "self_attn.q_proj.weight": rnd(heads * d, h),
                            p + "self_attn.k_proj.weight": rnd(kv * d, h),
                            p + "self_attn.v_proj.weight": rnd(kv * d, h),
                            p + "self_attn.o_proj.weight": rnd(h, heads * d),
                            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                            p + "mlp.down_proj.weight": rnd(h, inter),
                            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    tiny_tokenizer().save_pretrained(str(path))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    return total


def peak_memory(cmd: list[str], log: Path) -> dict[str, float]:
    """Run ``cmd``, sampling its ``/proc/PID/status``; peaks in GiB and the wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        hwm = anon = 0.0
        while p.poll() is None:
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
            except OSError:
                break
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in status.splitlines() if ln.endswith(" kB")}
            hwm, anon = max(hwm, kb.get("VmHWM", 0) / 2**20), max(anon, kb.get("RssAnon", 0) / 2**20)
            time.sleep(0.02)
        rc = p.wait()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return {"peak_rss_gib": hwm, "peak_anon_gib": anon, "wall_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the model and the runs' outputs (not the repository)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    model = work / f"llama_random_{args.layers}l"
    model_bytes = build_model(model, args.layers)
    text = work / "text.txt"
    text.write_text(" ".join(f"word{i % 997} and more text {i}" for i in range(20000)))
    sd = [sys.executable, "-m", "syncdrop.cli"]
    common = ["--model", str(model), "--tp", str(args.tp), "--dtype", "bfloat16", "-q"]
    L = args.layers
    runs = {
        "profile": [*sd, "profile", *common, "--stream", "--calib", str(text), "--samples", "2", "--seq-len",
                    str(args.seq_len), "--no-png", "--out", str(work / "profile.json")],
        "distill": [*sd, "distill", *common, "--plan", f"blocks:0,{L // 2},{L - 1}", "--calib", str(text),
                    "--samples", "2", "--heldout", "1", "--seq-len", str(args.seq_len), "--epochs", "1",
                    "--out", str(work / "distilled")],
        "ppl": [*sd, "ppl", *common, "--stream", "--dataset", str(text), "--seq-len", str(args.seq_len),
                "--max-windows", "4", "--json", str(work / "ppl.json")],
    }
    rows = {}
    shutil.rmtree(work / "distilled", ignore_errors=True)  # distill resumes from finished block files: start empty
    for name, cmd in runs.items():
        rows[name] = {**peak_memory(cmd, work / f"{name}.log"), "command": " ".join(cmd[1:]).replace(str(work), "WORK")}
        rows[name] |= {"rss_over_model": rows[name]["peak_rss_gib"] * GIB / model_bytes,
                       "anon_over_model": rows[name]["peak_anon_gib"] * GIB / model_bytes}
        print(name, rows[name], flush=True)
    base = peak_memory([sys.executable, "-c", "import torch, transformers, safetensors, syncdrop.cli"],
                       work / "baseline.log")
    settings = {"layers": L, "hidden": 2048, "heads": 16, "kv_heads": 4, "head_dim": 128, "intermediate": 5632,
                "vocab": 32000, "dtype": "bfloat16", "tp": args.tp, "seq_len": args.seq_len,
                "model_bytes": model_bytes, "params": model_bytes // 2}
    atomic_write_json(args.out + ".json", {"command": "python benchmarks/memory_pipeline.py " + " ".join(
        a.replace(str(work), "WORK") for a in sys.argv[1:]), "settings": settings, "provenance": provenance(),
        "import_baseline": base, "runs": rows})
    lines = [f"Random Llama, {L} blocks, {model_bytes / 2 / 1e9:.2f}B parameters, bfloat16 "
             f"({model_bytes / GIB:.2f} GiB), TP={args.tp} simulated, windows of {args.seq_len} tokens. Peak "
             f"resident memory (VmHWM, mapped checkpoint pages included) and peak anonymous memory (RssAnon), "
             f"against the model's bytes. Importing torch, transformers and syncdrop alone: "
             f"{base['peak_rss_gib']:.2f} GiB resident.", "",
             "| stage | peak resident (GiB) | / model | peak anonymous (GiB) | / model | wall (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['peak_rss_gib']:.2f} | {r['rss_over_model']:.3f} | {r['peak_anon_gib']:.2f} | "
                     f"{r['anon_over_model']:.3f} | {r['wall_s']:.0f} |")
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SYNCDROP_PROGRESS_INTERVAL", "60")
    sys.exit(main())
