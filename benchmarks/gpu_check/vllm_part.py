"""The vLLM part: syncdrop's plugin in vLLM's default compiled path (Dynamo, CUDA graphs), on a random-weight Llama.

``vllm_tp1``  one GPU. The model exported at TP = 1 with every block SPD (``syncdrop export --plan all``) is served
              through the plugin, and the model as it is by stock vLLM; vLLM's defaults for compilation and CUDA
              graphs, ``--vllm-dtype`` (bfloat16). At TP = 1 an SPD block is the dense block with its additions
              in another order, so the two must agree within the dtype's rounding. Passes when
              * the plugin's classes are active: ``Syncdrop<arch>`` with every decoder layer an SPD layer, and
                stock vLLM's ``<arch>`` with none;
              * both engines compiled their model, kept the CUDA-graph mode their configuration asked for (vLLM
                lowers it in the worker when a backend cannot capture it: a *downgrade*) and captured graphs;
              * ``max |logp_plugin - logp_stock| <= tol`` over every prompt token, with
                ``tol = max(floor, 2 * max |logp_stock - logp_ref|)``: ``logp_ref`` is syncdrop's simulated
                executor in fp32 on the CPU, so the plugin may differ from stock vLLM by at most twice what the
                dtype's rounding moves stock vLLM (two rounding paths differ by about sqrt(2) times one);
                ``floor`` is 1e-3 for float32 and 0.05 for bfloat16.
``vllm_tp2``  two or more GPUs. The model exported at TP = 2 under :data:`TP2_PLAN` (SPD and dense blocks
              alternating) through the plugin at TP = 2, against syncdrop's simulated executor (fp32, CPU) under
              the same plan: ``max |logp_plugin - logp_ref_spd| <= tol`` with the noise measured on stock vLLM
              at TP = 2 against the dense reference; and the plan must move the reference by more than ``tol``
              (else the check could not tell SPD from dense). The same facts about classes (the plan's blocks
              SPD on both ranks), compilation and graphs.

Skipped, with the reason, where vLLM is not installed (:func:`gpu_check.context.vllm_python`), and
``vllm_tp2`` with fewer than two GPUs. In the CPU dry run both run on vLLM's CPU backend in float32 (no CUDA
graphs there: the mode is NONE and is checked not to change), with Dynamo's eager backend
(``VLLM_CPU_CI_ENV=1``, vLLM's own switch for its CPU CI) unless the environment sets it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_check.context import Context
from gpu_check.distributed import run_cli

log = logging.getLogger("gpu_check")

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parents[1]
TP2_PLAN = "blocks:0,2,4,6"  # SPD and dense blocks alternating: both layer kinds, and the hand-over between them
FLOOR = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.02}


def prompts(ctx: Context) -> list[list[int]]:
    """Seeded random prompts in the tokenizer's id range (3..299: the random model's tokenizer has 300)."""
    import torch

    s = ctx.settings
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 300, (s.vllm_prompts, s.vllm_prompt_len), generator=g).tolist()


def engine_env(ctx: Context, tp: int, cache: Path) -> dict[str, str]:
    """The vLLM process's environment: this tree and this package on ``PYTHONPATH`` (the plugin, the worker
    extension), a fresh compile cache (every run compiles), no hub, and vLLM's CPU settings where relevant."""
    from syncdrop.serve.engine import engine_env as cpu_env

    env = cpu_env(tp)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PACKAGE_DIR.parent), *(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(ROOT), str(PACKAGE_DIR.parent)))])
    env["VLLM_CACHE_ROOT"] = str(cache)
    # the engine core in its own process: the front end's configuration then keeps the CUDA-graph mode asked for,
    # and the worker's is the one it settled on (in one process they would be the same object)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if ctx.settings.dry_run:
        env.setdefault("VLLM_CPU_CI_ENV", "1")
    return env


