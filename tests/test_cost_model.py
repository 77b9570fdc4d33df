"""The analytical cost model (:mod:`syncdrop.bench.cost`) and ``syncdrop predict``: formulas; fits checked
against least-squares answers computed in closed form here, on hand-made points and on the committed bench
files under results/latency/ (real SmolLM2 TP=2 measurements); predictions of the committed emulated-link
runs evaluated by hand and against their measured TTFT; parameter recovery on synthetic files; bad input.
The cluster prediction is in test_cost_cluster.py. No timing."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from syncdrop.bench.cost.arch import MODELS, RankShare, block_shares, get_model, layer_weights
from syncdrop.bench.cost.bench_files import load_bench
from syncdrop.bench.cost.check import check, check_summary
from syncdrop.bench.cost.comm import CommModel
from syncdrop.bench.cost.compute import ComputeModel, decode_work, prefill_work
from syncdrop.bench.cost.fit import BETA_BOUNDS, Calibration, calibrate, fit_alpha_beta
from syncdrop.bench.cost.forward import predict_decode, predict_ttft
from syncdrop.bench.link import Link
from syncdrop.bench.predict import add_parser
from syncdrop.bench.ring import ring_all_reduce_s
from syncdrop.cli import main
from syncdrop.errors import SyncdropError
from syncdrop.plan import parse_plan

LATENCY = Path(__file__).resolve().parent.parent / "results" / "latency"
NOEMUL, SHARE30, SHARE55 = (LATENCY / f"tp2_{n}.json" for n in ("none", "share30", "share55"))

TRUE = {"alpha": 40e-6, "beta": 2e9, "flops": 20e9, "overhead": 0.5e-3, "sync": 0.0, "codec": 0.0, "codec_b": 0.0}
PLANS = ["none", "frac:0.3", "frac:0.5", "frac:0.7", "all"]


def synthetic_bench(prompt_len: int, link: Link | None = None, noise: float = 0.02, seed: int = 0,
                    model: str = "smollm2", tp: int = 2, decode_tokens: int = 8, true: dict = TRUE,
                    plan_specs: list[str] = PLANS) -> dict:
    """A bench-shaped result whose times come from the cost model with ``TRUE`` parameters, x (1 +- noise)."""
    rng = random.Random(seed)
    link = link or Link()
    cfg = MODELS[model]
    comm = CommModel(true["alpha"], true["beta"], link.bandwidth, link.latency, true["sync"],
                     codec_s=true.get("codec", 0.0), codec_s_per_byte=true.get("codec_b", 0.0))
    compute = ComputeModel(true["flops"], true["overhead"])
    L, h = cfg.num_layers, cfg.hidden_size

    def jitter(x: float) -> float:
        return x * (1 + rng.uniform(-noise, noise))

    ar = {}
    for what, tokens in (("prefill", prompt_len), ("decode", 1)):
        t = comm.collective(tokens * h * 4, tp)  # isolated: no in-forward sync cost
        samples = [jitter(t) * 1e3 for _ in range(5)]
        ar[what] = {"tokens": tokens, "bytes": tokens * h * 4, "median_ms": sorted(samples)[2], "samples_ms": samples}
    plans = []
    ctx = prompt_len + (decode_tokens + 1) / 2
    for spec in plan_specs:
        plan = parse_plan(spec, L)
        n = 2 * L - len(plan.dropped)
        u, c = plan.comm_units(h, 4), plan.codec_units(h)
        ttft = predict_ttft(cfg, tp, prompt_len, n, compute, comm, comm_units=u, codec_units=c)
        dec = predict_decode(cfg, tp, round(ctx), n, compute, comm, comm_units=u, codec_units=c)
        plans.append({"plan": spec, "dropped": len(plan.dropped), "spd_fraction": plan.spd_fraction,
                      "allreduces_per_forward": n, "ttft_ms": jitter(ttft) * 1e3, "decode_ms": jitter(dec) * 1e3,
                      **({"comm_units": u, "codec_units": c} if c else {})})
    return {"settings": {"model": model, "tp": tp, "prompt_len": prompt_len, "batch": 1,
                         "decode_tokens": decode_tokens, "reps": 5, "dtype": "float32", "link": link.to_dict(),
                         "hidden_size": h, "num_layers": L, "threads_per_rank": 1},
            "allreduce": ar, "baseline_plan": "none", "plans": plans}


def write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def run_predict(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="syncdrop")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["predict", *argv])
    return args.func(args)


# ---------------------------------------------------------------------------- formulas


def test_ring_allreduce_formula() -> None:
    a, b = 10e-6, 1e9
    assert ring_all_reduce_s(1e6, 1, a, b) == 0.0
    assert ring_all_reduce_s(0, 4, a, b) == pytest.approx(6 * a)  # latency term only: 2(N-1) alpha
    assert ring_all_reduce_s(1e6, 4, a, b) == pytest.approx(6 * a + 1.5 * 1e6 / b)
    big, twice = ring_all_reduce_s(1e9, 8, a, b), ring_all_reduce_s(2e9, 8, a, b)
    assert twice / big == pytest.approx(2.0, rel=1e-3)  # bandwidth-dominated: doubles
    small, twice_small = ring_all_reduce_s(10, 8, a, b), ring_all_reduce_s(20, 8, a, b)
    assert twice_small / small == pytest.approx(1.0, rel=1e-3)  # latency-dominated: flat


def test_emulated_term_is_the_ring_link_py_waits() -> None:
    """The cost model's emulated term is what EmulatedLinkComm waits: a ring over N ranks on the link."""
    link = Link(bandwidth=3e8, latency=50e-6)
    for n in (0, 2304, 589824):
        for N in (1, 2, 3, 8):
            want = 0.0 if N == 1 else 2 * (N - 1) * 50e-6 + 2 * (N - 1) / N * n / 3e8
            emulated_only = CommModel(0.0, math.inf, link.bandwidth, link.latency)  # no real-link term
            assert emulated_only.collective(n, N) == pytest.approx(want, abs=1e-15)
            assert link.all_reduce_s(n, N) == pytest.approx(want, abs=1e-15)
            gather = 0.0 if N == 1 else (N - 1) * 50e-6 + (N - 1) / N * n / 3e8
            assert link.all_gather_s(n, N) == pytest.approx(gather, abs=1e-15)
    comm = CommModel(1e-5, 1e9, link.bandwidth, link.latency)
    assert comm.allreduce(589824, 2) == pytest.approx(ring_all_reduce_s(589824, 2, 1e-5, 1e9)
                                                      + link.all_reduce_s(589824, 2))
    assert comm.allreduce(589824, 1) == 0.0  # one rank: no collective at all
    assert comm.emulated_link == link


