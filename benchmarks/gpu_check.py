"""The prepared GPU check (issue 13, point 7): syncdrop's CUDA and NCCL paths against references.

Sized for one GPU and a few minutes (under 8 on one H200, most of it model loading); with several
GPUs the NCCL checks run one rank per GPU. Checks, each written as ``OUT/<check>.json``:

``sim_vs_cpu``      the simulated executor on CUDA vs the same on the CPU, TP = 1..4, plan ``none``, and
                    the drop plan (``--drop-plan``, default ``blocks:3,7``: the SPD block in blocks 3 and
                    7) at TP = 2; fp32 perplexity on W windows of L tokens (4 x 256):
                    ``|ppl_cuda - ppl_cpu| / ppl_cpu <= 1e-4``.
``generate_vs_hf``  greedy generation (:func:`syncdrop.generate.generate`, KV cache) of the simulated
                    executor on CUDA at TP = 1 and 2 vs transformers' ``generate`` of its own dense
                    model on CUDA (the ``hf`` executor), 32 new tokens, no EOS stop: equal token for token.
``nccl_ppl``        ``syncdrop ppl --launch --tp G --backend nccl --device cuda`` with G = the number of
                    GPUs (at most the model's head count; G = 1 is NCCL with world size 1, recorded as
                    such) vs the simulated executor on CUDA at TP = G: relative difference <= 1e-4 (the
                    ring all-reduce sums in another order than the simulation: float rounding only).
``nccl_fault``      (G >= 2) G ranks started as torchrun starts them; once every rank logged ``ready``
                    the last rank is SIGKILLed; every survivor must exit non-zero within the collective
                    timeout (``--dist-timeout``) plus a margin, printing exactly one ``syncdrop:`` line
                    that says a peer rank died, and no traceback. Skipped (not failed) with one GPU.
``bench_float32``,  ``syncdrop bench`` of the plans ``none``, the drop plan and ``all`` on CUDA (TP = G
``bench_bfloat16``  under ``--launch`` / NCCL when G >= 2), in that dtype: it must exit 0 and report every
                    plan; its whole JSON is kept (timings are recorded, never asserted).

Also ``OUT/summary.json`` (every verdict) and ``OUT/README.md`` (a table). Every file holds the
command, commit, settings, GPU names, torch / CUDA / NCCL versions and the raw values, and is written
atomically. Exit code 0 when every check passes (or is skipped), 1 when one fails, 2 with one line
when CUDA is not available (unless ``--cpu-dry-run``).

``--cpu-dry-run`` runs the same pipeline on the CPU with tiny sizes (TP = 1..2, 2 windows of 64
tokens, 8 new tokens, gloo at world size 2, bench prompt 32 / 4 decode tokens / 1 rep), into
``runs/gpu_dry_run`` by default, so that the script itself is tested without a GPU. Examples:

    python benchmarks/gpu_check.py                      # on a GPU machine -> results/gpu/
    python benchmarks/gpu_check.py --checks nccl_fault  # rerun one check
    python benchmarks/gpu_check.py --cpu-dry-run --out /tmp/gpu_dry
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gpu_check")

CHECKS = ("sim_vs_cpu", "generate_vs_hf", "nccl_ppl", "nccl_fault", "bench_float32", "bench_bfloat16")
PROMPT = "Tensor parallelism splits every layer of a neural network across several devices, so that"
FAULT_MARGIN_S = 30.0  # beyond --dist-timeout, for a survivor to print its line and leave the process group


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on (recorded in every file)."""

    dry_run: bool
    device: str  # where the checked runs go: "cuda" (or "cpu" in the dry run)
    reference_device: str  # the CPU
    model: str
    dataset: str
    data_dir: str | None
    tps: tuple[int, ...]
    drop_plan: str
    drop_tp: int
    seq_len: int
    windows: int
    gen_tokens: int
    gen_tps: tuple[int, ...]
    world: int  # ranks of the distributed checks (GPUs, or 2 in the dry run)
    backend: str
    bench_prompt_len: int
    bench_decode_tokens: int
    bench_reps: int
    bench_warmup: int
    fault_seq_len: int
    fault_dist_timeout: float
    timeout: float  # seconds before a subprocess counts as hung
    rel_tol: float = 1e-4
    prompt: str = PROMPT

    @property
    def bench_plans(self) -> str:
        return f"none,{self.drop_plan},all"