def run_engine(ctx: Context, tmp: Path, name: str, job: dict[str, Any]) -> dict[str, Any]:
    """One :mod:`gpu_check.vllm_worker` job in the vLLM interpreter; its output goes to ``tmp/name.log``.
    Returns the worker's result, or ``{"error": one line, "log_tail": [...]}``."""
    s = ctx.settings
    log_path, out = tmp / f"{name}.log", tmp / f"{name}.json"
    # the check's own process keeps a CUDA context: ask vLLM for half the GPU, not its default 0.9 (plenty here)
    job = {**job, "out": str(out), "dtype": s.vllm_dtype, "max_model_len": 256,
           "gpu_memory_utilization": None if s.dry_run else 0.5}
    (tmp / f"{name}.job.json").write_text(json.dumps(job))
    t0 = time.monotonic()
    log.info("vLLM %s: %s at TP=%d (%s)", name, job["model"], job["tp"], s.vllm_python)
    with log_path.open("w") as f:
        try:
            code = subprocess.run([s.vllm_python, "-m", "gpu_check.vllm_worker", str(tmp / f"{name}.job.json")],
                                  stdout=f, stderr=subprocess.STDOUT, timeout=s.vllm_timeout, cwd=tmp,
                                  env=engine_env(ctx, int(job["tp"]), tmp / f"{name}_cache")).returncode
        except subprocess.TimeoutExpired:
            code = None
    tail = log_path.read_text(errors="replace").splitlines()[-30:]
    if code != 0 or not out.is_file():
        why = f"timed out after {s.vllm_timeout:.0f}s" if code is None else f"exited {code}"
        errors = [ln.strip() for ln in tail if "Error" in ln or "error:" in ln]
        return {"error": f"vLLM {name} {why}" + (f": {errors[-1][:300]}" if errors else ""), "log_tail": tail}
    res = json.loads(out.read_text())
    res["seconds"] = time.monotonic() - t0
    return res


def export(ctx: Context, tmp: Path, tp: int, plan: str) -> tuple[Path | None, dict[str, Any]]:
    """``syncdrop export`` of the random model at ``tp`` under ``plan`` (a subprocess, as a user runs it)."""
    out = tmp / f"export_tp{tp}"
    run = run_cli(["export", "--model", str(ctx.vllm_model()), "--tp", str(tp), "--plan", plan, "--out", str(out),
                   "-q"], ctx.settings.timeout)
    return (out if run["exit_code"] == 0 else None), run


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def engine_facts(res: dict[str, Any], ctx: Context, arch: str, spd: list[int]) -> list[str]:
    """What is wrong with how an engine ran (empty when nothing): the device, this tree's syncdrop, the model
    class and its SPD layers on every worker, compilation, and the CUDA-graph mode."""
    cuda = ctx.settings.device.startswith("cuda")
    bad = []
    if not Path(res["syncdrop_file"]).resolve().is_relative_to(ROOT):
        bad.append(f"vLLM imported syncdrop from {res['syncdrop_file']}, not from {ROOT}")
    if res.get("device_type") != ("cuda" if cuda else "cpu"):
        bad.append(f"vLLM ran on {res.get('device_type')}")
    if res["enforce_eager"]:
        bad.append("enforce_eager is set")
    for r, w in enumerate(res["workers"]):
        if w["model_class"] != arch or w["spd_layers"] != spd:
            bad.append(f"rank {r}: {w['model_class']} with SPD layers {w['spd_layers']}, expected {arch} with {spd}")
        if not w["compiled"] or not all(w["compiled"].values()):
            bad.append(f"rank {r}: model not compiled ({w['compilation_mode']}: {w['compiled']})")
        if w["cudagraph_resolved"] != res["cudagraph_requested"]:
            bad.append(f"rank {r}: CUDA graphs downgraded {res['cudagraph_requested']} -> {w['cudagraph_resolved']}")
        elif cuda and (w["cudagraph_resolved"] == "NONE" or not w["compilation_counter"]["num_cudagraph_captured"]):
            bad.append(f"rank {r}: no CUDA graphs ({w['cudagraph_resolved']}, "
                       f"{w['compilation_counter']['num_cudagraph_captured']} captured)")
    return bad


def skip_reason(ctx: Context, tp: int) -> str | None:
    s = ctx.settings
    if s.vllm_python is None:
        from gpu_check.context import vllm_python

        return vllm_python(None)[1]
    if not s.dry_run and s.gpus < tp:
        return f"needs {tp} GPUs, this machine has {s.gpus}"
    return None


def brief(res: dict[str, Any]) -> dict[str, Any]:
    """An engine's result without the per-token lists (those are kept once, under ``logprobs``)."""
    return {k: v for k, v in res.items() if k not in ("prompt_logprobs", "token_logprobs")}