def test_forward_comm_splits_latency_and_bandwidth() -> None:
    """A forward of n collectives whose payloads sum to u full ones: n x the per-message part + u x the
    per-byte part, written out here for a ring on 4 ranks and an emulated link; u = n is n full ones."""
    a, b, bw, lat, sync, nb, N = 10e-6, 1e9, 2e8, 50e-6, 1e-4, 1e6, 4
    comm = CommModel(a, b, bw, lat, sync)
    per_msg = 2 * (N - 1) * (a + lat) + sync  # the emulated link is a ring too
    per_byte = 2 * (N - 1) / N * (nb / b + nb / bw)
    assert comm.forward(nb, N, 8, 2.0) == pytest.approx(8 * per_msg + 2.0 * per_byte, rel=1e-12)
    assert comm.forward(nb, N, 8) == comm.forward(nb, N, 8, 8.0) == 8 * comm.allreduce(nb, N)
    assert comm.forward(nb, N, 8, 2.0, in_forward=False) == pytest.approx(8 * (per_msg - sync) + 2.0 * per_byte)
    assert comm.forward(nb, 1, 8, 2.0) == 0.0


def test_partial_plans_in_bench_files_are_predicted_by_units(tmp_path) -> None:
    """A bench row of a partial-sync plan (8 collectives of 1/4 payload each, vocab-parallel head):
    check() predicts compute with the head's FLOPs / N plus 8 per-message costs and 2 full payloads,
    as evaluated here; the same row without comm_units (an older file) counts 8 full payloads."""
    d = synthetic_bench(128, Link(3e8, 50e-6), seed=4)
    row = {"plan": "partial:0.25", "dropped": 0, "spd_fraction": 0.0, "allreduces_per_forward": 60,
           "comm_units": 15.0, "partial": True, "vocab_gather": True, "ttft_ms": 100.0, "decode_ms": 10.0}
    d["plans"] = [row]
    cal = Calibration(40e-6, 2e9, 1e-4, ComputeModel(20e9, 0.5e-3), ("x",), 2, 10)
    (got,) = [r for r in check(cal, [load_bench(write(tmp_path / "p.json", d))]) if r["what"] == "ttft"]
    cfg, nb = MODELS["smollm2"], 128 * 576 * 4
    flops = prefill_work(cfg, 2, 128).flops - 2 * 576 * 49152 / 2  # vocab-parallel head on 2 ranks
    per_msg = 2 * 40e-6 + 2 * 50e-6 + 1e-4  # ring of 2 ranks: 2 steps, on the real and the emulated link
    per_byte = nb / 2e9 + nb / 3e8
    want = flops / 20e9 + 30 * 0.5e-3 + 60 * per_msg + 15.0 * per_byte
    assert got["predicted_ms"] == pytest.approx(want * 1e3, rel=1e-12)
    assert got["allreduces_per_forward"] == 60 and got["comm_units"] == 15.0
    old = {k: v for k, v in row.items() if k not in ("comm_units", "vocab_gather")}
    d["plans"] = [old]
    (got_old,) = [r for r in check(cal, [load_bench(write(tmp_path / "o.json", d))]) if r["what"] == "ttft"]
    assert got_old["comm_units"] == 60.0  # no comm_units: every collective a full payload
    assert got_old["predicted_ms"] == pytest.approx((want + 45.0 * per_byte) * 1e3, rel=1e-12)