def make_settings(args: argparse.Namespace, gpus: int, num_heads: int) -> Settings:
    """The full-size settings on CUDA, or the tiny ones of ``--cpu-dry-run``."""
    common = dict(model=args.model, dataset=args.dataset, data_dir=args.data_dir, drop_plan=args.drop_plan,
                  drop_tp=2, reference_device="cpu", fault_seq_len=16, fault_dist_timeout=args.fault_dist_timeout,
                  timeout=args.timeout)
    if args.cpu_dry_run:
        return Settings(dry_run=True, device="cpu", tps=(1, 2), seq_len=64, windows=2, gen_tokens=8, gen_tps=(1, 2),
                        world=args.world or 2, backend="gloo", bench_prompt_len=32, bench_decode_tokens=4,
                        bench_reps=1, bench_warmup=0, **common)
    return Settings(dry_run=False, device="cuda", tps=(1, 2, 3, 4), seq_len=256, windows=4, gen_tokens=32,
                    gen_tps=(1, 2), world=args.world or min(gpus, num_heads), backend="nccl", bench_prompt_len=256,
                    bench_decode_tokens=16, bench_reps=5, bench_warmup=1, **common)


@dataclass
class Context:
    """What checks share: the resolved text, its windows, and simulated perplexities already computed."""

    settings: Settings
    data: Any  # syncdrop.eval.data.TextDataset
    windows: Any  # (W, L) token ids
    sim_ppl: dict[tuple[str, int, str], float] = field(default_factory=dict)  # (device, tp, plan) -> ppl

    def cli_data_args(self) -> list[str]:
        """``--dataset`` (and ``--data-dir``) naming exactly the text resolved here, so that no subprocess
        probes the hub or falls back to another text."""
        d = self.data
        if d.source == "file":
            return ["--dataset", d.path]
        args = ["--dataset", d.name]
        if d.source == "data-dir":
            from syncdrop.eval.data import data_dir

            args += ["--data-dir", str(data_dir(self.settings.data_dir))]
        return args


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
            "cpu_count": os.cpu_count()}


def rel_diff(a: float, b: float) -> float:
    """``|a - b| / |b|`` (inf when either is not finite)."""
    return abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) and b != 0 else math.inf


# ---------------------------------------------------------------------------------------------- checks


def simulated_ppl(ctx: Context, device: str, tp: int, plans: list[str]) -> dict[str, dict[str, Any]]:
    """Perplexity of the simulated executor at ``tp`` on ``device`` (fp32) under each plan spec, one build
    (plans switched with :meth:`~syncdrop.runtime.Built.use_plan`); cached in ``ctx.sim_ppl``."""
    import torch

    from syncdrop.eval.perplexity import perplexity
    from syncdrop.plan import parse_plan
    from syncdrop.runtime import choose_runtime

    built = choose_runtime("simulated", device, dtype="float32").build(ctx.settings.model, tp, "none", progress=False)
    out = {}
    for spec in plans:
        built.use_plan(parse_plan(spec, built.source.config.num_layers))
        res = perplexity(built.model, ctx.windows, 1, progress=False)
        out[spec] = {"ppl": res.ppl, "window_nll": res.window_nll, "device": str(built.runtime.device)}
        ctx.sim_ppl[(device, tp, spec)] = res.ppl
    del built
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def check_sim_vs_cpu(ctx: Context) -> dict[str, Any]:
    s = ctx.settings
    rows = []
    for tp in s.tps:
        plans = ["none"] + ([s.drop_plan] if tp == s.drop_tp else [])
        ref = simulated_ppl(ctx, s.reference_device, tp, plans)
        got = simulated_ppl(ctx, s.device, tp, plans)
        for spec in plans:
            d = rel_diff(got[spec]["ppl"], ref[spec]["ppl"])
            rows.append({"tp": tp, "plan": spec, "ppl_device": got[spec]["ppl"], "ppl_cpu": ref[spec]["ppl"],
                         "rel_diff": d, "passed": d <= s.rel_tol, "device": got[spec]["device"],
                         "window_nll_device": got[spec]["window_nll"], "window_nll_cpu": ref[spec]["window_nll"]})
            log.info("sim_vs_cpu tp=%d plan=%s: ppl %.6f (%s) vs %.6f (cpu), rel diff %.2e", tp, spec,
                     got[spec]["ppl"], got[spec]["device"], ref[spec]["ppl"], d)
    worst = max(r["rel_diff"] for r in rows)
    return {"passed": all(r["passed"] for r in rows), "summary": f"max rel ppl diff {worst:.2e} (tol {s.rel_tol:g})",
            "max_rel_diff": worst, "rows": rows}


