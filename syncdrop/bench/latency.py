"""Latency benchmark: time to first token (prefill) and decode-step latency per sync plan.

Every rank runs the same loop; plans are interleaved (rep 1: A B C, rep 2: A B C, ...) so that
machine noise hits them alike; rank 0's clock is reported (ranks move in lock-step through the
collectives). Beside the plans it times one all-reduce of each payload the model sends (prefill:
``(B*S, h)``, decode: ``(B, h)``) through the same communicator, so the *ideal* saving of a plan is
``dropped all-reduces x measured all-reduce time`` and ``realised / ideal`` says how much of it the
runtime turns into wall-clock time.

Partial-sync plans (CAAT-Net) send ``k/h`` of each all-reduce's payload; a plan's communication is
counted in full-all-reduce units, ``sum over sync points of k/h`` (``comm_units``; a dropped sync
point counts 0), and the ideal saving is ``(baseline units - plan units) x all-reduce time``: a
bandwidth-only estimate (a partial all-reduce still pays the full per-message latency). Their
vocab-parallel LM head also all-gathers the logits, which the ideal saving leaves out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from syncdrop.generate import generate
from syncdrop.plan import SyncPlan


def time_all_reduce(comm, hidden: int, tokens: int, local_ranks: int, dtype: torch.dtype, device: torch.device,
                    reps: int = 20, barrier: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds per all-reduce of a ``(tokens, hidden)`` payload, ``reps`` samples after 3 warm-ups."""
    x = torch.zeros((local_ranks, tokens, hidden), dtype=dtype, device=device)
    out = []
    for i in range(3 + reps):
        barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize(device)
        if i >= 3:
            out.append(time.perf_counter() - t0)
    return out


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def latency_bench(
    model, plans: list[tuple[str, SyncPlan]], prompt: torch.Tensor, decode_tokens: int, reps: int, warmup: int,
    barrier: Callable[[], None] = lambda: None, progress: bool = True,
) -> dict:
    """Measure every plan; returns the ``allreduce`` and ``plans`` sections of the result JSON."""
    from tqdm import tqdm

    B, S = prompt.shape
    cfg, comm = model.cfg, model.comm
    ar = {}
    for what, tokens in (("prefill", B * S), ("decode", B)):
        samples = time_all_reduce(comm, cfg.hidden_size, tokens, model.geo.r, model.dtype, model.device,
                                  barrier=barrier)
        ar[what] = {"tokens": tokens, "bytes": tokens * cfg.hidden_size * model.embed.element_size(),
                    "median_ms": _median_ms(samples), "samples_ms": [s * 1e3 for s in samples]}
    samples = {spec: {"ttft": [], "decode": []} for spec, _ in plans}
    total = (warmup + reps) * len(plans)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, leave=False) as bar:
        for rep in range(warmup + reps):
            for spec, plan in plans:
                model.plan = plan
                barrier()
                g = generate(model, prompt, decode_tokens + 1)
                if rep >= warmup:
                    samples[spec]["ttft"].append(g.ttft_s)
                    samples[spec]["decode"].append(statistics.mean(g.decode_s))
                bar.update()
    def units(plan: SyncPlan) -> float:
        return sum(plan.payload_fraction(cfg.hidden_size))

    base_spec = max(plans, key=lambda p: units(p[1]))[0]
    base = samples[base_spec]
    rows = []
    for spec, plan in plans:
        s = samples[spec]
        n_drop = units(dict(plans)[base_spec]) - units(plan)
        ttft, dec = _median_ms(s["ttft"]), _median_ms(s["decode"])
        ideal = n_drop * ar["prefill"]["median_ms"]
        ideal_dec = n_drop * ar["decode"]["median_ms"]
        real = _median_ms(base["ttft"]) - ttft
        real_dec = _median_ms(base["decode"]) - dec
        rows.append({
            "plan": spec, "plan_summary": plan.summary(), "dropped": len(plan.dropped),
            "spd_fraction": plan.spd_fraction, "allreduces_per_forward": 2 * plan.num_blocks - len(plan.dropped),
            "comm_units": units(plan), "partial": plan.has_partial,
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