def test_llama2_shapes_and_flops() -> None:
    cfg = get_model("LLaMA2-70B")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
            cfg.vocab_size, cfg.head_dim) == (80, 8192, 64, 8, 28672, 32000, 128)
    params = cfg.num_layers * layer_weights(cfg, block_shares(cfg, 1)[0]) + 2 * cfg.hidden_size * cfg.vocab_size
    assert params == pytest.approx(69.0e9, rel=0.01)
    assert layer_weights(MODELS["llama2-7b"], block_shares(MODELS["llama2-7b"], 1)[0]) * 32 \
        + 2 * 4096 * 32000 == pytest.approx(6.74e9, rel=0.01)
    # 8 ranks: an even split of everything.
    assert block_shares(cfg, 8)[0] == RankShare(8, 1, 3584)
    # SmolLM2 on 2 ranks: 5 + 4 query heads, KV head 1 on both (syncdrop's sharding rule).
    assert block_shares(MODELS["smollm2"], 2)[0] == RankShare(5, 2, 768)
    w = prefill_work(cfg, 8, 2048)
    assert w.matmul_flops == pytest.approx(2 * 80 * layer_weights(cfg, block_shares(cfg, 8)[0]) * 2048)
    assert w.attn_flops == pytest.approx(4 * 80 * 8 * 128 * 2048 * 2049 / 2)
    assert w.head_flops == 2 * 8192 * 32000  # last position only, replicated head
    assert prefill_work(cfg, 8, 2048, lm_head_parallel=True).head_flops == 2 * 8192 * 32000 / 8


# ---------------------------------------------------------------------------- calibration


# SmolLM2-135M (the committed bench files' model) on 2 ranks, slowest rank: 5 query heads, 2 KV heads,
# 768 MLP channels (block_shares, checked in test_llama2_shapes_and_flops); d = 576 / 9 = 64.
SMOL = {"L": 30, "h": 576, "d": 64, "q": 5, "kv": 2, "ffn": 768, "V": 49152}


def smollm2_tp2_flops(seq: int | None = None, context: int | None = None) -> float:
    """FLOPs of the slowest rank, written out from the formulas in docs/cost_model.md: a prefill of
    ``seq`` tokens (LM head on the last position), or one decode step attending to ``context`` keys."""
    L, h, d, q, kv, ffn, V = (SMOL[k] for k in ("L", "h", "d", "q", "kv", "ffn", "V"))
    p_layer = h * q * d + 2 * h * kv * d + q * d * h + 3 * h * ffn  # = 1,843,200 weights per block
    if seq is not None:
        return 2 * L * p_layer * seq + 4 * L * q * d * seq * (seq + 1) / 2 + 2 * h * V
    return 2 * L * p_layer + 4 * L * q * d * context + 2 * h * V


def test_hand_flops_match_the_model() -> None:
    """The code's work counts equal the hand formulas for the committed bench settings."""
    cfg = MODELS["smollm2"]
    assert prefill_work(cfg, 2, 256).flops == pytest.approx(smollm2_tp2_flops(seq=256), rel=1e-12)
    assert decode_work(cfg, 2, 260).flops == pytest.approx(smollm2_tp2_flops(context=260), rel=1e-12)
    assert smollm2_tp2_flops(seq=256) == 29_631_381_504