def check_generate_vs_hf(ctx: Context) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    from syncdrop.generate import generate
    from syncdrop.runtime import choose_runtime

    s = ctx.settings
    hf = choose_runtime("hf", s.device, dtype="float32").build(s.model, 1, "none", progress=False)
    tok = hf.source.load_tokenizer()
    prompt = torch.tensor([tok(s.prompt, add_special_tokens=False)["input_ids"]])  # (1, S)
    # no EOS stop on either side (min_new_tokens would instead suppress EOS in transformers)
    cfg = GenerationConfig(max_new_tokens=s.gen_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        ref = hf.model.model.generate(prompt.to(hf.model.device), generation_config=cfg).cpu()[0, prompt.shape[1]:]
    del hf
    rows = []
    for tp in s.gen_tps:
        built = choose_runtime("simulated", s.device, dtype="float32").build(s.model, tp, "none", progress=False)
        got = generate(built.model, prompt, s.gen_tokens).tokens.cpu()[0, prompt.shape[1]:]
        same = got.tolist() == ref.tolist()
        first = next((i for i, (a, b) in enumerate(zip(got.tolist(), ref.tolist(), strict=False)) if a != b), None)
        rows.append({"tp": tp, "passed": same and len(got) == s.gen_tokens, "tokens": got.tolist(),
                     "first_mismatch": first, "text": tok.decode(got), "device": str(built.runtime.device)})
        log.info("generate_vs_hf tp=%d: %s", tp, "equal" if same else f"differs from token {first}")
        del built
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"passed": all(r["passed"] for r in rows) and len(ref) == s.gen_tokens,
            "summary": f"{s.gen_tokens} greedy tokens at TP={','.join(map(str, s.gen_tps))}: "
                       + ", ".join(f"tp{r['tp']} {'equal' if r['passed'] else 'DIFFER'}" for r in rows),
            "prompt": s.prompt, "prompt_ids": prompt[0].tolist(), "hf_tokens": ref.tolist(),
            "hf_text": tok.decode(ref), "rows": rows}


