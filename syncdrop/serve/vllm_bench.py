"""Latency of sync plans inside vLLM: TTFT and decode per plan, the ideal measured inside vLLM's forward.

One engine serves every plan of a run: the model is exported under plan ``all`` (every block converted to
the plugin's SPD block), and before each measurement the plan's dropped blocks are switched on
(:func:`syncdrop.serve.vllm_models.set_dropped`, through the worker extension of
:mod:`syncdrop.serve.vllm_link`), the others run as stock
blocks. Plans are interleaved rep by rep, so machine noise hits them alike; weights do not change the
timing, so plans are measured zero-shot. ``stock=True`` runs unmodified vLLM on the original architecture
instead (plan ``none`` only), for comparison under the same link.

Per rep and plan: TTFT = wall time of a 1-token generation of the prompt (prefix caching off); decode =
(wall time of a 1 + D token generation - TTFT) / D. Then the baseline plan runs once more with vLLM's
tensor-parallel collectives clocked (:mod:`syncdrop.serve.vllm_link`: from call to end, so a rank's time
includes its wait for the slowest rank; the slowest rank counts per sync point). The link emulation runs
inside those collectives, with the ring formula syncdrop's own emulation uses. The summary, intervals and
``realised / ideal`` are :func:`syncdrop.bench.latency.summarize`'s, exactly as for ``syncdrop bench``.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from syncdrop.bench.latency import summarize
from syncdrop.bench.ring import Link
from syncdrop.errors import SyncdropError
from syncdrop.plan import DROP, SyncPlan, resolve_plan

log = logging.getLogger(__name__)


def link_env(link: Link) -> dict[str, str]:
    """The environment that makes the plugin emulate ``link`` and clock the collectives."""
    from syncdrop.serve.vllm_link import ENV_BANDWIDTH, ENV_INSTRUMENT, ENV_LATENCY

    env = {ENV_INSTRUMENT: "1"}
    if link.active:
        env[ENV_LATENCY] = repr(link.latency)
        if link.bandwidth:
            env[ENV_BANDWIDTH] = repr(link.bandwidth)
    return env


def vllm_bench(model_spec: str, tp: int, plan_specs: list[str], prompt: list[int], decode_tokens: int, reps: int,
               warmup: int, workdir: str | Path, link: Link | None = None, max_reps: int | None = None,
               target_rel_ci: float = 0.03, stock: bool = False, dtype: str = "float32",
               timeout: float = 3600.0) -> dict[str, Any]:
    """Measure ``plan_specs`` of ``model_spec`` in vLLM at ``tp`` ranks (see the module docstring); returns the
    ``allreduce``, ``sync_points`` and ``plans`` sections of a ``syncdrop bench`` result, plus ``engine``."""
    from syncdrop.models.loading import resolve_model
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
    if stock and any(p.dropped for _, p in plans):
        raise SyncdropError("stock vLLM runs plan none only", field="plans")
    vllm_python()  # fail before exporting when there is no vLLM environment
    exported = export_model(model_spec, tp, workdir / ("export_none" if stock else "export_all"),
                            "none" if stock else SyncPlan.uniform(L, DROP), force=True, progress=False)
    units = {spec: plan.comm_units(hidden) for spec, plan in plans}
    base_spec, base_plan = max(plans, key=lambda p: units[p[0]])
    S = len(prompt)
    job = {"mode": "bench", "model": str(exported.out), "tp": tp, "dtype": dtype, "prompt": prompt,
           "decode_tokens": decode_tokens, "reps": reps, "warmup": warmup, "max_reps": max(reps, max_reps or reps),
           "target_ci": target_rel_ci, "hidden": hidden,
           "payload_tokens": sorted({1, max(1, S // 8), max(1, S // 2), S}),
           "plans": [{"spec": s, "dropped": None if stock else p.dropped} for s, p in plans], "baseline": base_spec,
           "n_points": len(base_plan.sync_points(hidden)),
           "max_model_len": min(cfg.max_positions, S + decode_tokens + 64)}
    raw = run_job(job, workdir / ("vllm_stock.log" if stock else "vllm_bench.log"), timeout=timeout,
                  env=link_env(link))
    elem = 2 if dtype == "bfloat16" else 4
    sizes = [{"tokens": z["tokens"], "bytes": z["tokens"] * hidden * elem,
              "median_ms": statistics.median(z["samples_s"]) * 1e3, "samples_ms": [x * 1e3 for x in z["samples_s"]]}
             for z in raw["sizes"]]
    ar = {what: next(z for z in sizes if z["tokens"] == tokens) for what, tokens in (("prefill", S), ("decode", 1))}
    res = summarize(plans, raw["samples"], raw["sync_prefill"], raw["sync_decode"], raw["gather_prefill"], hidden, ar,
                    sizes, raw["converged"], target_rel_ci)
    res["sync_points"]["embedding_prefill_ms"] = statistics.median(raw["embed_prefill"]) * 1e3
    res["engine"] = {"name": "vllm-stock" if stock else "vllm+syncdrop", "architectures": raw["architectures"],
                     "startup_s": raw["startup_s"], "export": str(exported.out)}
    return res
