"""The analytical cost model and ``syncdrop predict``: formulas, calibration on synthetic bench files
generated from the model itself, the cluster prediction's shape, and bad input. No timing."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from syncdrop.bench import cost_model as cm
from syncdrop.bench.link import Link
from syncdrop.bench.predict import add_parser, parse_links
from syncdrop.errors import SyncdropError
from syncdrop.plan import parse_plan

TRUE = {"alpha": 40e-6, "beta": 2e9, "flops": 20e9, "overhead": 0.5e-3, "sync": 0.0}
PLANS = ["none", "frac:0.3", "frac:0.5", "frac:0.7", "all"]


def synthetic_bench(prompt_len: int, link: Link | None = None, noise: float = 0.02, seed: int = 0,
                    model: str = "smollm2", tp: int = 2, decode_tokens: int = 8, true: dict = TRUE) -> dict:
    """A bench-shaped result whose times come from the cost model with ``TRUE`` parameters, x (1 +- noise)."""
    rng = random.Random(seed)
    link = link or Link()
    cfg = cm.MODELS[model]
    comm = cm.CommModel(true["alpha"], true["beta"], link.bandwidth, link.latency, true["sync"])
    compute = cm.ComputeModel(true["flops"], true["overhead"])
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
    for spec in PLANS:
        plan = parse_plan(spec, L)
        n = 2 * L - len(plan.dropped)
        ttft = cm.predict_ttft(cfg, tp, prompt_len, n, compute, comm)
        dec = cm.predict_decode(cfg, tp, round(ctx), n, compute, comm)
        plans.append({"plan": spec, "dropped": len(plan.dropped), "spd_fraction": plan.spd_fraction,
                      "allreduces_per_forward": n, "ttft_ms": jitter(ttft) * 1e3, "decode_ms": jitter(dec) * 1e3})
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
    assert cm.ring_allreduce_time(1e6, 1, a, b) == 0.0
    assert cm.ring_allreduce_time(0, 4, a, b) == pytest.approx(6 * a)  # latency term only: 2(N-1) alpha
    assert cm.ring_allreduce_time(1e6, 4, a, b) == pytest.approx(6 * a + 1.5 * 1e6 / b)
    big, twice = cm.ring_allreduce_time(1e9, 8, a, b), cm.ring_allreduce_time(2e9, 8, a, b)
    assert twice / big == pytest.approx(2.0, rel=1e-3)  # bandwidth-dominated: doubles
    small, twice_small = cm.ring_allreduce_time(10, 8, a, b), cm.ring_allreduce_time(20, 8, a, b)
    assert twice_small / small == pytest.approx(1.0, rel=1e-3)  # latency-dominated: flat


def test_emulated_term_matches_link_py() -> None:
    link = Link(bandwidth=3e8, latency=50e-6)
    for n in (0, 2304, 589824):
        assert cm.emulated_delay(n, link.bandwidth, link.latency) == pytest.approx(link.delay(n))
    comm = cm.CommModel(1e-5, 1e9, link.bandwidth, link.latency)
    assert comm.allreduce(589824, 2) == pytest.approx(cm.ring_allreduce_time(589824, 2, 1e-5, 1e9) + link.delay(589824))
    assert comm.allreduce(589824, 1) == 0.0  # one rank: no collective at all


@pytest.mark.parametrize("L", [30, 80])
def test_spd_fraction_to_allreduce_count_matches_plans(L: int) -> None:
    assert cm.allreduces_per_forward(L, 0.0) == 2 * L
    assert cm.allreduces_per_forward(L, 1.0) == L
    for i in range(11):
        f = i / 10
        assert cm.allreduces_per_forward(L, f) == 2 * L - len(parse_plan(f"frac:{f}", L).dropped)
    with pytest.raises(SyncdropError):
        cm.allreduces_per_forward(L, 1.5)


def test_llama2_shapes_and_flops() -> None:
    cfg = cm.get_model("LLaMA2-70B")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size,
            cfg.vocab_size, cfg.head_dim) == (80, 8192, 64, 8, 28672, 32000, 128)
    params = cfg.num_layers * cm.layer_weights(cfg, cm.rank_share(cfg, 1)) + 2 * cfg.hidden_size * cfg.vocab_size
    assert params == pytest.approx(69.0e9, rel=0.01)
    assert cm.layer_weights(cm.MODELS["llama2-7b"], cm.rank_share(cm.MODELS["llama2-7b"], 1)) * 32 \
        + 2 * 4096 * 32000 == pytest.approx(6.74e9, rel=0.01)
    # 8 ranks: an even split of everything.
    assert cm.rank_share(cfg, 8) == cm.RankShare(8, 1, 3584)
    # SmolLM2 on 2 ranks: 5 + 4 query heads, KV head 1 on both (syncdrop's sharding rule).
    assert cm.rank_share(cm.MODELS["smollm2"], 2) == cm.RankShare(5, 2, 768)
    w = cm.prefill_work(cfg, 8, 2048)
    assert w.matmul_flops == pytest.approx(2 * 80 * cm.layer_weights(cfg, cm.rank_share(cfg, 8)) * 2048)
    assert w.attn_flops == pytest.approx(4 * 80 * 8 * 128 * 2048 * 2049 / 2)
    assert w.head_flops == 2 * 8192 * 32000  # last position only, replicated head
    assert cm.prefill_work(cfg, 8, 2048, lm_head_parallel=True).head_flops == 2 * 8192 * 32000 / 8


# ---------------------------------------------------------------------------- calibration


def test_calibration_recovers_true_parameters(tmp_path) -> None:
    runs = [cm.load_bench(write(tmp_path / f"b{S}.json", synthetic_bench(S, seed=S)), "--calibrate")
            for S in (64, 256)]
    cal = cm.calibrate(runs)
    assert cal.alpha == pytest.approx(TRUE["alpha"], rel=0.1)
    assert cal.beta == pytest.approx(TRUE["beta"], rel=0.1)
    assert cal.compute.flops_per_s == pytest.approx(TRUE["flops"], rel=0.1)
    assert cal.compute.layer_overhead_s == pytest.approx(TRUE["overhead"], rel=0.25)
    assert cal.sync_s < 0.1 * TRUE["overhead"]


def test_calibration_recovers_sync_overhead(tmp_path) -> None:
    true = {**TRUE, "sync": 2e-3}  # every in-forward sync point costs 2 ms more than an isolated all-reduce
    runs = [cm.load_bench(write(tmp_path / f"b{S}.json", synthetic_bench(S, seed=S, noise=0.005, true=true)))
            for S in (64, 256)]
    cal = cm.calibrate(runs)
    assert cal.sync_s == pytest.approx(2e-3, rel=0.15)
    assert cal.compute.flops_per_s == pytest.approx(TRUE["flops"], rel=0.1)
    assert cm.calibrate(runs, fit_sync=False).sync_s == 0.0


def test_calibration_predicts_emulated_runs(tmp_path) -> None:
    cal_run = cm.load_bench(write(tmp_path / "none.json", synthetic_bench(128, seed=1)), "--calibrate")
    cal = cm.calibrate([cal_run])
    checks = [cm.load_bench(write(tmp_path / f"e{i}.json", synthetic_bench(128, link, seed=10 + i)))
              for i, link in enumerate([Link(3e8, 50e-6), Link(3e7, 50e-6)])]
    rows = cm.check(cal, [cal_run, *checks])
    ttft = [r for r in rows if r["what"] == "ttft" and not r["calibration"]]
    assert len(ttft) == 2 * len(PLANS)
    assert max(abs(r["rel_err"]) for r in ttft) < 0.06
    summary = cm.check_summary(rows)
    assert summary["heldout_ttft"]["within_tolerance"] and summary["heldout_ttft"]["n"] == 10


def test_calibration_refuses_emulated_file(tmp_path) -> None:
    run = cm.load_bench(write(tmp_path / "e.json", synthetic_bench(128, Link(3e8, 0.0))), "--calibrate")
    with pytest.raises(SyncdropError, match="--calibrate .*emulation"):
        cm.calibrate([run])


# ---------------------------------------------------------------------------- cluster


def test_70b_prediction_monotone_and_larger_savings_on_slower_links() -> None:
    cfg = cm.get_model("llama2-70b")
    links = parse_links("300GB/s,50GB/s,10GB/s")
    assert [lk.alpha for lk in links] == [1.5e-6, 5e-6, 10e-6]
    fracs = [i / 10 for i in range(11)]
    rows = cm.cluster_predict(cfg, 8, links, [128, 2048], fracs)
    assert len(rows) == 3 * 2 * 11
    for lk in links:
        for S in (128, 2048):
            sub = [r for r in rows if r["link"] == lk.label and r["prompt_len"] == S]
            ttft = [r["ttft_ms"] for r in sub]
            assert all(a > b for a, b in zip(ttft, ttft[1:], strict=False))
            assert sub[0]["ttft_reduction"] == 0.0
            assert [r["allreduces_per_forward"] for r in sub] == [160 - round(f * 80) for f in fracs]
    for S in (128, 2048):
        at70 = [next(r for r in rows if r["link"] == lk.label and r["prompt_len"] == S and r["spd_fraction"] == 0.7)
                for lk in links]
        red = [r["ttft_reduction"] for r in at70]
        assert 0 < red[0] < red[1] < red[2] < 0.5  # at most half the sync points can go
        assert at70[0]["decode_reduction"] < at70[2]["decode_reduction"]
    paper = cm.paper_comparison(rows)
    assert {r["link"] for r in paper} == {"10GB/s"} and len(paper) == 2
    for r in paper:  # reduction = dropped share of sync points x communication share at SPD 0%
        assert r["ttft_reduction"] == pytest.approx(56 / 160 * r["ttft_comm_share"], rel=1e-6)
        assert r["paper_implied_comm_share"] == pytest.approx(0.197 / 0.35)


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
        cm.load_bench(write(tmp_path / "zero.json", d))
    d = synthetic_bench(128)
    d["settings"]["num_layers"] = 31
    with pytest.raises(SyncdropError, match="--check .*L=31"):
        cm.load_bench(write(tmp_path / "shape.json", d))


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