def run_cli(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m syncdrop *argv`` with a timeout: exit code (None when it timed out), seconds, output tails."""
    cmd = [sys.executable, "-m", "syncdrop", *argv]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        code, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else b or ""

        code, out, err = None, text(e.stdout), text(e.stderr) + f"\n[gpu_check: timed out after {timeout:.0f}s]"
    return {"command": shlex.join(["syncdrop", *argv]), "exit_code": code, "seconds": time.monotonic() - t0,
            "stdout_tail": out.splitlines()[-10:], "stderr_tail": err.splitlines()[-20:]}


def launch_args(s: Settings, tp: int) -> list[str]:
    """``--tp`` and the runtime flags of a distributed run at ``tp`` ranks (``--launch`` starts them)."""
    return ["--tp", str(tp), "--launch", "--backend", s.backend, "--device", s.device]


def check_nccl_ppl(ctx: Context, tmp: Path) -> dict[str, Any]:
    import json

    s = ctx.settings
    out = tmp / "ppl.json"
    argv = ["ppl", "--model", s.model, *launch_args(s, s.world), "--seq-len", str(s.seq_len), "--max-windows",
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
    import json

    s = ctx.settings
    out = tmp / f"bench_{dtype}.json"
    tp_args = launch_args(s, s.world) if s.world > 1 else ["--tp", "1", "--device", s.device]
    argv = ["bench", "--model", s.model, *tp_args, "--dtype", dtype, "--plans", s.bench_plans, "--prompt-len",
            str(s.bench_prompt_len), "--decode-tokens", str(s.bench_decode_tokens), "--reps", str(s.bench_reps),
            "--warmup", str(s.bench_warmup), "-q", "--json", str(out), *ctx.cli_data_args()]
    run = run_cli(argv, s.timeout)
    res = json.loads(out.read_text()) if run["exit_code"] == 0 and out.is_file() else None
    if res is None:
        return {"passed": False, "summary": f"syncdrop bench exited {run['exit_code']}", "run": run}
    from syncdrop.plan import split_plan_list

    want = split_plan_list(s.bench_plans)
    rows = {r["plan"]: {k: r.get(k) for k in ("ttft_ms", "decode_ms", "ttft_over_baseline", "allreduces_per_forward")}
            for r in res["plans"]}
    ok = sorted(rows) == sorted(want) and all(math.isfinite(r["ttft_ms"]) and r["ttft_ms"] > 0 for r in rows.values())
    return {"passed": ok, "summary": f"{dtype} TP={s.world}: " + ", ".join(
                f"{p} TTFT {rows[p]['ttft_ms']:.1f} ms" for p in want if p in rows),
            "plans": rows, "run": run, "bench": res}


# ---------------------------------------------------------------------------------------------- output


def write_readme(out: Path, settings: Settings, env: dict[str, Any], prov: dict[str, Any],
                 verdicts: dict[str, dict[str, Any]]) -> None:
    from syncdrop.io_utils import atomic_write_text

    lines = [f"# GPU check{' (CPU dry run)' if settings.dry_run else ''}", "",
             f"`{prov['command']}` at commit `{prov['commit']}`; GPU: {env['gpu_name'] or 'none'} "
             f"(x{env['gpu_count']}); torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}; "
             f"device {settings.device}, distributed {settings.backend} at world size {settings.world}.", "",
             "| check | verdict | result | seconds |", "|---|---|---|---:|"]
    for name, v in verdicts.items():
        lines.append(f"| {name} | {v['verdict']} | {v['summary']} | {v['seconds']:.1f} |")
    lines += ["", "Files: one `<check>.json` per check (settings, environment, provenance, raw values) and "
              "`summary.json`. What each check asserts: docs/gpu.md."]
    atomic_write_text(out / "README.md", "\n".join(lines) + "\n")


def run_checks(settings: Settings, names: list[str], out: Path) -> int:
    import torch

    from syncdrop.eval.data import load_text
    from syncdrop.eval.perplexity import make_windows
    from syncdrop.io_utils import atomic_write_json, provenance
    from syncdrop.models.loading import resolve_model

    data = load_text(settings.dataset, settings.data_dir)
    tok = resolve_model(settings.model).load_tokenizer()
    windows = make_windows(tok(data.text, add_special_tokens=False)["input_ids"], settings.seq_len, settings.windows)
    ctx = Context(settings, data, windows)
    env, prov = environment(), provenance()
    funcs: dict[str, Callable[[Path], dict[str, Any]]] = {
        "sim_vs_cpu": lambda t: check_sim_vs_cpu(ctx), "generate_vs_hf": lambda t: check_generate_vs_hf(ctx),
        "nccl_ppl": lambda t: check_nccl_ppl(ctx, t), "nccl_fault": lambda t: check_nccl_fault(ctx, t),
        "bench_float32": lambda t: check_bench(ctx, t, "float32"),
        "bench_bfloat16": lambda t: check_bench(ctx, t, "bfloat16")}
    verdicts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in names:
            log.info("--- %s", name)
            t0 = time.monotonic()
            try:
                res = funcs[name](Path(tmp))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the same pipeline on the CPU with tiny sizes and gloo (tests the script without a GPU)")
    ap.add_argument("--out", default=None, help="output folder (default results/gpu; dry run: runs/gpu_dry_run)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", default="auto", help="text of the perplexity checks (default auto: WikiText-2 "
                    "test from the data folder, else the Shakespeare fallback)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--drop-plan", default="blocks:3,7", help="the drop plan checked at TP=2 and benchmarked")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks of the distributed checks (default: the number of GPUs; dry run: 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a subprocess counts as hung")
    ap.add_argument("--fault-dist-timeout", type=float, default=20.0, help="--dist-timeout of the fault check")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.checks.split(",") if c.strip()]
    bad = [c for c in names if c not in CHECKS]
    if bad or not names:
        ap.error(f"--checks must be a comma-separated subset of {','.join(CHECKS)}, got {args.checks!r}")
    if args.world is not None and args.world < 1:
        ap.error(f"--world must be at least 1, got {args.world}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.INFO)
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (torch.cuda.is_available() is False): run this on a machine with "
              "an NVIDIA GPU and a CUDA build of torch, or pass --cpu-dry-run", file=sys.stderr)
        return 2
    from syncdrop.cli_args import error_line
    from syncdrop.errors import SyncdropError
    from syncdrop.models.loading import resolve_model

    try:
        cfg = resolve_model(args.model).config
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        settings = make_settings(args, gpus, cfg.num_heads)
        out = Path(args.out or ("runs/gpu_dry_run" if args.cpu_dry_run else "results/gpu"))
        return run_checks(settings, names, out)
    except SyncdropError as e:
        print(f"gpu_check: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
