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


def run_job(job: dict[str, Any], log_path: str | Path, timeout: float = 900.0,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one :mod:`~syncdrop.serve.vllm_run` job (model, tp, prompts...) and return its result; the
    engine's output goes to ``log_path``. A failure raises one :class:`SyncdropError` naming the log."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="syncdrop_vllm_") as tmp:
        job = {**job, "model": str(Path(job["model"]).resolve()), "out": str(Path(tmp) / "result.json")}
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        with log_path.open("w") as log:
            try:
                r = subprocess.run([vllm_python(), "-m", "syncdrop.serve.vllm_run", str(job_file)], stdout=log,
                                   stderr=subprocess.STDOUT, env=engine_env(int(job["tp"])) | (env or {}),
                                   timeout=timeout,
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


def serve_argv(model_dir: str | Path, tp: int, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """vLLM's OpenAI-compatible server on ``model_dir`` at ``tp`` ranks, started with the vLLM interpreter
    (``python -m vllm.entrypoints.openai.api_server`` is what ``vllm serve`` runs; the CPU build's ``vllm``
    script cannot find its own package metadata, so the module is started directly)."""
    return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--tensor-parallel-size", str(tp), "--host", host, "--port", str(port)]


def serve_command_line(model_dir: str | Path, tp: int) -> dict[str, str]:
    """The command lines a user runs to serve an export: the CUDA ``vllm`` package and the CPU build."""
    return {"gpu": f"vllm serve {model_dir} --tensor-parallel-size {tp}",
            "cpu": f"python -m vllm.entrypoints.openai.api_server --model {model_dir} --tensor-parallel-size {tp} "
                   "--dtype float32"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``with VllmServer(dir, tp, log) as url:`` -- vLLM's OpenAI server on 127.0.0.1, ready (``/health``
    answers 200) when the block starts, stopped with SIGINT (then SIGKILL after ``stop_s``) when it ends.
    ``exit_code`` is the server's exit status afterwards. A server that exits or does not get ready within
    ``timeout`` raises one :class:`SyncdropError` naming the log."""

    def __init__(self, model_dir: str | Path, tp: int, log_path: str | Path, timeout: float = 600.0,
                 stop_s: float = 60.0, extra_args: list[str] | None = None) -> None:
        self.model_dir, self.tp, self.log_path = str(model_dir), tp, Path(log_path)
        self.timeout, self.stop_s, self.extra = timeout, stop_s, list(extra_args or [])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> str:
        import time
        import urllib.request

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(serve_argv(self.model_dir, self.tp, port=self.port) + self.extra, stdout=log,
                                     stderr=subprocess.STDOUT, env=engine_env(self.tp), start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"exit {self.proc.returncode}: {_failure_line(self.log_path.read_text())}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                time.sleep(1.0)
        self._fail(f"not ready after {self.timeout:.0f}s")
        raise AssertionError("unreachable")

    def _fail(self, why: str) -> None:
        self.__exit__(None, None, None)
        raise SyncdropError(f"vLLM server on {self.model_dir} at TP={self.tp} failed ({why}); log: {self.log_path}",
                            field="engine")

    def __exit__(self, *exc: object) -> None:
        import signal

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.exit_code = self.proc.returncode
