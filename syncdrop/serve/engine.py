"""Start vLLM from syncdrop's environment: find the vLLM interpreter, run one job, report failures in one line.

vLLM pins its own transformers, so it lives in a virtual environment of its own (``make`` builds
``.venv-vllm`` beside ``.venv``; elsewhere set ``SYNCDROP_VLLM_PYTHON`` to any Python that has vLLM and
syncdrop installed). Jobs run :mod:`syncdrop.serve.vllm_run` in that interpreter; its whole output goes
to a log file, named in the error when vLLM fails.

On the CPU backend, unless the caller's environment sets them: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and
``VLLM_CPU_OMP_THREADS_BIND`` giving each of the N ranks its own cores (``0|1`` on 2 cores at N = 2;
``0|1|0`` at N = 3, which oversubscribes). Both variables are ignored by vLLM's GPU backends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError

REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
INSTALL_HINT = "run `make vllm-env` (builds .venv-vllm) or set SYNCDROP_VLLM_PYTHON to a Python with vLLM and syncdrop"


def vllm_python() -> str:
    """The interpreter that runs vLLM: ``$SYNCDROP_VLLM_PYTHON``, else the checkout's ``.venv-vllm``."""
    path = os.environ.get("SYNCDROP_VLLM_PYTHON") or str(REPO_VENV)
    if not os.access(path, os.X_OK):
        raise SyncdropError(f"no vLLM environment at {path}: {INSTALL_HINT}", field="engine")
    return path


def omp_bind(tp: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: contiguous core ranges, one per rank, or (fewer cores
    than ranks) one core per rank, round robin."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if tp > len(cores):
        return "|".join(str(cores[r % len(cores)]) for r in range(tp))
    per = len(cores) // tp
    parts = [cores[r * per:(r + 1) * per] for r in range(tp)]
    return "|".join(str(p[0]) if len(p) == 1 else f"{p[0]}-{p[-1]}" for p in parts)


def engine_env(tp: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind(tp))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _failure_line(log_text: str) -> str:
    """The most telling line of a failed vLLM log: the first exception a worker or the engine core logged
    (the root cause; vLLM's last line only says "see root cause above"), else the last exception, else
    the last line."""
    lines = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    exc = re.compile(r"\b(\w+(Error|Exception)): (.*)")
    for ln in lines:
        m = exc.search(ln)
        if m and " ERROR " in ln:
            return f"{m[1]}: {m[3]}"[:400]
    for i in range(len(lines) - 1, -1, -1):
        m = exc.search(lines[i])
        if m:
            detail = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith(" ") else ""
            return (f"{m[1]}: {m[3]}" + (f" {detail}" if detail else ""))[:400]
    return lines[-1].strip()[-300:] if lines else "no output"


def run_job(job: dict[str, Any], log_path: str | Path, timeout: float = 900.0) -> dict[str, Any]:
    """Run one :mod:`~syncdrop.serve.vllm_run` job (model, tp, prompts...) and return its result; the
    engine's output goes to ``log_path``. A failure raises one :class:`SyncdropError` naming the log."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="syncdrop_vllm_") as tmp:
        job = {**job, "out": str(Path(tmp) / "result.json")}
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        with log_path.open("w") as log:
            try:
                r = subprocess.run([vllm_python(), "-m", "syncdrop.serve.vllm_run", str(job_file)], stdout=log,
                                   stderr=subprocess.STDOUT, env=engine_env(int(job["tp"])), timeout=timeout,
                                   cwd=tmp)
                code = r.returncode
            except subprocess.TimeoutExpired:
                code = None
        if code != 0 or not Path(job["out"]).is_file():
            why = (f"timed out after {timeout:.0f}s" if code is None
                   else f"exit {code}: {_failure_line(log_path.read_text())}")
            raise SyncdropError(f"vLLM failed on {job['model']} at TP={job['tp']} ({why}); log: {log_path}",
                                field="engine")
        return json.loads(Path(job["out"]).read_text())
