"""Latency benchmark: time to first token (prefill) and decode-step latency per sync plan.

Every rank runs the same loop; plans are interleaved (rep 1: A B C, rep 2: A B C, ...) so that
machine noise hits them alike; rank 0's clock is reported (ranks move in lock-step through the
collectives). Beside the plans it times one all-reduce of each payload the model sends (prefill:
``(B*S, h)``, decode: ``(B, h)``) through the same communicator, so the *ideal* saving of a plan is
``dropped all-reduces x measured all-reduce time`` and ``realised / ideal`` says how much of it the
runtime turns into wall-clock time.

Every clock reading synchronises the model's device first
(:func:`syncdrop.parallel.device.device_clock`): CUDA kernels and NCCL collectives return when
queued, so an unsynchronised reading would time the queueing. The plan facts come from the plan
(:class:`~syncdrop.plan.SyncPlan`): ``allreduces_per_forward`` is
:attr:`~syncdrop.plan.SyncPlan.collectives_per_forward` (a partial sync counts as one collective,
``p = 0`` as none), ``comm_units`` is :meth:`~syncdrop.plan.SyncPlan.comm_units`.

Partial-sync plans (CAAT-Net) send ``k/h`` of each all-reduce's payload; a plan's communication is
counted in full-all-reduce units, ``sum over sync points of k/h`` (``comm_units``; a dropped sync
point counts 0), and the ideal saving is ``(baseline units - plan units) x all-reduce time``: a
bandwidth-only estimate (a partial all-reduce still pays the full per-message latency). Their
vocab-parallel LM head also all-gathers the logits, which the ideal saving leaves out.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from syncdrop.generate import generate
from syncdrop.parallel.comm import Communicator
from syncdrop.parallel.device import device_clock
from syncdrop.plan import SyncPlan


def time_all_reduce(comm: Communicator, hidden: int, tokens: int, local_ranks: int, dtype: torch.dtype,
                    device: torch.device, reps: int = 20) -> list[float]:
    """Seconds per all-reduce of a ``(tokens, hidden)`` payload (``(local_ranks, tokens, hidden)``
    zeros), ``reps`` samples after 3 warm-ups; each sample starts after ``comm.barrier()`` and both
    clock readings synchronise ``device``."""
    clock = device_clock(device)
    x = torch.zeros((local_ranks, tokens, hidden), dtype=dtype, device=device)  # (R, M, h)
    out = []
    for i in range(3 + reps):
        comm.barrier()
        t0 = clock()
        comm.all_reduce(x)
        t1 = clock()
        if i >= 3:
            out.append(t1 - t0)
    return out


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def latency_bench(
    model_for: Callable[[SyncPlan], Any], plans: list[tuple[str, SyncPlan]], prompt: torch.Tensor,
    decode_tokens: int, reps: int, warmup: int, progress: bool = True,
) -> dict:
    """Measure every plan; returns the ``allreduce`` and ``plans`` sections of the result JSON.

    ``model_for(plan)`` returns the model ready to run ``plan`` (the runtime's
    :meth:`~syncdrop.runtime.Built.use_plan`, which applies a checkpoint's plan logic: a distilled
    directory runs its distilled blocks only where ``plan`` drops the sync); this function never
    sets a plan itself. Every model it returns must share one communicator (``model.comm``), whose
    ``barrier()`` lines the ranks up before every timed all-reduce and generation. Each row's
    ``allreduces_per_forward`` / ``comm_units`` are the plan's
    :attr:`~syncdrop.plan.SyncPlan.collectives_per_forward` / :meth:`~syncdrop.plan.SyncPlan.comm_units`;
    ``sync_points`` lists ``[block, "attn" | "mlp", payload]`` and ``ranks_diverge`` /
    ``vocab_gather`` say whether rank streams can differ and whether the logits are all-gathered.
    """
    from tqdm import tqdm

    if not plans:
        raise ValueError("latency_bench needs at least one plan")
    B, S = prompt.shape
    model = model_for(plans[0][1])
    cfg, comm = model.cfg, model.comm
    hidden = cfg.hidden_size
    ar = {}
    for what, tokens in (("prefill", B * S), ("decode", B)):
        samples = time_all_reduce(comm, hidden, tokens, model.geo.r, model.dtype, model.device)
        ar[what] = {"tokens": tokens, "bytes": tokens * hidden * model.embed.element_size(),
                    "median_ms": _median_ms(samples), "samples_ms": [s * 1e3 for s in samples]}
    samples = {spec: {"ttft": [], "decode": []} for spec, _ in plans}
    total = (warmup + reps) * len(plans)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, leave=False) as bar:
        for rep in range(warmup + reps):
            for spec, plan in plans:
                model = model_for(plan)
                model.comm.barrier()
                g = generate(model, prompt, decode_tokens + 1, clock=device_clock(model.device))
                if rep >= warmup:
                    samples[spec]["ttft"].append(g.ttft_s)
                    samples[spec]["decode"].append(statistics.mean(g.decode_s))
                bar.update()

    units = {spec: plan.comm_units(hidden) for spec, plan in plans}
    base_spec = max(plans, key=lambda p: units[p[0]])[0]
    base = samples[base_spec]
    rows = []
    for spec, plan in plans:
        s = samples[spec]
        n_drop = units[base_spec] - units[spec]
        ttft, dec = _median_ms(s["ttft"]), _median_ms(s["decode"])
        ideal = n_drop * ar["prefill"]["median_ms"]
        ideal_dec = n_drop * ar["decode"]["median_ms"]
        real = _median_ms(base["ttft"]) - ttft
        real_dec = _median_ms(base["decode"]) - dec
        rows.append({
            "plan": spec, "plan_summary": plan.summary(), "dropped": len(plan.dropped),
            "spd_fraction": plan.spd_fraction, "allreduces_per_forward": plan.collectives_per_forward,
            "comm_units": units[spec], "partial": plan.has_partial,
            "sync_points": [[p.block, p.where, p.payload] for p in plan.sync_points(hidden)],
            "ranks_diverge": plan.ranks_diverge, "vocab_gather": plan.needs_vocab_gather,
            "ttft_ms": ttft, "decode_ms": dec,
            "ideal_saving_ms": ideal, "realised_saving_ms": real,
            "realised_over_ideal": real / ideal if ideal > 0 else None,
            "ideal_decode_saving_ms": ideal_dec, "realised_decode_saving_ms": real_dec,
            "decode_realised_over_ideal": real_dec / ideal_dec if ideal_dec > 0 else None,
            "ttft_samples_ms": [x * 1e3 for x in s["ttft"]], "decode_samples_ms": [x * 1e3 for x in s["decode"]],
        })
    return {"baseline_plan": base_spec, "allreduce": ar, "plans": rows}


def markdown_table(result: dict) -> str:
    lines = ["| plan | SPD | comm (all-reduce units) | TTFT ms | decode ms/token | ideal saving ms | realised/ideal "
             "| decode realised/ideal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in result["plans"]:
        units = r.get("comm_units", r["allreduces_per_forward"])
        lines.append(f"| {r['plan']} | {r['spd_fraction']:.0%} | {units:.1f} | {r['ttft_ms']:.1f} | "
                     f"{r['decode_ms']:.2f} | "
                     f"{r['ideal_saving_ms']:.1f} | {fmt(r['realised_over_ideal'])} | "
                     f"{fmt(r['decode_realised_over_ideal'])} |")
    ar = result["allreduce"]
    lines.append("")
    lines.append(f"One all-reduce: prefill payload {ar['prefill']['bytes'] / 1e6:.2f} MB "
                 f"{ar['prefill']['median_ms']:.3f} ms; decode payload {ar['decode']['bytes'] / 1e3:.1f} kB "
                 f"{ar['decode']['median_ms']:.3f} ms (medians).")
    return "\n".join(lines) + "\n"
