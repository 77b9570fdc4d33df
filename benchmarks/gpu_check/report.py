"""Running the checks and writing what they found: ``OUT/<check>.json``, ``OUT/summary.json``, ``OUT/README.md``.

Every file holds the command, commit, settings, GPU names, torch / CUDA / NCCL versions, the declared and found
versions of the packages the check needs, and the raw values, and is written atomically. A check that raises
fails (with the exception's first line); the others still run.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpu_check import preflight
from gpu_check.checks import check_generate_vs_hf, check_sim_vs_cpu
from gpu_check.context import Context, Settings, load_text
from gpu_check.distributed import check_bench, check_nccl_fault, check_nccl_ppl
from gpu_check.vllm_part import check_vllm

log = logging.getLogger("gpu_check")

CHECKS: dict[str, Callable[[Context, Path], dict[str, Any]]] = {
    "sim_vs_cpu": lambda c, t: check_sim_vs_cpu(c), "generate_vs_hf": lambda c, t: check_generate_vs_hf(c),
    "nccl_ppl": check_nccl_ppl, "nccl_fault": check_nccl_fault,
    "bench_float32": lambda c, t: check_bench(c, t, "float32"),
    "bench_bfloat16": lambda c, t: check_bench(c, t, "bfloat16"),
    "vllm_tp1": lambda c, t: check_vllm(c, t, 1), "vllm_tp2": lambda c, t: check_vllm(c, t, 2)}


def environment() -> dict[str, Any]:
    """GPU names and library versions (CUDA facts are None on a CPU build)."""
    import torch
    import transformers

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if n else None
    except Exception:  # noqa: BLE001  (a build without NCCL)
        nccl = None
    return {"gpu_name": names[0] if names else None, "gpus": names, "gpu_count": n, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if n else None, "nccl": nccl,
            "transformers": transformers.__version__, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "cpu_count": os.cpu_count(), "packages": preflight.report()}


def write_readme(out: Path, settings: Settings, env: dict[str, Any], prov: dict[str, Any],
                 verdicts: dict[str, dict[str, Any]]) -> None:
    from syncdrop.io_utils import atomic_write_text

    lines = [f"# GPU check{' (CPU dry run)' if settings.dry_run else ''}", "",
             f"`{prov['command']}` at commit `{prov['commit']}`; GPU: {env['gpu_name'] or 'none'} "
             f"(x{env['gpu_count']}); torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, transformers "
             f"{env['transformers']}; model {settings.model_name}; device {settings.device}, distributed "
             f"{settings.backend} at world size {settings.world}; vLLM: {settings.vllm_python or 'not installed'}.",
             "", "| check | verdict | result | seconds |", "|---|---|---|---:|"]
    for name, v in verdicts.items():
        lines.append(f"| {name} | {v['verdict']} | {v['summary']} | {v['seconds']:.1f} |")
    lines += ["", "Files: one `<check>.json` per check (settings, environment, provenance, raw values) and "
              "`summary.json`. What each check asserts: docs/gpu.md."]
    atomic_write_text(out / "README.md", "\n".join(lines) + "\n")


def run_checks(settings: Settings, names: list[str], out: Path, workdir: Path) -> int:
    """Run ``names`` in order, write their files to ``out``; 0 when every one passed or was skipped, else 1."""
    import torch

    from syncdrop.eval.perplexity import make_windows
    from syncdrop.io_utils import atomic_write_json, provenance
    from syncdrop.models.loading import resolve_model

    data = load_text(settings.dataset, settings.data_dir, workdir)
    tok = resolve_model(settings.model).load_tokenizer()
    windows = make_windows(tok(data.text, add_special_tokens=False)["input_ids"], settings.seq_len, settings.windows)
    ctx = Context(settings, workdir, data, windows)
    env, prov = environment(), provenance()
    verdicts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_", dir=workdir) as tmp:
        for name in names:
            log.info("--- %s", name)
            t0 = time.monotonic()
            check_tmp = Path(tmp) / name
            check_tmp.mkdir()
            try:
                res = CHECKS[name](ctx, check_tmp)
            except Exception as e:  # noqa: BLE001  (a check that crashes fails; the others still run)
                log.exception("%s raised", name)
                first = str(e).splitlines()[0] if str(e) else ""
                res = {"passed": False, "summary": f"raised {type(e).__name__}: {first}"}
            seconds = time.monotonic() - t0
            verdict = "skipped" if res.get("skipped") else ("pass" if res["passed"] else "FAIL")
            verdicts[name] = {"verdict": verdict, "passed": bool(res["passed"]), "summary": res["summary"],
                              "seconds": seconds}
            atomic_write_json(out / f"{name}.json", {
                "check": name, "verdict": verdict, "passed": bool(res["passed"]), "seconds": seconds,
                "settings": asdict(settings), "dataset": data.info(), "environment": env, "provenance": prov,
                "torch_threads": torch.get_num_threads(), **res})
            log.info("%s: %s (%s, %.1fs)", name, verdict, res["summary"], seconds)
    ok = all(v["passed"] for v in verdicts.values())
    atomic_write_json(out / "summary.json", {"passed": ok, "checks": verdicts, "settings": asdict(settings),
                                             "dataset": data.info(), "environment": env, "provenance": prov})
    write_readme(out, settings, env, prov, verdicts)
    for name, v in verdicts.items():
        print(f"{name:15s} {v['verdict']:7s} {v['summary']}")
    print(f"gpu_check: {'all checks passed' if ok else 'FAILED'}; files in {out}")
    return 0 if ok else 1
