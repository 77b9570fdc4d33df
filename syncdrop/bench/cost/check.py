"""Predicted vs measured on bench files: the calibrated model (:mod:`.fit`) plus each file's emulated link.

For every file, its isolated all-reduces (``T_ring + T_emu``) and, for every plan, its TTFT and decode
step at the mean context (:mod:`.forward`, with ``T_ar = T_ring + T_emu + t_sync``)::

    rel_err = predicted / measured - 1

The summary reports the worst and median ``|rel_err|`` of the TTFT predictions, separately for the
held-out files and for the calibration files themselves.
"""

from __future__ import annotations

import statistics
from typing import Any

from syncdrop.bench.cost.bench_files import BenchRun
from syncdrop.bench.cost.fit import Calibration
from syncdrop.bench.cost.forward import predict_decode, predict_ttft


def check(cal: Calibration, runs: list[BenchRun]) -> list[dict[str, Any]]:
    """Predicted vs measured TTFT and decode step of every plan of ``runs`` (emulated link added)."""
    rows = []
    for r in runs:
        comm = cal.comm.with_emulation(r.emu_bandwidth, r.emu_latency, r.emu_formula)
        for phase, (b, t) in r.allreduce.items():
            pred = comm.collective(b, r.tp)
            rows.append({"file": r.path, "link": r.link_label, "prompt_len": r.prompt_len, "what": f"allreduce:{phase}",
                         "plan": "-", "spd_fraction": None, "allreduces_per_forward": None,
                         "measured_ms": t * 1e3, "predicted_ms": pred * 1e3, "rel_err": pred / t - 1,
                         "calibration": r.path in cal.files})
        for p in r.plans:
            n, u, vp, c = p["allreduces_per_forward"], p["comm_units"], p["vocab_gather"], p["codec_units"]
            ttft = predict_ttft(r.cfg, r.tp, r.prompt_len, n, cal.compute, comm, r.batch, r.dtype_bytes, vp, u, c)
            dec = predict_decode(r.cfg, r.tp, round(r.decode_context), n, cal.compute, comm, r.batch, r.dtype_bytes,
                                 vp, u, c)
            for what, pred, meas in (("ttft", ttft, p["ttft_s"]), ("decode", dec, p["decode_s"])):
                rows.append({"file": r.path, "link": r.link_label, "prompt_len": r.prompt_len, "what": what,
                             "plan": p["plan"], "spd_fraction": p["spd_fraction"], "allreduces_per_forward": n,
                             "comm_units": u,
                             "measured_ms": meas * 1e3, "predicted_ms": pred * 1e3, "rel_err": pred / meas - 1,
                             "calibration": r.path in cal.files})
    return rows


def check_summary(rows: list[dict[str, Any]], tolerance: float = 0.15) -> dict[str, Any]:
    """Worst and median |relative error| of TTFT predictions on held-out (non-calibration) files."""
    held = [abs(r["rel_err"]) for r in rows if r["what"] == "ttft" and not r["calibration"]]
    fit = [abs(r["rel_err"]) for r in rows if r["what"] == "ttft" and r["calibration"]]
    out: dict[str, Any] = {"tolerance": tolerance}
    for name, xs in (("heldout_ttft", held), ("calibration_ttft", fit)):
        out[name] = ({"n": len(xs), "max_abs_rel_err": max(xs), "median_abs_rel_err": statistics.median(xs),
                      "within_tolerance": max(xs) <= tolerance} if xs else {"n": 0})
    return out