def test_alpha_beta_fit_is_the_closed_form_least_squares() -> None:
    """Three hand-made all-reduce timings that no (alpha, beta) fits exactly: the relative least-squares
    answer, solved here by Cramer's rule on the 2x2 normal equations, is what fit_alpha_beta returns. Two
    timings on an exact line are recovered exactly."""
    pts = [(1e3, 2, 30e-6), (1e5, 2, 150e-6), (1e6, 4, 900e-6)]  # (bytes, ranks, seconds)
    a = [2 * (n - 1) / t for _, n, t in pts]  # coefficient of alpha, each row divided by its time
    b = [2 * (n - 1) / n * nb / t for nb, n, t in pts]  # coefficient of 1/beta
    saa, sbb, sab = sum(x * x for x in a), sum(x * x for x in b), sum(x * y for x, y in zip(a, b, strict=True))
    det = saa * sbb - sab**2
    alpha = (sum(a) * sbb - sum(b) * sab) / det
    inv_beta = (saa * sum(b) - sab * sum(a)) / det
    assert alpha > 0 and inv_beta > 0  # the non-negativity constraint is inactive here
    got_alpha, got_beta, _ = fit_alpha_beta(pts)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_beta == pytest.approx(1 / inv_beta, rel=1e-9)
    # exact: alpha = 20 us, beta = 1 GB/s on 2 ranks -> T = 2 alpha + n / beta
    exact = [(n, 2, 2 * 20e-6 + n / 1e9) for n in (2304, 589824)]
    assert fit_alpha_beta(exact)[:2] == pytest.approx((20e-6, 1e9), rel=1e-9)


def test_alpha_beta_from_a_payload_sweep() -> None:
    """Four payload sizes on a ring of 3 with 1% multiplicative noise: alpha and beta come back within
    a few percent and no note is raised; a sweep that is flat in the payload is flagged degenerate."""
    import random

    rng = random.Random(1)
    pts = [(b, 3, ring_all_reduce_s(b, 3, 30e-6, 2e9) * (1 + rng.uniform(-0.01, 0.01)))
           for b in (2304, 73728, 294912, 589824)]
    alpha, beta, notes = fit_alpha_beta(pts)
    assert alpha == pytest.approx(30e-6, rel=0.05) and beta == pytest.approx(2e9, rel=0.05) and notes == []
    flat = [(b, 3, 1e-3) for b in (2304, 73728, 294912)]
    alpha, beta, notes = fit_alpha_beta(flat)
    assert alpha == pytest.approx(1e-3 / 4) and beta == BETA_BOUNDS[1] and "degenerate" in notes[0]


def test_alpha_beta_fit_of_the_committed_bench_file() -> None:
    """results/latency/tp2_none.json: the 2304-byte (decode) all-reduce took longer than the 589824-byte
    (prefill) one, so the exact two-point solution has a negative 1/beta; non-negative least squares puts
    1/beta = 0 (beta at its upper bound) and alpha = argmin sum (2 alpha / t_i - 1)^2 = sum(1/t_i) / (2
    sum(1/t_i^2)); the calibration says the fit degenerated and that 2 payload sizes cannot check it."""
    d = json.loads(NOEMUL.read_text())
    (b1, t1), (b2, t2) = ((d["allreduce"][ph]["bytes"], d["allreduce"][ph]["median_ms"] / 1e3)
                          for ph in ("prefill", "decode"))
    assert (b1, b2) == (589824, 2304) and (t1 - t2) / (b1 - b2) < 0  # exact fit: negative slope 1/beta
    alpha = (1 / t1 + 1 / t2) / (2 * (1 / t1**2 + 1 / t2**2))
    cal = calibrate([load_bench(NOEMUL, "--calibrate")])
    assert cal.alpha == pytest.approx(alpha, rel=1e-9) and cal.beta == BETA_BOUNDS[1]
    assert any("does not grow with the payload" in n and "degenerate" in n for n in cal.fit_notes)
    assert any("from 2 payload size(s): fewer than 3" in n for n in cal.fit_notes)
    assert fit_alpha_beta([(b, 2, t) for b, t in ((b1, t1), (b2, t2))])[:2] == pytest.approx((alpha, BETA_BOUNDS[1]),
                                                                                         rel=1e-9)