def check_vllm(ctx: Context, tmp: Path, tp: int) -> dict[str, Any]:
    """``vllm_tp1`` (``tp`` = 1) or ``vllm_tp2`` (``tp`` = 2): see the module docstring."""
    from syncdrop.models.hf_reader import SERVED_ARCH_PREFIX
    from syncdrop.serve.parity import reference_logprobs

    s = ctx.settings
    why = skip_reason(ctx, tp)
    if why:
        return {"passed": True, "skipped": True, "summary": f"skipped: {why}"}
    plan = "all" if tp == 1 else TP2_PLAN
    out, exp_run = export(ctx, tmp, tp, plan)
    if out is None:
        return {"passed": False, "summary": f"syncdrop export exited {exp_run['exit_code']}", "export": exp_run}
    cfg = json.loads((out / "config.json").read_text())
    base_arch, arch = cfg["architectures"][0].removeprefix(SERVED_ARCH_PREFIX), cfg["architectures"][0]
    spd = sorted(i for i, b in enumerate(cfg["syncdrop_plan"]["blocks"]) if b["attn"] == "drop")
    ps, model = prompts(ctx), str(ctx.vllm_model())
    stock = run_engine(ctx, tmp, f"stock_tp{tp}", {"model": model, "tp": tp, "prompts": ps,
                                                    "max_tokens": s.vllm_max_tokens})
    plugin = run_engine(ctx, tmp, f"plugin_tp{tp}", {"model": str(out), "tp": tp, "prompts": ps,
                                                      "max_tokens": s.vllm_max_tokens})
    failed = [r["error"] for r in (stock, plugin) if "error" in r]
    if failed:
        return {"passed": False, "summary": "; ".join(failed), "export": exp_run,
                "log_tails": {k: r.get("log_tail") for k, r in (("stock", stock), ("plugin", plugin))}}
    ref_dense = reference_logprobs(model, tp, ps, s.vllm_max_tokens, "none")
    noise = max_abs_diff(stock["prompt_logprobs"], ref_dense["prompt_logprobs"])
    tol = max(FLOOR.get(s.vllm_dtype, 0.05), 2 * noise)
    bad = [f"stock: {b}" for b in engine_facts(stock, ctx, base_arch, [])]
    bad += [f"plugin: {b}" for b in engine_facts(plugin, ctx, arch, spd)]
    res: dict[str, Any] = {"tp": tp, "plan": plan, "spd_blocks": spd, "dtype": s.vllm_dtype, "prompts": ps,
                           "noise_stock_vs_ref": noise, "tol": tol, "export": exp_run,
                           "engines": {"stock": brief(stock), "plugin": brief(plugin)}}
    if tp == 1:
        d = max_abs_diff(plugin["prompt_logprobs"], stock["prompt_logprobs"])
        res |= {"max_abs_dlogp_plugin_vs_stock": d, "tokens_equal": plugin["tokens"] == stock["tokens"],
                "logprobs": {"stock": stock["prompt_logprobs"], "plugin": plugin["prompt_logprobs"],
                             "reference_fp32": ref_dense["prompt_logprobs"]}}
        if d > tol:
            bad.append(f"plugin vs stock vLLM: max |dlogp| {d:.3g} > tol {tol:.3g}")
        what = f"plugin vs stock max |dlogp| {d:.2e} (tol {tol:.2e})"
    else:
        ref_spd = reference_logprobs(model, tp, ps, s.vllm_max_tokens, plan)
        d = max_abs_diff(plugin["prompt_logprobs"], ref_spd["prompt_logprobs"])
        gap = max_abs_diff(ref_spd["prompt_logprobs"], ref_dense["prompt_logprobs"])
        res |= {"max_abs_dlogp_plugin_vs_simulated": d, "plan_effect": gap,
                "tokens_equal": plugin["tokens"] == ref_spd["tokens"],
                "logprobs": {"stock": stock["prompt_logprobs"], "plugin": plugin["prompt_logprobs"],
                             "reference_fp32_dense": ref_dense["prompt_logprobs"],
                             "reference_fp32_spd": ref_spd["prompt_logprobs"]}}
        if d > tol:
            bad.append(f"plugin vs simulated executor: max |dlogp| {d:.3g} > tol {tol:.3g}")
        if gap <= tol:
            bad.append(f"plan {plan} moves the reference by {gap:.3g}, not more than tol {tol:.3g}: "
                       "the check cannot tell SPD from dense")
        what = f"plugin vs simulated max |dlogp| {d:.2e} (tol {tol:.2e}; the plan moves it {gap:.2e})"
    graphs = plugin["workers"][0]["cudagraph_resolved"]
    res |= {"passed": not bad, "problems": bad,
            "summary": f"{s.vllm_dtype}, {plugin['compilation_mode_requested']}, CUDA graphs {graphs}: {what}"
                       + (f"; {bad[0]}" if bad else "")}
    return res
