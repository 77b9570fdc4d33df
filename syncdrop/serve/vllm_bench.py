"""Latency of sync plans inside vLLM: TTFT and decode per plan, the ideal measured inside vLLM's forward.

**One engine per plan.** vLLM compiles the model at its first forward (one Dynamo trace, guards dropped;
CUDA graphs on GPUs), so a plan cannot be switched inside a running engine
(:func:`syncdrop.serve.vllm_models.set_dropped` refuses it). The model is exported once under plan ``all``
(every block written as the plugin's SPD block) and each plan gets an engine of its own on that export,
``syncdrop_plan`` overridden with the plan (``hf_overrides``: the plugin converts exactly the blocks it
drops; the others stay stock blocks). Weights do not change the timing, so plans are measured zero-shot.
The engines run one after another, so machine drift between them is not paired away as it was when plans
were interleaved in one eager engine: compare medians, and rerun when the machine was busy.
``stock=True`` runs unmodified vLLM on the original architecture instead (plan ``none`` only), for
comparison under the same link. Engines compile as vLLM does by default; ``eager=True`` runs them all
eagerly.

Timing engines (per rep: TTFT = wall time of a 1-token generation of the prompt, prefix caching off;
decode = (wall time of a 1 + D token generation - TTFT) / D) run with the sync clock off: no collective
synchronises the device, except that an emulated link (:mod:`syncdrop.serve.vllm_link`, the ring formula
syncdrop's own emulation uses) synchronises before it waits. Then one **diagnostic engine** serves the
baseline plan (the one that communicates most) with vLLM's tensor-parallel collectives clocked (from call
to end, so a rank's time includes its wait for the slowest rank; the slowest rank counts per sync point)
and times isolated all-reduces of the prompt's sizes; its own TTFT is not reported. Engines that emulate a
link or clock run with CUDA graphs off (the wait and the clock run on the host; compilation stays on).
All-reduce payload bytes follow the engine's dtype (:meth:`syncdrop.plan.modes.Full.wire_bytes`). The
summary, intervals and ``realised / ideal`` are :func:`syncdrop.bench.latency.summarize`'s, exactly as for
``syncdrop bench``; every sample list is cut to the shortest engine's reps so that they pair by index.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from syncdrop.bench.latency import summarize
from syncdrop.bench.ring import Link
from syncdrop.errors import SyncdropError
from syncdrop.io_utils import portable_path
from syncdrop.plan import DROP, FULL, SyncPlan, resolve_plan

log = logging.getLogger(__name__)


def link_env(link: Link, clock: bool = False) -> dict[str, str]:
    """The environment that makes the plugin emulate ``link`` (and, with ``clock``, clock the collectives)."""
    from syncdrop.serve.vllm_link import ENV_BANDWIDTH, ENV_INSTRUMENT, ENV_LATENCY

    env = {ENV_INSTRUMENT: "1"} if clock else {}
    if link.active:
        env[ENV_LATENCY] = repr(link.latency)
        if link.bandwidth:
            env[ENV_BANDWIDTH] = repr(link.bandwidth)
    return env


def vllm_bench(model_spec: str, tp: int, plan_specs: list[str], prompt: list[int], decode_tokens: int, reps: int,
               warmup: int, workdir: str | Path, link: Link | None = None, max_reps: int | None = None,
               target_rel_ci: float = 0.03, stock: bool = False, dtype: str = "float32",
               timeout: float = 3600.0, eager: bool = False) -> dict[str, Any]:
    """Measure ``plan_specs`` of ``model_spec`` in vLLM at ``tp`` ranks (see the module docstring); returns the
    ``allreduce``, ``sync_points`` and ``plans`` sections of a ``syncdrop bench`` result, plus ``engine``."""
    from syncdrop.models.loading import resolve_model
    from syncdrop.runtime import parse_dtype
    from syncdrop.serve.engine import run_job, vllm_python
    from syncdrop.serve.export import export_model

    link = link or Link()
    workdir = Path(workdir).resolve()  # the engine runs in a directory of its own
    source = resolve_model(model_spec)
    cfg = source.config
    L, hidden = cfg.num_layers, cfg.hidden_size
    if not plan_specs:
        raise SyncdropError("needs at least one plan", field="plans")
    plans = [(s, resolve_plan(s, L, tp=tp, serving=True, what="plans")) for s in plan_specs]
    if stock and not all(p.is_dense for _, p in plans):
        raise SyncdropError("stock vLLM runs plan none only", field="plans")
    elem = parse_dtype(dtype).itemsize  # payload bytes follow the engine's dtype
    vllm_python()  # fail before exporting when there is no vLLM environment
    exported = export_model(model_spec, tp, workdir / ("export_none" if stock else "export_all"),
                            "none" if stock else SyncPlan.uniform(L, DROP), force=True, progress=False)
    units = {spec: plan.comm_units(hidden, elem) for spec, plan in plans}
    base_spec, base_plan = max(plans, key=lambda p: units[p[0]])
    S = len(prompt)
    common = {"mode": "bench", "model": str(exported.out), "tp": tp, "dtype": dtype, "prompt": prompt,
              "decode_tokens": decode_tokens, "warmup": warmup, "eager": eager,
              "max_model_len": min(cfg.max_positions, S + decode_tokens + 64)}
    name = "vllm_stock" if stock else "vllm_bench"

    def engine(spec: str, plan: SyncPlan, tag: str, clock: bool, **job: Any) -> dict[str, Any]:
        job = {**common, **job, "cuda_graphs": not (clock or link.active)}
        if not stock:
            job["plan"] = plan.to_dict()
        log.info("vLLM engine for plan %s (%s)", spec, tag)
        return run_job(job, workdir / f"{name}_{tag}.log", timeout=timeout, env=link_env(link, clock))

    timed = {spec: engine(spec, plan, f"plan{i}", False, reps=reps, max_reps=max(reps, max_reps or reps),
                          target_ci=target_rel_ci)
             for i, (spec, plan) in enumerate(plans)}
    n = min(len(r["ttft"]) for r in timed.values())
    diag = engine(base_spec, base_plan, "diagnostic", True, diagnose=True, reps=n, hidden=hidden,
                  payload_tokens=sorted({1, max(1, S // 8), max(1, S // 2), S}),
                  n_points=len(base_plan.sync_points(hidden)))
    samples = {spec: {"ttft": r["ttft"][:n], "decode": r["decode"][:n]} for spec, r in timed.items()}
    sizes = [{"tokens": z["tokens"], "bytes": FULL.wire_bytes(z["tokens"], hidden, elem),
              "median_ms": statistics.median(z["samples_s"]) * 1e3, "samples_ms": [x * 1e3 for x in z["samples_s"]]}
             for z in diag["sizes"]]
    ar = {what: next(z for z in sizes if z["tokens"] == tokens) for what, tokens in (("prefill", S), ("decode", 1))}
    converged = all(r["converged"] for r in timed.values())
    res = summarize(plans, samples, diag["sync_prefill"], diag["sync_decode"], diag["gather_prefill"], hidden, ar,
                    sizes, converged, target_rel_ci, element_size=elem)
    res["sync_points"]["embedding_prefill_ms"] = statistics.median(diag["embed_prefill"]) * 1e3
    first = timed[plans[0][0]]
    startup = {spec: r["startup_s"] for spec, r in timed.items()}
    res["engine"] = {"name": "vllm-stock" if stock else "vllm+syncdrop", "architectures": first["architectures"],
                     "vllm_version": first["vllm_version"], "compilation": first["compilation"],
                     "engines": "one per plan, one after another, then a diagnostic engine (sync clock on)",
                     "startup_s": {**startup, "diagnostic": diag["startup_s"]}, "export": portable_path(exported.out)}
    return res