def _compute_least_squares(path: Path, alpha: float, beta: float) -> np.ndarray:
    """The compute fit of one committed file solved here: the 3x3 normal equations of the relative
    least squares ``(T - n T_ring) / T = FLOPs/T x0 + L/T x1 + n/T x2`` (a ring all-reduce of b bytes on 2
    ranks: ``T_ring = 2 alpha + b / beta``) over every plan's TTFT (prefill of 256 tokens) and decode step
    (context round(256 + 9/2) = 260: Python rounds half to even)."""
    d = json.loads(path.read_text())
    X, y = [], []
    for p in d["plans"]:
        n = p["allreduces_per_forward"]
        for flops, t, b in ((smollm2_tp2_flops(seq=256), p["ttft_ms"] / 1e3, 256 * 576 * 4),
                            (smollm2_tp2_flops(context=260), p["decode_ms"] / 1e3, 576 * 4)):
            X.append([flops / t, SMOL["L"] / t, n / t])
            y.append((t - n * (2 * alpha + b / beta)) / t)
    A, v = np.array(X), np.array(y)
    return np.linalg.solve(A.T @ A, A.T @ v)


def test_compute_fit_of_the_committed_bench_file() -> None:
    """1/F_eff, t_layer and t_sync fitted to tp2_none.json's 5 plans x (TTFT, decode) are the closed-form
    least-squares solution computed here (all three positive, so the constraint is inactive)."""
    cal = calibrate([load_bench(NOEMUL, "--calibrate")])
    inv_f, t_layer, t_sync = _compute_least_squares(NOEMUL, cal.alpha, cal.beta)
    assert min(inv_f, t_layer, t_sync) > 0
    assert cal.compute.flops_per_s == pytest.approx(1 / inv_f, rel=1e-6)
    assert cal.compute.layer_overhead_s == pytest.approx(t_layer, rel=1e-6)
    assert cal.sync_s == pytest.approx(t_sync, rel=1e-6)
    assert cal.compute_points == 10 and cal.allreduce_points == 2


def _hand_ttft_ms(cal: dict, emul: dict, n_ar: int) -> float:
    """TTFT of the committed SmolLM2 runs by the formula, from a calibration dict (``to_dict`` keys) and a
    bench file's link: FLOPs/F + L t_layer + n_ar (T_ring + latency + bytes/bandwidth + t_sync)."""
    payload = 256 * 576 * 4
    ring = 2 * cal["alpha_s"] + (payload / cal["beta_Bps"])  # 2(N-1) alpha + 2(N-1)/N n/beta at N=2
    link = emul["settings"]["link"]
    emu = (link["latency_s"] or 0.0) + (payload / link["bandwidth_Bps"] if link["bandwidth_Bps"] else 0.0)
    compute = smollm2_tp2_flops(seq=256) / cal["flops_per_s"] + SMOL["L"] * cal["layer_overhead_s"]
    return (compute + n_ar * (ring + emu + cal["sync_overhead_s"])) * 1e3


def test_predictions_of_the_committed_emulated_runs() -> None:
    """Calibrated on tp2_none.json only, the model's TTFT for every plan of the two committed emulated-link
    runs (93 and 30 MB/s + 50 us) equals the formula evaluated here, and is within the documented 15% of
    the TTFT those runs measured."""
    cal = calibrate([load_bench(NOEMUL, "--calibrate")])
    files = {str(f): json.loads(f.read_text()) for f in (SHARE30, SHARE55)}
    rows = [r for r in check(cal, [load_bench(f) for f in (SHARE30, SHARE55)]) if r["what"] == "ttft"]
    assert len(rows) == 10
    for r in rows:
        plan = next(p for p in files[r["file"]]["plans"] if p["plan"] == r["plan"])
        assert r["measured_ms"] == pytest.approx(plan["ttft_ms"], rel=1e-12)
        assert r["predicted_ms"] == pytest.approx(_hand_ttft_ms(cal.to_dict(), files[r["file"]],
                                                                plan["allreduces_per_forward"]), rel=1e-9)
        assert abs(r["predicted_ms"] / plan["ttft_ms"] - 1) <= 0.15, r


def test_calibration_recovers_true_parameters(tmp_path) -> None:
    runs = [load_bench(write(tmp_path / f"b{S}.json", synthetic_bench(S, seed=S)), "--calibrate")
            for S in (64, 256)]
    cal = calibrate(runs)
    assert cal.alpha == pytest.approx(TRUE["alpha"], rel=0.1)
    assert cal.beta == pytest.approx(TRUE["beta"], rel=0.1)
    assert cal.compute.flops_per_s == pytest.approx(TRUE["flops"], rel=0.1)
    assert cal.compute.layer_overhead_s == pytest.approx(TRUE["overhead"], rel=0.25)
    assert cal.sync_s < 0.1 * TRUE["overhead"]


