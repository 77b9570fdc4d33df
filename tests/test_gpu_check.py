"""The prepared GPU check (benchmarks/gpu_check.py) runs its whole pipeline on the CPU (``--cpu-dry-run``).

On this CPU-only machine the checks compare the CPU with itself, so they prove the script, not CUDA:
every check runs end to end (simulated vs CPU, greedy generation vs transformers, a 2-rank gloo run vs
the simulation, a killed rank, bench in both dtypes) and writes its files. Without the dry-run flag the
script must refuse with one line and exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_refuses_without_cuda(tmp_path) -> None:
    r = _run("--out", str(tmp_path / "gpu"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("gpu_check: CUDA is not available") and "Traceback" not in r.stderr
    assert not (tmp_path / "gpu").exists()


def test_bad_checks_argument(tmp_path) -> None:
    r = _run("--cpu-dry-run", "--checks", "sim_vs_cpu,warp_drive", "--out", str(tmp_path / "gpu"))
    assert r.returncode == 2 and "--checks must be a comma-separated subset" in r.stderr


def test_dry_run_every_check(tmp_path, tiny_llama_dir, text_file) -> None:
    out = tmp_path / "gpu"
    r = _run("--cpu-dry-run", "--model", str(tiny_llama_dir), "--dataset", str(text_file), "--drop-plan",
             "blocks:1", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and set(summary["checks"]) == {
        "sim_vs_cpu", "generate_vs_hf", "nccl_ppl", "nccl_fault", "bench_float32", "bench_bfloat16"}
    assert all(v["verdict"] == "pass" for v in summary["checks"].values()), summary["checks"]
    fault = json.loads((out / "nccl_fault.json").read_text())
    assert [s["exit_code"] for s in fault["survivors"]] == [1]  # the one survivor failed, with one line
    ppl = json.loads((out / "nccl_ppl.json").read_text())
    assert ppl["backend"] == "gloo" and ppl["world"] == 2 and ppl["rel_diff"] <= 1e-4
    assert (out / "README.md").read_text().startswith("# GPU check (CPU dry run)")
