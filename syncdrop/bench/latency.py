"""Latency benchmark: time to first token (prefill) and decode-step latency per sync plan.

Every rank runs the same loop; plans are interleaved (rep 1: A B C, rep 2: A B C, ...) so that
machine noise hits them alike; rank 0's clock is reported (ranks move in lock-step through the
collectives). Every clock reading synchronises the model's device first
(:func:`syncdrop.parallel.device.device_clock`): CUDA kernels and NCCL collectives return when
queued, so an unsynchronised reading would time the queueing.

**The ideal saving, measured inside the forward.** In every rep, after the plans, the baseline
plan (the one that communicates most, ``none`` when listed) runs once more with a
:class:`~syncdrop.bench.sync_timer.SyncTimer` on its communicator, which times each sync point of
the prefill forward and of every decode step; per sync point the slowest rank's time counts. A
plan's ideal saving in that rep is ``sum_j w_j t_j`` over the baseline's sync points, with ``w_j``
= 1 for a point the plan drops, ``1 - k/h`` for a partial one
(:func:`~syncdrop.bench.sync_timer.saving_weights`). The isolated all-reduce (zeros, right after a
barrier, as before) is kept as a separate figure (``ideal_saving_isolated_ms``); it leaves out rank
skew and wake-up and so understates what dropping a sync point saves.

**Intervals.** Medians come with 95% percentile-bootstrap intervals over reps, paired across plans
(:mod:`syncdrop.bench.stats`): each plan's median TTFT and decode step, its ratio to the baseline,
and ``realised / ideal`` with ``realised`` = baseline median - plan median. Reps continue past
``reps`` (up to ``max_reps``) until every plan's median TTFT interval is within
``+-target_rel_ci`` of the median; all ranks take the same decision (the maximum over ranks of
"not yet").

The plan facts come from the plan (:class:`~syncdrop.plan.SyncPlan`): ``allreduces_per_forward``
is :attr:`~syncdrop.plan.SyncPlan.collectives_per_forward` (a partial sync counts as one
collective, ``p = 0`` as none), ``comm_units`` is :meth:`~syncdrop.plan.SyncPlan.comm_units`.
Partial-sync plans also all-gather the logits (vocab-parallel head); that gather is timed
(``sync_points.gather_*``) but is not a sync point of the baseline, so no ideal saving counts it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from syncdrop.bench.stats import bootstrap_ci, median_ci, median_of, relative_half_width
from syncdrop.bench.sync_timer import SyncTimer, saving_weights, slowest_rank
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


def _rep_sync_times(model, comm: Communicator, prompt: torch.Tensor, decode_tokens: int,
                    n_points: int) -> tuple[list[float], list[float], float]:
    """One instrumented generation of ``model`` (the baseline plan): per sync point, the slowest rank's
    seconds in the prefill forward and averaged over the decode steps, and the gather seconds of the
    prefill (0 without a vocab-parallel head)."""
    timer = SyncTimer(comm, model.device)
    model.comm = timer
    try:
        comm.barrier()
        generate(model, prompt, decode_tokens + 1, clock=device_clock(model.device))
    finally:
        model.comm = comm
    times = slowest_rank(comm, timer.times, model.device)
    sync = [t for t, k in zip(times, timer.kinds, strict=True) if k == "sync"]
    gather = [t for t, k in zip(times, timer.kinds, strict=True) if k == "gather"]
    forwards = decode_tokens + 1
    if len(sync) != forwards * n_points:
        raise RuntimeError(f"sync timer: {len(sync)} all-reduces in {forwards} forwards, expected {n_points} each")
    steps = [sync[f * n_points : (f + 1) * n_points] for f in range(forwards)]  # (forwards, points)
    decode = [statistics.mean(col) for col in zip(*steps[1:], strict=True)] if decode_tokens else [0.0] * n_points
    return steps[0], decode, gather[0] if gather else 0.0


def _ci_ms(ci: tuple[float, float] | None) -> list[float] | None:
    return None if ci is None else [ci[0] * 1e3, ci[1] * 1e3]


def _allreduce_sweep(model, B: int, S: int) -> tuple[dict, list[dict]]:
    """Isolated all-reduce timings over the payload sweep the cost model fits alpha and beta to
    (decode, prefill and between): ``(ar, sizes)`` with ``ar`` = the prefill and decode entries."""
    hidden, elem = model.cfg.hidden_size, model.dtype.itemsize
    sizes = []
    for tokens in sorted({1, B, max(1, B * S // 8), max(1, B * S // 2), B * S}):
        samples = time_all_reduce(model.comm, hidden, tokens, model.geo.r, model.dtype, model.device)
        sizes.append({"tokens": tokens, "bytes": tokens * hidden * elem, "median_ms": _median_ms(samples),
                      "samples_ms": [s * 1e3 for s in samples]})
    ar = {what: next(x for x in sizes if x["tokens"] == tokens) for what, tokens in (("prefill", B * S), ("decode", B))}
    return ar, sizes


def latency_bench(
    model_for: Callable[[SyncPlan], Any], plans: list[tuple[str, SyncPlan]], prompt: torch.Tensor,
    decode_tokens: int, reps: int, warmup: int, progress: bool = True, max_reps: int | None = None,
    target_rel_ci: float = 0.03, links: list[tuple[str, Any]] | None = None,
    use_link: Callable[[Any], None] | None = None,
) -> dict:
    """Measure every plan; returns the ``allreduce``, ``sync_points`` and ``plans`` sections of the
    result JSON (see the module docstring).

    ``model_for(plan)`` returns the model ready to run ``plan`` (the runtime's
    :meth:`~syncdrop.runtime.Built.use_plan`, which applies a checkpoint's plan logic: a distilled
    directory runs its distilled blocks only where ``plan`` drops the sync); this function never
    sets a plan itself. Every model it returns must share one communicator (``model.comm``), whose
    ``barrier()`` lines the ranks up before every timed all-reduce and generation. ``reps``: the
    minimum number of interleaved reps; ``max_reps`` (default ``reps``): the most, run while some
    plan's median TTFT interval is wider than ``+-target_rel_ci``. ``warmup`` reps run first and are
    not recorded.

    ``links``: ``[(label, link), ...]`` emulated links to interleave with the plans (every rep runs
    every plan on every link, the baseline's instrumented run included; ``use_link(link)`` switches
    the communicator's emulation, :meth:`~syncdrop.runtime.Built.use_link`). Machine drift then hits
    all links alike, so a cost model calibrated on one link and checked on the others sees the same
    machine. Returns ``{label: result}`` with one result per link (each as without ``links``).
    """
    from syncdrop.progress import progress_bar

    if not plans:
        raise ValueError("latency_bench needs at least one plan")
    if links is not None and (not links or use_link is None):
        raise ValueError("latency_bench: links needs at least one link and use_link")
    conds = links if links is not None else [(None, None)]
    max_reps = max(reps, max_reps or reps)
    B, S = prompt.shape
    model = model_for(plans[0][1])
    cfg = model.cfg
    hidden = cfg.hidden_size
    sweeps = {}
    for label, link in conds:
        if link is not None:
            use_link(link)
        sweeps[label] = _allreduce_sweep(model, B, S)
    comm = model.comm  # after use_link: the communicator every plan's model shares
    elem = model.dtype.itemsize
    units = {spec: plan.comm_units(hidden, elem) for spec, plan in plans}
    base_spec, base_plan = max(plans, key=lambda p: units[p[0]])
    points = base_plan.sync_points(hidden)
    samples = {label: {spec: {"ttft": [], "decode": []} for spec, _ in plans} for label, _ in conds}
    # per link, (reps, points): the slowest rank's seconds per sync point; and the prefill's gather seconds
    sync_prefill: dict = {label: [] for label, _ in conds}
    sync_decode: dict = {label: [] for label, _ in conds}
    gather_prefill: dict = {label: [] for label, _ in conds}
    rep = 0
    converged = False
    with progress_bar(total=(warmup + max_reps) * (len(plans) + 1) * len(conds), desc="bench", unit="run",
                      disable=not progress, leave=False) as bar:
        while True:
            for label, link in conds:
                if link is not None:
                    use_link(link)
                for spec, plan in plans:
                    model = model_for(plan)
                    model.comm.barrier()
                    g = generate(model, prompt, decode_tokens + 1, clock=device_clock(model.device))
                    if rep >= warmup:
                        samples[label][spec]["ttft"].append(g.ttft_s)
                        samples[label][spec]["decode"].append(statistics.mean(g.decode_s) if g.decode_s else 0.0)
                    bar.update()
                pre, dec, gat = _rep_sync_times(model_for(base_plan), comm, prompt, decode_tokens, len(points))
                bar.update()
                if rep >= warmup:
                    sync_prefill[label].append(pre)
                    sync_decode[label].append(dec)
                    gather_prefill[label].append(gat)
            rep += 1
            done = rep - warmup
            if done >= reps:
                wide = max(relative_half_width(samples[label][spec]["ttft"])
                           for label, _ in conds for spec, _ in plans) > target_rel_ci
                flag = comm.max_over_ranks(torch.tensor([1.0 if wide else 0.0], device=model.device))
                converged = not bool(flag.item())
                if converged or done >= max_reps:
                    break

    out = {label: summarize(plans, samples[label], sync_prefill[label], sync_decode[label], gather_prefill[label],
                            hidden, *sweeps[label], converged, target_rel_ci, element_size=elem)
           for label, _ in conds}
    return out if links is not None else out[None]


def summarize(plans: list[tuple[str, SyncPlan]], samples: dict[str, dict[str, list[float]]],
              sync_prefill: list[list[float]], sync_decode: list[list[float]], gather_prefill: list[float],
              hidden: int, ar: dict, sizes: list[dict], converged: bool, target_rel_ci: float,
              element_size: int | None = None) -> dict:
    """The result sections of a latency benchmark from its raw samples, whatever engine measured them
    (syncdrop's runtime here, vLLM in :mod:`syncdrop.serve.vllm_bench`): ``samples[spec]`` holds the
    interleaved reps' TTFT and mean decode-step seconds; ``sync_prefill`` / ``sync_decode`` the
    baseline plan's per-sync-point seconds per rep (slowest rank), in the order of
    :meth:`SyncPlan.sync_points`; ``ar`` / ``sizes`` the isolated all-reduce timings. ``element_size``:
    the bytes of the model's dtype, so that compressed sync points count their encoded bytes."""
    units = {spec: plan.comm_units(hidden, element_size) for spec, plan in plans}
    base_spec, base_plan = max(plans, key=lambda p: units[p[0]])
    points = base_plan.sync_points(hidden)
    n = len(sync_prefill)
    base = samples[base_spec]
    rows = []
    for spec, plan in plans:
        s = samples[spec]
        w = saving_weights(base_plan, plan, hidden, element_size)
        ideal_r = [sum(wj * tj for wj, tj in zip(w, t, strict=True)) for t in sync_prefill]  # per rep, s
        ideal_dec_r = [sum(wj * tj for wj, tj in zip(w, t, strict=True)) for t in sync_decode]
        n_drop = units[base_spec] - units[spec]
        row = {
            "plan": spec, "plan_summary": plan.summary(), "dropped": len(plan.dropped),
            "spd_fraction": plan.spd_fraction, "allreduces_per_forward": plan.collectives_per_forward,
            "comm_units": units[spec], "codec_units": plan.codec_units(hidden), "partial": plan.has_partial,
            "sync_points": [[p.block, p.where, p.payload] for p in plan.sync_points(hidden)],
            "ranks_diverge": plan.ranks_diverge, "vocab_gather": plan.needs_vocab_gather,
            "ideal_saving_isolated_ms": n_drop * ar["prefill"]["median_ms"],
            "ideal_decode_saving_isolated_ms": n_drop * ar["decode"]["median_ms"],
            "ttft_samples_ms": [x * 1e3 for x in s["ttft"]], "decode_samples_ms": [x * 1e3 for x in s["decode"]],
            "ideal_saving_samples_ms": [x * 1e3 for x in ideal_r],
        }
        for what, key, ideal in (("ttft", "", ideal_r), ("decode", "decode_", ideal_dec_r)):
            xs, bs = s[what], base[what]
            med, base_med, ideal_med = statistics.median(xs), statistics.median(bs), statistics.median(ideal)
            real = base_med - med

            def ratio(idx, xs=xs, bs=bs, ideal=ideal):
                i = median_of(ideal, idx)
                return (median_of(bs, idx) - median_of(xs, idx)) / i if i > 0 else None

            def rel(idx, xs=xs, bs=bs):
                return median_of(xs, idx) / median_of(bs, idx)

            row[f"{what}_ms"] = med * 1e3
            row[f"{what}_ci_ms"] = _ci_ms(median_ci(xs))
            row[f"{what}_over_baseline"] = med / base_med
            row[f"{what}_over_baseline_ci"] = None if spec == base_spec else bootstrap_ci(rel, n)
            row[f"ideal_{key}saving_ms"] = ideal_med * 1e3
            row[f"realised_{key}saving_ms"] = real * 1e3
            row[f"{key}realised_over_ideal"] = real / ideal_med if ideal_med > 0 else None
            row[f"{key}realised_over_ideal_ci"] = bootstrap_ci(ratio, n) if ideal_med > 0 else None
            iso = row[f"ideal_{key}saving_isolated_ms"] / 1e3
            row[f"{key}realised_over_isolated_ideal"] = real / iso if iso > 0 else None
            row[f"{key}realised_over_isolated_ideal_ci"] = (
                bootstrap_ci(lambda idx, xs=xs, bs=bs, iso=iso: (median_of(bs, idx) - median_of(xs, idx)) / iso, n)
                if iso > 0 else None)
        rows.append(row)
    sync = {"points": [[p.block, p.where, p.payload] for p in points], "baseline_plan": base_spec,
            "prefill_ms": [statistics.median(col) * 1e3 for col in zip(*sync_prefill, strict=True)],
            "decode_ms": [statistics.median(col) * 1e3 for col in zip(*sync_decode, strict=True)],
            "prefill_total_ms": statistics.median(sum(t) for t in sync_prefill) * 1e3,
            "decode_total_ms": statistics.median(sum(t) for t in sync_decode) * 1e3,
            "gather_prefill_ms": statistics.median(gather_prefill) * 1e3,
            "prefill_samples_ms": [[x * 1e3 for x in t] for t in sync_prefill],  # (reps, points)
            "decode_samples_ms": [[x * 1e3 for x in t] for t in sync_decode]}
    return {"baseline_plan": base_spec, "allreduce": ar, "allreduce_sizes": sizes, "sync_points": sync, "plans": rows,
            "reps_run": n, "converged": converged, "target_rel_ci": target_rel_ci}


def _interval(ci: list[float] | tuple[float, float] | None, fmt: str = "{:.2f}") -> str:
    return "" if ci is None else " [" + fmt.format(ci[0]) + ", " + fmt.format(ci[1]) + "]"


def _ratio_cell(x: float | None, ci) -> str:
    """``realised/ideal`` with its interval; a ratio above 1 is only stated as such when its whole
    interval is above 1 (otherwise the measurement does not show that the plan beat its ideal)."""
    if x is None:
        return "-"
    cell = f"{x:.2f}{_interval(ci)}"
    if ci is not None and ci[0] > 1:
        cell += " (above 1)"
    return cell


def markdown_table(result: dict) -> str:
    """Medians with their 95% bootstrap intervals in brackets (see the module docstring)."""
    lines = ["| plan | SPD | comm units | TTFT ms | TTFT / baseline | decode ms/token | ideal saving ms "
             "(in forward) | realised/ideal | decode realised/ideal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["plans"]:
        units = r.get("comm_units", r["allreduces_per_forward"])
        lines.append(
            f"| {r['plan']} | {r['spd_fraction']:.0%} | {units:.1f} | {r['ttft_ms']:.1f}"
            f"{_interval(r.get('ttft_ci_ms'), '{:.1f}')} | {r.get('ttft_over_baseline', 1.0):.3f}"
            f"{_interval(r.get('ttft_over_baseline_ci'), '{:.3f}')} | {r['decode_ms']:.2f}"
            f"{_interval(r.get('decode_ci_ms'))} | {r['ideal_saving_ms']:.1f} | "
            f"{_ratio_cell(r['realised_over_ideal'], r.get('realised_over_ideal_ci'))} | "
            f"{_ratio_cell(r['decode_realised_over_ideal'], r.get('decode_realised_over_ideal_ci'))} |")
    ar = result["allreduce"]
    lines.append("")
    sync = result.get("sync_points")
    if sync:
        lines.append(f"Sync points inside the {sync['baseline_plan']} forward ({len(sync['points'])}, slowest rank): "
                     f"prefill {sync['prefill_total_ms']:.2f} ms in all, decode {sync['decode_total_ms']:.3f} ms "
                     f"per step (medians over {result.get('reps_run', '?')} reps"
                     + ("" if result.get("converged", True) else f"; TTFT intervals not yet within "
                        f"+-{result.get('target_rel_ci', 0.03):.0%}") + ").")
    lines.append(f"One isolated all-reduce: prefill payload {ar['prefill']['bytes'] / 1e6:.2f} MB "
                 f"{ar['prefill']['median_ms']:.3f} ms; decode payload {ar['decode']['bytes'] / 1e3:.1f} kB "
                 f"{ar['decode']['median_ms']:.3f} ms (medians).")
    return "\n".join(lines) + "\n"