def test_calibration_recovers_sync_overhead(tmp_path) -> None:
    true = {**TRUE, "sync": 2e-3}  # every in-forward sync point costs 2 ms more than an isolated all-reduce
    runs = [load_bench(write(tmp_path / f"b{S}.json", synthetic_bench(S, seed=S, noise=0.005, true=true)))
            for S in (64, 256)]
    cal = calibrate(runs)
    assert cal.sync_s == pytest.approx(2e-3, rel=0.15)
    assert cal.compute.flops_per_s == pytest.approx(TRUE["flops"], rel=0.1)
    assert calibrate(runs, fit_sync=False).sync_s == 0.0


def test_calibration_recovers_codec_time_and_predicts_compressed_plans(tmp_path) -> None:
    """Compressed sync points encode and decode on the ranks' cores: 0.3 ms per point plus 2 ms per MB of
    payload here. Calibrated on un-emulated runs that include compressed plans, the fit recovers both terms
    (and nothing when no plan compresses), and predicts the emulated runs of every plan within 3%; without
    the codec terms the compressed plans' predictions would be short by the codec time."""
    true = {**TRUE, "codec": 0.3e-3, "codec_b": 2e-9}
    specs = ["none", "frac:0.5", "int8", "frac:0.5+int8", "int4:g32", "all+int8"]
    runs = [load_bench(write(tmp_path / f"b{S}.json", synthetic_bench(S, seed=S, noise=0.002, true=true,
                                                                      plan_specs=specs)), "--calibrate")
            for S in (64, 256)]
    cal = calibrate(runs)
    assert cal.codec_s == pytest.approx(0.3e-3, rel=0.2) and cal.codec_s_per_byte == pytest.approx(2e-9, rel=0.2)
    assert cal.compute.flops_per_s == pytest.approx(TRUE["flops"], rel=0.1)
    plain = calibrate([load_bench(write(tmp_path / "p.json", synthetic_bench(128, seed=3)), "--calibrate")])
    assert (plain.codec_s, plain.codec_s_per_byte) == (0.0, 0.0)
    emulated = load_bench(write(tmp_path / "e.json", synthetic_bench(128, Link(1e8, 50e-6), seed=9, noise=0.002,
                                                                     true=true, plan_specs=specs)))
    rows = [r for r in check(cal, [emulated]) if r["what"] == "ttft"]
    assert len(rows) == len(specs) and max(abs(r["rel_err"]) for r in rows) < 0.03
    codec_free = Calibration(cal.alpha, cal.beta, cal.sync_s, cal.compute, cal.files, 0, 0)
    short = {r["plan"]: r["rel_err"] for r in check(codec_free, [emulated]) if r["what"] == "ttft"}
    assert short["int8"] < short["none"] - 0.01


