"""Checks that start ``syncdrop`` itself (``python -m syncdrop``, this tree through ``PYTHONPATH``), one rank per GPU.

``nccl_ppl``        ``syncdrop ppl --launch --tp G --backend nccl --device cuda`` with G = the number of GPUs (at
                    most the model's head count; G = 1 is NCCL with world size 1, recorded as such) vs the
                    simulated executor on CUDA at TP = G: relative difference <= 1e-4 (the ring all-reduce sums
                    in another order than the simulation: float rounding only).
``nccl_fault``      (G >= 2) G ranks started as torchrun starts them; once every rank logged ``ready`` the last
                    rank is SIGKILLed; every survivor must exit non-zero within the collective timeout
                    (``--dist-timeout``) plus a margin, printing exactly one ``syncdrop:`` line that says a peer
                    rank died, and no traceback. Skipped (not failed) with one GPU.
``bench_float32``,  ``syncdrop bench`` of the plans ``none``, the drop plan and ``all`` on CUDA (TP = G under
``bench_bfloat16``  ``--launch`` / NCCL when G >= 2), in that dtype: it must exit 0 and report every plan; its whole
                    JSON is kept (timings are recorded, never asserted).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check.checks import rel_diff, simulated_ppl
from gpu_check.context import Context

FAULT_MARGIN_S = 30.0  # beyond --dist-timeout, for a survivor to print its line and leave the process group


def text_of(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b or ""


def run_cli(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m syncdrop *argv`` with a timeout: exit code (None when it timed out), seconds, output tails."""
    cmd = [sys.executable, "-m", "syncdrop", *argv]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        code, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = None, text_of(e.stdout), text_of(e.stderr) + f"\n[gpu_check: timed out after {timeout:.0f}s]"
    return {"command": shlex.join(["syncdrop", *argv]), "exit_code": code, "seconds": time.monotonic() - t0,
            "stdout_tail": out.splitlines()[-10:], "stderr_tail": err.splitlines()[-20:]}


def launch_args(ctx: Context, tp: int) -> list[str]:
    """``--tp`` and the runtime flags of a distributed run at ``tp`` ranks (``--launch`` starts them)."""
    s = ctx.settings
    return ["--tp", str(tp), "--launch", "--backend", s.backend, "--device", s.device]