def test_link_fit_reads_the_fastest_sample_of_bimodal_timings(tmp_path) -> None:
    """Isolated all-reduce samples on a loaded CPU: the link's cost, or that plus a 4 ms scheduler tick in
    about half of them. The link model fits the fastest sample, so alpha and beta are the true ones whichever
    mode the median falls in (with the medians, the big payloads' ticks would make beta ~100x too small)."""
    d = synthetic_bench(128, seed=5)
    comm = CommModel(TRUE["alpha"], TRUE["beta"])
    sizes = []
    for i, n in enumerate((2304, 36864, 147456, 294912)):
        t = comm.collective(n, 2) * 1e3
        samples = [t + (4.0 if (j + i) % 2 else 0.0) for j in range(9 - i % 2)]  # ticks in 4 or 5 of 9 / 8
        sizes.append({"bytes": n, "median_ms": sorted(samples)[len(samples) // 2], "samples_ms": samples})
    d["allreduce_sizes"] = sizes
    run = load_bench(write(tmp_path / "b.json", d), "--calibrate")
    alpha, beta, _ = fit_alpha_beta([(b, 2, t) for b, t in run.allreduce_sizes])
    assert alpha == pytest.approx(TRUE["alpha"], rel=1e-6) and beta == pytest.approx(TRUE["beta"], rel=1e-6)
    for x in sizes:
        del x["samples_ms"]  # a file without samples: the medians, as written
    medians = load_bench(write(tmp_path / "m.json", d), "--calibrate").allreduce_sizes
    assert [t for _, t in medians] == [x["median_ms"] / 1e3 for x in sizes]


def test_calibration_predicts_emulated_runs(tmp_path) -> None:
    cal_run = load_bench(write(tmp_path / "none.json", synthetic_bench(128, seed=1)), "--calibrate")
    cal = calibrate([cal_run])
    checks = [load_bench(write(tmp_path / f"e{i}.json", synthetic_bench(128, link, seed=10 + i)))
              for i, link in enumerate([Link(3e8, 50e-6), Link(3e7, 50e-6)])]
    rows = check(cal, [cal_run, *checks])
    ttft = [r for r in rows if r["what"] == "ttft" and not r["calibration"]]
    assert len(ttft) == 2 * len(PLANS)
    assert max(abs(r["rel_err"]) for r in ttft) < 0.06
    summary = check_summary(rows)
    assert summary["heldout_ttft"]["within_tolerance"] and summary["heldout_ttft"]["n"] == 10


def test_calibration_refuses_emulated_file(tmp_path) -> None:
    run = load_bench(write(tmp_path / "e.json", synthetic_bench(128, Link(3e8, 0.0))), "--calibrate")
    with pytest.raises(SyncdropError, match="--calibrate .*emulation"):
        calibrate([run])


def test_cli_end_to_end(tmp_path, capsys) -> None:
    none = write(tmp_path / "none.json", synthetic_bench(128, seed=2))
    emu = write(tmp_path / "emu.json", synthetic_bench(128, Link(1e8, 50e-6), seed=3))
    out = tmp_path / "cm.json"
    rc = run_predict(["--calibrate", none, "--check", emu, "--cluster", "llama2-70b", "--gpus", "8",
                      "--links", "300GB/s,10GB/s@20us", "--prompt-lens", "128,2048", "--spd-step", "0.25",
                      "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["provenance"]["command"]
    assert res["check"]["summary"]["heldout_ttft"]["within_tolerance"]
    assert res["calibration"]["files"] == [none]
    assert {r["spd_fraction"] for r in res["cluster"]["rows"]} == {0, 0.25, 0.5, 0.75, 1.0}
    assert res["cluster"]["links"][1]["alpha_s"] == pytest.approx(20e-6)
    md = (tmp_path / "cm.md").read_text()
    assert "Predicted vs measured" in md and "llama2-70b" in md
    assert "Predicted vs measured" in capsys.readouterr().out


def test_predict_cli_on_committed_bench_files(tmp_path, capsys) -> None:
    """`syncdrop predict --calibrate tp2_none.json --check tp2_share30.json` (in-process): the calibration
    it writes has the closed-form alpha of that file and an infinite beta, and its printed table carries
    each file's measured TTFT and the prediction evaluated here from the written calibration."""
    out = tmp_path / "cm.json"
    assert main(["predict", "--calibrate", str(NOEMUL), "--check", str(SHARE30), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    cal = res["calibration"]
    ar = json.loads(NOEMUL.read_text())["allreduce"]
    t1, t2 = ar["prefill"]["median_ms"] / 1e3, ar["decode"]["median_ms"] / 1e3
    assert cal["alpha_s"] == pytest.approx((1 / t1 + 1 / t2) / (2 * (1 / t1**2 + 1 / t2**2)), rel=1e-9)
    assert cal["beta_Bps"] == BETA_BOUNDS[1] and cal["files"] == [str(NOEMUL)]
    assert f"alpha = {cal['alpha_s'] * 1e6:.1f} us, beta = {cal['beta_Bps'] / 1e6:.1f} MB/s (2 timings)" in text
    assert "- fit note: the all-reduce time does not grow with the payload" in text
    emul = json.loads(SHARE30.read_text())
    for name, path in (("none (fit)", NOEMUL), ("93.2439MB/s+50us", SHARE30)):
        bench = json.loads(path.read_text())
        for p in bench["plans"]:
            pred = _hand_ttft_ms(cal, bench, p["allreduces_per_forward"])
            spd = f"{p['spd_fraction']:.0%}"
            line = (f"| {name} | 256 | ttft | {p['plan']} | {spd} | {p['allreduces_per_forward']} | "
                    f"{p['ttft_ms']:.2f} | {pred:.2f} | {(pred / p['ttft_ms'] - 1) * 100:+.1f}% |")
            assert line in text, line
    held = [r for r in res["check"]["rows"] if r["what"] == "ttft" and not r["calibration"]]
    assert len(held) == len(emul["plans"]) == 5
    worst = max(abs(_hand_ttft_ms(cal, emul, p["allreduces_per_forward"]) / p["ttft_ms"] - 1) for p in emul["plans"])
    assert res["check"]["summary"]["heldout_ttft"]["max_abs_rel_err"] == pytest.approx(worst, rel=1e-9)
    assert (tmp_path / "cm.md").read_text().count("| ttft |") == 10


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("content, match", [
    (None, "--calibrate .*no such file"),
    ("{not json", "--calibrate .*malformed JSON"),
    ('{"results": []}', "--calibrate .*not a syncdrop bench result"),
    ('[1, 2]', "--calibrate .*not a syncdrop bench result"),
])
def test_bad_bench_files(tmp_path, content, match) -> None:
    p = tmp_path / "x.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(SyncdropError, match=match):
        run_predict(["--calibrate", str(p)])


def test_bad_times_and_model(tmp_path) -> None:
    d = synthetic_bench(128)
    d["plans"][1]["ttft_ms"] = 0.0
    with pytest.raises(SyncdropError, match="--check .*time is zero"):
        load_bench(write(tmp_path / "zero.json", d))
    d = synthetic_bench(128)
    d["settings"]["num_layers"] = 31
    with pytest.raises(SyncdropError, match="--check .*L=31"):
        load_bench(write(tmp_path / "shape.json", d))


def test_bad_check_file_names_check(tmp_path) -> None:
    none = write(tmp_path / "none.json", synthetic_bench(128))
    bad = tmp_path / "bad.json"
    bad.write_text('{"settings": {}}')
    with pytest.raises(SyncdropError, match="--check .*bad.json.*not a syncdrop bench result"):
        run_predict(["--calibrate", none, "--check", str(bad)])


@pytest.mark.parametrize("argv, match", [
    (["--cluster", "gpt-5"], "--cluster 'gpt-5': unknown model"),
    (["--cluster", "llama2-70b", "--links", "fast"], "--links 'fast'"),
    (["--cluster", "llama2-70b", "--links", "10GB/s@soon"], "--links '10GB/s@soon'"),
    (["--cluster", "llama2-70b", "--prompt-lens", "128,x"], "--prompt-lens"),
    (["--cluster", "llama2-70b", "--mfu", "1.5"], "--mfu"),
    (["--cluster", "llama2-70b", "--gpus", "100"], "--gpus 100"),
    (["--cluster", "llama2-70b", "--spd-step", "0.3"], "--spd-step"),
    (["--cluster", "llama2-70b", "--hbm", "lots"], "--hbm"),
    ([], "predict needs"),
    (["--check", "x.json"], "--check needs --calibrate"),
])
def test_bad_arguments(argv, match) -> None:
    with pytest.raises(SyncdropError, match=match):
        run_predict(argv)


def test_compute_counts_come_from_the_runtime_layouts() -> None:
    """The slowest rank's share is asked of ShardLayout: SmolLM2 (9 heads, 3 KV heads, 1536 channels)
    at TP=2 is 5 query heads with 2 KV heads (KV head 1 replicated), at TP=3 3 + 1; a head-grouping layout
    that interleaves KV groups on block 0 makes each rank there read 3 KV heads, and only block 0's
    attention K/V work grows."""
    from syncdrop.parallel.sharding import ShardLayout

    cfg = MODELS["smollm2"]
    assert block_shares(cfg, 2)[0] == RankShare(5, 2, 768)
    assert block_shares(cfg, 3)[0] == RankShare(3, 1, 512)
    mixed = ShardLayout.build(cfg, 3, head_order=[0, 3, 6, 1, 4, 7, 2, 5, 8])
    shares = block_shares(cfg, 3, {0: mixed})
    assert shares[0] == RankShare(3, 3, 512) and set(shares[1:]) == {RankShare(3, 1, 512)}
    plain, grouped = decode_work(cfg, 3, 100), decode_work(cfg, 3, 100, block_layouts={0: mixed})
    h, d = cfg.hidden_size, cfg.head_dim
    assert grouped.matmul_flops - plain.matmul_flops == 2.0 * 2 * h * 2 * d  # K and V of 2 more KV heads
    assert grouped.bytes_read - plain.bytes_read == (2 * h * 2 * d + 2 * 2 * d * 100) * 4
    with pytest.raises(SyncdropError, match="--gpus 10: must be between 1 and the model's 9 query heads"):
        block_shares(cfg, 10)