def check_nccl_ppl(ctx: Context, tmp: Path) -> dict[str, Any]:
    s = ctx.settings
    out = tmp / "ppl.json"
    argv = ["ppl", "--model", s.model, *launch_args(ctx, s.world), "--seq-len", str(s.seq_len), "--max-windows",
            str(s.windows), "--batch-size", "1", "-q", "--json", str(out), *ctx.cli_data_args()]
    run = run_cli(argv, s.timeout)
    key = (s.device, s.world, "none")
    if key not in ctx.sim_ppl:
        simulated_ppl(ctx, s.device, s.world, ["none"])
    sim = ctx.sim_ppl[key]
    res = json.loads(out.read_text()) if run["exit_code"] == 0 and out.is_file() else None
    note = f"{s.backend} at world size {s.world}" + (" (one GPU: NCCL with a single rank)"
                                                        if s.backend == "nccl" and s.world == 1 else "")
    if res is None:
        return {"passed": False, "summary": f"{note}: syncdrop ppl exited {run['exit_code']}", "run": run,
                "ppl_simulated": sim}
    d = rel_diff(res["ppl"], sim)
    ok = d <= s.rel_tol and res["executor"] == "distributed" and res["backend"] == s.backend and res["tp"] == s.world
    return {"passed": ok, "summary": f"{note}: ppl {res['ppl']:.6f} vs simulated {sim:.6f}, rel diff {d:.2e}",
            "world": s.world, "backend": res["backend"], "ppl_distributed": res["ppl"], "ppl_simulated": sim,
            "rel_diff": d, "run": run, "result": res}


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def check_nccl_fault(ctx: Context, tmp: Path) -> dict[str, Any]:
    """Ranks started torchrun-style (this process hosts the store), the last one SIGKILLed once every rank
    is ready; the survivors must each fail on their own, fast, with one line."""
    from syncdrop.parallel.launch import host_store, rank_env

    s = ctx.settings
    if s.world < 2:
        return {"passed": True, "skipped": True,
                "summary": f"skipped: needs 2 or more GPUs, this machine has {s.world} (NCCL world size 1)"}
    store = host_store(s.world)
    cmd = [sys.executable, "-m", "syncdrop", "-v", "ppl", "--model", s.model, "--tp", str(s.world), "--backend",
           s.backend, "--device", s.device, "--seq-len", str(s.fault_seq_len), "--batch-size", "1",
           "--dist-timeout", f"{s.fault_dist_timeout:g}", "-q", *ctx.cli_data_args()]
    threads = str(max(1, (os.cpu_count() or 1) // s.world))
    logs = [tmp / f"fault_rank{r}.stderr" for r in range(s.world)]
    procs: list[subprocess.Popen] = []
    victim = s.world - 1
    try:
        for r in range(s.world):
            env = rank_env(r, s.world, store.port) | {"OMP_NUM_THREADS": threads}
            with logs[r].open("w") as f:
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f))
        deadline = time.monotonic() + s.timeout
        while time.monotonic() < deadline and not all(f"rank {r} ready" in _read(logs[r]) for r in range(s.world)):
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        early = {r: p.poll() for r, p in enumerate(procs) if p.poll() is not None}
        if early or time.monotonic() >= deadline:
            why = f"ranks {early} exited before the fault" if early else f"not all ranks ready in {s.timeout:.0f}s"
            return {"passed": False, "summary": why, "command": shlex.join(["syncdrop", *cmd[3:]]),
                    "stderr_tails": [_read(p).splitlines()[-20:] for p in logs]}
        procs[victim].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        bound = s.fault_dist_timeout + FAULT_MARGIN_S
        survivors = []
        for r, p in enumerate(procs):
            if r == victim:
                continue
            try:
                code = p.wait(timeout=max(0.1, t_kill + bound - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            after = time.monotonic() - t_kill
            err = _read(logs[r])
            lines = [ln for ln in err.splitlines() if ln.startswith("syncdrop:")]
            ok = (code not in (None, 0) and len(lines) == 1 and "peer rank died" in lines[0]
                  and "Traceback" not in err)
            survivors.append({"rank": r, "exit_code": code, "seconds_after_kill": None if code is None else after,
                              "message_lines": lines, "traceback": "Traceback" in err, "passed": ok,
                              "stderr_tail": err.splitlines()[-20:]})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    worst = max((x["seconds_after_kill"] or math.inf) for x in survivors)
    return {"passed": all(x["passed"] for x in survivors),
            "summary": f"{s.backend}, {s.world} ranks, rank {victim} SIGKILLed: survivors exited "
                       + ", ".join(f"{x['exit_code']}" for x in survivors) + f" within {worst:.1f}s "
                       f"(bound {bound:.0f}s)",
            "command": shlex.join(["syncdrop", *cmd[3:]]), "victim": victim, "bound_s": bound,
            "survivors": survivors}


def check_bench(ctx: Context, tmp: Path, dtype: str) -> dict[str, Any]:
    from syncdrop.plan import split_plan_list

    s = ctx.settings
    out = tmp / f"bench_{dtype}.json"
    tp_args = launch_args(ctx, s.world) if s.world > 1 else ["--tp", "1", "--device", s.device]
    argv = ["bench", "--model", s.model, *tp_args, "--dtype", dtype, "--plans", s.bench_plans, "--prompt-len",
            str(s.bench_prompt_len), "--decode-tokens", str(s.bench_decode_tokens), "--reps", str(s.bench_reps),
            "--warmup", str(s.bench_warmup), "-q", "--json", str(out), *ctx.cli_data_args()]
    run = run_cli(argv, s.timeout)
    res = json.loads(out.read_text()) if run["exit_code"] == 0 and out.is_file() else None
    if res is None:
        return {"passed": False, "summary": f"syncdrop bench exited {run['exit_code']}", "run": run}
    want = split_plan_list(s.bench_plans)
    rows = {r["plan"]: {k: r.get(k) for k in ("ttft_ms", "decode_ms", "ttft_over_baseline", "allreduces_per_forward")}
            for r in res["plans"]}
    ok = sorted(rows) == sorted(want) and all(math.isfinite(r["ttft_ms"]) and r["ttft_ms"] > 0 for r in rows.values())
    return {"passed": ok, "summary": f"{dtype} TP={s.world}: " + ", ".join(
                f"{p} TTFT {rows[p]['ttft_ms']:.1f} ms" for p in want if p in rows),
            "plans": rows, "run": run, "bench": res}
