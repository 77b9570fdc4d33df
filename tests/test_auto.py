"""``syncdrop auto``: stage caching, the choice rule, which stages a changed input reruns, each fallback,
and (slow) the whole pipeline on a tiny model, with the report rendered in headless Chromium.

The choice rule (``syncdrop/auto/pipeline.py``, stage 7): a candidate other than dense only when its
perplexity increase (best of distilled and zero-shot, relative to SPD 0) is within ``--max-ppl-increase``,
its measured TTFT gain over dense on the user's link is significant (the 95% interval of TTFT / dense lies
below 1) and the cost model predicts its TTFT within 15%; the fastest such by measured TTFT, else dense.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from syncdrop.auto import pipeline
from syncdrop.auto.pipeline import AutoSettings, Stages, _choose, candidate_name
from syncdrop.bench import run as bench_run
from syncdrop.cli import main
from syncdrop.eval.data import load_text
from syncdrop.models.loading import resolve_model

RESULTS = Path(__file__).resolve().parent.parent / "results"
DEMO = RESULTS / "demo_auto"  # committed copy of a `make demo` run (SmolLM2, TP=2, 5 candidates)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_stages_are_cached_by_inputs(tmp_path: Path) -> None:
    """Same inputs load the stored result; new inputs or a damaged file recompute."""
    calls = []
    st = Stages(tmp_path, progress=False)

    def work():
        calls.append(1)
        return {"value": len(calls)}

    a = st.run("x", {"k": 1}, work)
    b = st.run("x", {"k": 1}, work)
    c = st.run("x", {"k": 2}, work)
    assert calls == [1, 1] and a["value"] == b["value"] == 1 and c["value"] == 2
    (tmp_path / "x.json").write_text("{broken")  # a damaged result is recomputed, not trusted
    assert st.run("x", {"k": 2}, work)["value"] == 3


def _bench(rows: dict[float, tuple[float, tuple[float, float] | None, float | None]]) -> dict:
    """Bench stage rows on the user link: per fraction (measured TTFT ms, 95% interval of TTFT / dense,
    predicted TTFT ms); TTFT / dense is measured / the fraction-0 measurement."""
    dense = rows[0.0][0]
    return {"rows": [{"link": "user", "what": "ttft", "fraction": f, "measured_ms": m, "predicted_ms": pred,
                      "ci_ms": [0.98 * m, 1.02 * m], "over_dense": m / dense, "over_dense_ci": ci}
                     for f, (m, ci, pred) in rows.items()]}


def _plans(fractions) -> dict[str, Any]:
    return {"candidates": {f"{f:g}": {"fraction": f, "path": f"/r/plans/{candidate_name(f)}.json"}
                           for f in fractions}}


PPL = {"dense_ppl": 10.0, "rows": [{"fraction": 0.0, "ppl_zero_shot": 10.0, "ppl_distilled": 10.0},
                                   {"fraction": 0.5, "ppl_zero_shot": 10.6, "ppl_distilled": 10.2},
                                   {"fraction": 1.0, "ppl_zero_shot": 30.0, "ppl_distilled": 12.0}]}
PLANS = _plans((0.0, 0.5, 1.0))
# significant gains (intervals below 1) that the cost model predicts within 2%
CLEAR = {0.0: (100.0, None, 101.0), 0.5: (80.0, (0.75, 0.85), 81.0), 1.0: (60.0, (0.55, 0.65), 61.0)}


def test_choice_is_fastest_within_budget() -> None:
    """With significant, predicted gains the budget decides (best variant's perplexity increase); a fixed
    --spd takes the nearest fraction."""
    bench = _bench(CLEAR)
    c = _choose(AutoSettings(max_ppl_increase=0.05), PLANS, PPL, bench)
    assert c["chosen"]["fraction"] == 0.5 and c["chosen"]["variant"] == "distilled" and not c["recommend_dense"]
    assert "TTFT / dense 0.800 [0.750, 0.850], cost model +1.2%" in c["reason"], c["reason"]
    assert _choose(AutoSettings(max_ppl_increase=0.25), PLANS, PPL, bench)["chosen"]["fraction"] == 1.0
    assert _choose(AutoSettings(max_ppl_increase=0.001), PLANS, PPL, bench)["chosen"]["fraction"] == 0.0
    fixed = _choose(AutoSettings(max_ppl_increase=None, spd=0.4), PLANS, PPL, bench)
    assert fixed["chosen"]["fraction"] == 0.5 and "its gain is significant" in fixed["reason"]


@pytest.mark.parametrize("half, verdict", [
    ((80.0, (0.75, 1.01), 81.0), "its TTFT gain is not significant (TTFT / dense 0.800, 95% interval [0.750, 1.010] "
                                 "reaches 1)"),
    ((80.0, None, 81.0), "no interval for its TTFT gain"),
    ((80.0, (0.75, 0.85), 96.0), "the cost model disagrees with the measurement by +20.0% (more than 15%)"),
    ((80.0, (0.75, 0.85), None), "the cost model could not be fitted"),
])
def test_choice_needs_a_significant_and_predicted_gain(half, verdict: str) -> None:
    """At a budget only SPD 0.5 meets, 0.5 is chosen only with a gain whose interval excludes 0 and a
    cost model within 15%; otherwise dense, and the reason says why 0.5 failed (and 1.0: over budget)."""
    bench = _bench({**CLEAR, 0.5: half})
    c = _choose(AutoSettings(max_ppl_increase=0.05), PLANS, PPL, bench)
    assert c["chosen"]["fraction"] == 0.0 and c["recommend_dense"]
    assert c["reason"].startswith("no plan pays on the emulated link within +5.0% perplexity, so syncdrop "
                                  "recommends dense"), c["reason"]
    assert f"SPD 0.5: {verdict}" in c["reason"] and "SPD 1: perplexity +20.00% is over the +5.0% budget" in c["reason"]
    assert {x["fraction"]: x["verdict"] for x in c["candidates"]}[0.5].startswith(verdict)
    fixed = _choose(AutoSettings(max_ppl_increase=None, spd=0.5), PLANS, PPL, bench)
    assert fixed["chosen"]["fraction"] == 0.5 and verdict in fixed["reason"]


def test_choice_ranks_by_measured_ttft_on_the_decision_link() -> None:
    """Among qualifying candidates the lowest measured TTFT wins (not the predicted one), and rows of the
    un-emulated link are ignored when the user link ran."""
    bench = _bench({0.0: (100.0, None, 101.0), 0.5: (60.0, (0.55, 0.65), 66.0), 1.0: (65.0, (0.6, 0.7), 62.0)})
    bench["rows"] += [{**r, "link": "none", "measured_ms": 1000.0 * (1 - r["fraction"]) + 1} for r in bench["rows"]]
    c = _choose(AutoSettings(max_ppl_increase=0.25), PLANS, PPL, bench)
    assert c["chosen"]["fraction"] == 0.5 and c["decision_link"] == "user"


def test_nothing_within_budget_recommends_dense_and_says_so() -> None:
    """A budget nothing meets (negative, below dense itself): dense, and the reason lists each candidate."""
    c = _choose(AutoSettings(max_ppl_increase=-0.01), PLANS, PPL, _bench(CLEAR))
    assert c["chosen"]["fraction"] == 0.0 and c["chosen"]["variant"] == "zero-shot"
    assert c["model_dir"].endswith("spd000")
    assert re.search(r"no plan pays .*SPD 0.5: perplexity \+2.00% is over", c["reason"]), c["reason"]


def test_choice_judges_accuracy_on_paired_intervals() -> None:
    """Perplexity and zero-shot accuracy are judged on the upper end of paired 95% intervals against dense:
    SPD 0.5's windows sit at +1% to +9% of dense's (mean +4.8%, within a 5% budget) and fail on the interval;
    its compressed twin changes no window much and no answer, and qualifies; SPD 1, within budget on
    perplexity, loses 3 of 8 documents and fails the 5-point zero-shot limit. The compressed candidate is
    named with its wire format."""
    import math

    base = [2.0 + 0.1 * i for i in range(8)]
    spread = [math.log(1.01 + 0.08 * i / 7) for i in range(8)]

    def row(key: str, f: float, wire: str, shift: list[float]) -> dict:
        nll = [b + d for b, d in zip(base, shift, strict=True)]
        ppl = math.exp(sum(nll) / len(nll))
        return {"key": key, "fraction": f, "wire": wire, "ppl_zero_shot": ppl, "ppl_distilled": ppl,
                "window_nll_zero_shot": nll, "window_nll_distilled": nll}

    ppl = {"dense_ppl": math.exp(sum(base) / 8),
           "rows": [row("0", 0.0, "none", [0.0] * 8), row("0.5", 0.5, "none", spread),
                    row("0.5+int8", 0.5, "int8", [0.001] * 8), row("1", 1.0, "none", [0.002] * 8)]}
    plans = {"candidates": {k: {"fraction": f, "wire": w, "path": f"/r/plans/{candidate_name(f, w)}.json"}
                            for k, f, w in (("0", 0.0, "none"), ("0.5", 0.5, "none"), ("0.5+int8", 0.5, "int8"),
                                            ("1", 1.0, "none"))}}
    bench = _bench(CLEAR)
    bench["rows"] += [{**bench["rows"][1], "key": "0.5+int8", "wire": "int8", "measured_ms": 85.0,
                       "predicted_ms": 86.0, "over_dense_ci": (0.8, 0.9)}]
    docs = [1, 1, 0, 1, 1, 0, 1, 1]
    zs = {"doc_acc": {"0": {"t": docs}, "0.5": {"t": docs}, "0.5+int8": {"t": docs},
                      "1": {"t": [0, 0, 0, 0, 1, 0, 1, 1]}}}
    c = _choose(AutoSettings(max_ppl_increase=0.05, max_acc_drop=5.0), plans, ppl, bench, zs=zs)
    v = {x["key"]: x for x in c["candidates"]}
    assert v["0.5"]["ppl_increase"] < 0.05 < v["0.5"]["ppl_increase_ci"][1]
    assert "is over the +5.0% budget (95% interval" in v["0.5"]["verdict"], v["0.5"]["verdict"]
    assert v["1"]["acc_drop"] == pytest.approx(37.5) and "may exceed the 5-point limit" in v["1"]["verdict"]
    assert v["0.5+int8"]["verdict"] == "qualifies" and v["0.5+int8"]["acc_drop_ci"] == [0.0, 0.0]
    assert c["chosen"]["key"] == "0.5+int8" and c["plan"].endswith("spd050_int8.json")
    assert "within +5.0% perplexity and 5 points of zero-shot accuracy" in c["reason"], c["reason"]
    # no limit on zero-shot accuracy: SPD 1 (fastest) qualifies
    assert _choose(AutoSettings(max_ppl_increase=0.05, max_acc_drop=None), plans, ppl, bench,
                   zs=zs)["chosen"]["key"] == "1"


def test_auto_bad_input(capsys) -> None:
    """Bad --tp and --fractions exit 2 with a message naming the flag."""
    assert main(["auto", "--tp", "1", "--out", "/tmp/never"]) == 2
    assert "--tp must be at least 2" in capsys.readouterr().err
    assert main(["auto", "--fractions", "0,2", "--out", "/tmp/never"]) == 2
    assert "between 0 and 1" in capsys.readouterr().err
    assert main(["auto", "--model", "smollm2", "--wire", "none,int8:g10", "--out", "/tmp/never"]) == 2
    assert "--wire 'int8:g10': wire group size 10 does not divide the hidden size 576" in capsys.readouterr().err
    assert main(["auto", "--wire", "none,int3", "--out", "/tmp/never"]) == 2
    assert "--wire 'int3': wire format must be one of" in capsys.readouterr().err
    assert main(["auto", "--max-acc-drop", "lots", "--out", "/tmp/never"]) == 2
    assert "--max-acc-drop 'lots': expected a number of points or none" in capsys.readouterr().err


def test_candidate_names() -> None:
    """One name per candidate fraction, for its plan file and model directory."""
    assert [candidate_name(f) for f in (0.0, 0.25, 0.5, 1.0)] == ["spd000", "spd025", "spd050", "spd100"]


# ---------------------------------------------------------------------------- stage reruns and fallbacks
# The pipeline runs in-process on the tiny Llama with the smallest settings. Two things are replaced:
# lm-eval is made absent (the no-lm-eval fallback), and the bench entry point
# (``syncdrop.bench.run.run_bench``, which would start real ranks) returns committed results instead
# (real SmolLM2 TP=2 measurements: results/latency/tp2_none.json without emulation, tp2_share30.json with a
# link). Real ranks run in the run_bench tests below and in the slow end-to-end test. Stage functions are
# wrapped to count calls; the wrappers call the real stage.

STAGES = ("_profile", "_plans", "_distill", "_ppl", "_bench", "_zeroshot", "_choose")


def _fake_bench(noemul: Path, emul: Path, calls: list):
    """Returns what run_bench would: with links, one result per link (the first un-emulated, the second the
    user's), else one result (the emulated file when the settings' link is active)."""
    from syncdrop.bench.run import BenchSettings

    def run(s: BenchSettings, progress: bool = False) -> list[dict]:
        calls.append(s)
        if s.links is not None:
            return [json.loads(src.read_text()) for src in (noemul, emul)]
        return [json.loads((emul if s.link.active else noemul).read_text())]
    return run


@pytest.fixture
def auto_env(monkeypatch, tmp_path: Path, text_file: Path) -> tuple[Counter, list, Path]:
    """Counting stage wrappers, no lm-eval, committed bench files, and a data folder of the tiny text."""
    import sys

    counts: Counter = Counter()
    for name in STAGES:
        real = getattr(pipeline, name)

        def counted(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(pipeline, name, counted)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    calls: list = []
    monkeypatch.setattr(bench_run, "run_bench", _fake_bench(RESULTS / "latency" / "tp2_none.json",
                                                            RESULTS / "latency" / "tp2_share30.json", calls))
    data = tmp_path / "data" / "wikitext2"
    data.mkdir(parents=True)
    for split in ("test.txt", "valid.txt"):
        shutil.copy(text_file, data / split)
    return counts, calls, data.parent


def _auto_args(model: Path, out: Path, data: Path, *extra: str) -> list[str]:
    return ["auto", "--model", str(model), "--tp", "2", "--fractions", "0.5,1", "--calib-samples", "1",
            "--seq-len", "32", "--distill-samples", "1", "--distill-epochs", "1", "--eval-windows", "1",
            "--prompt-len", "8", "--decode-tokens", "1", "--reps", "1", "--data-dir", str(data), "-q",
            "--out", str(out), *(() if "--wire" in extra else ("--wire", "none")), *extra]


def test_changed_input_reruns_only_later_stages(tiny_llama_dir, auto_env, tmp_path, capsys, monkeypatch) -> None:
    """A rerun recomputes nothing; a new budget reruns the choice only; a new link reruns bench and choice;
    more eval windows rerun ppl, zero-shot and choice. Compressed candidates (--wire int8:g16) are each SPD
    fraction's plan with int8 on its kept sync points, benchmarked with the others. Also: the dense candidate is
    evaluated though --fractions left out 0, without lm-eval zero-shot is skipped with a note, and a run
    passes stage results in memory: it reads no stage file it wrote (only plan files, the bench files the
    cost model parses, and the profile figure the report embeds)."""
    counts, calls, data = auto_env
    out = tmp_path / "auto"
    link = ["--link-bandwidth", "100MB/s", "--link-latency", "50us"]
    reads: list[Path] = []
    for name in ("read_text", "read_bytes"):
        real = getattr(Path, name)

        def spy(self, *a, _real=real, **k):
            reads.append(self)
            return _real(self, *a, **k)
        monkeypatch.setattr(Path, name, spy)

    def run(*extra: str) -> dict[str, int]:
        counts.clear()
        assert main(_auto_args(tiny_llama_dir, out, data, *link, "--wire", "none,int8:g16", *extra)) == 0
        return dict(counts)

    assert run() == {n: 1 for n in STAGES}
    root = out.resolve()
    read_here = {p.resolve().relative_to(root).as_posix() for p in reads if root in p.resolve().parents}
    allowed = {"bench_noemul.json", "bench_link.json", "profile.png"}  # profile.png: drawn by the profile stage
    assert {p for p in read_here if not p.startswith("plans/")} <= allowed, read_here
    # one bench, the un-emulated link and the user's interleaved, every candidate plan
    assert len(calls) == 1 and [label for label, _ in calls[0].links] == ["none", "100MB/s+50us"]
    assert calls[0].links[1][1].to_dict() == {"bandwidth_Bps": 1e8, "latency_s": pytest.approx(5e-5), "formula": "ring"}
    names = [f"spd{n}{w}.json" for w in ("", "_int8g16") for n in ("000", "050", "100")]
    assert [Path(p).name for p in calls[0].plans] == names
    from syncdrop.plan import SyncPlan

    plain, packed = (SyncPlan.load(out / "plans" / f"spd050{w}.json") for w in ("", "_int8g16"))
    assert packed.dropped == plain.dropped and packed == plain.compressed("int8", 16)
    assert (calls[0].tp, calls[0].prompt_len, calls[0].reps, calls[0].max_reps) == (2, 8, 1, 30)
    assert {p.name for p in out.glob("bench_*.json")} == {"bench_noemul.json", "bench_link.json"}
    assert (out / "bench_link.md").is_file() and not list(out.glob("bench_none*"))
    ppl = json.loads((out / "ppl.json").read_text())
    assert [(r["fraction"], r["wire"]) for r in ppl["rows"]] == [
        (f, w) for f in (0.0, 0.5, 1.0) for w in ("none", "int8:g16")]
    assert ppl["dense_ppl"] == ppl["rows"][0]["ppl_zero_shot"] > 0
    assert all(len(r["window_nll_zero_shot"]) == len(r["window_nll_distilled"]) == 1 for r in ppl["rows"])
    choice = json.loads((out / "choice.json").read_text())
    assert {c["key"] for c in choice["candidates"]} == {"0", "0.5", "1", "0+int8:g16", "0.5+int8:g16", "1+int8:g16"}
    zs = json.loads((out / "zeroshot.json").read_text())
    assert "lm-eval is not installed" in zs["skipped"]
    assert "Zero-shot tasks skipped: lm-eval is not installed" in (out / "report.md").read_text()
    assert "chosen: SPD fraction" in capsys.readouterr().out

    assert run() == {}
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert run("--max-ppl-increase", "0.5") == {"_choose": 1}
    for name in ("profile.json", "plans.json", "distill.json", "ppl.json", "bench.json"):
        assert (out / name).stat().st_mtime_ns == mtimes[name], name  # the cached files were not rewritten
    link[-1] = "100us"
    assert run("--max-ppl-increase", "0.5") == {"_bench": 1, "_choose": 1}
    assert calls[-1].links[1][0] == "100MB/s+100us"
    assert run("--max-ppl-increase", "0.5", "--eval-windows", "2") == {"_ppl": 1, "_choose": 1, "_zeroshot": 1}
    assert run("--max-ppl-increase", "0.5", "--eval-windows", "2", "--max-acc-drop", "1") == {"_choose": 1}
    # another wire format: new candidates, but the uncompressed ones' recovery is reused
    assert run("--max-ppl-increase", "0.5", "--eval-windows", "2", "--max-acc-drop", "1", "--wire",
               "none,int4:g16") == {"_plans": 1, "_ppl": 1, "_bench": 1, "_zeroshot": 1, "_choose": 1}
    assert json.loads((out / "ppl.json").read_text())["windows"] == 2


def test_recovery_budget_chooses_methods_and_the_report_says_what_they_cost(tiny_llama_dir, auto_env,
                                                                           tmp_path) -> None:
    """--recovery-budget 0 trains nothing (every candidate zero-shot, distilled ppl = zero-shot ppl); a
    generous budget gives the candidates end-to-end distillation after the block stage, their model
    directories are the end-to-end ones (run by the ppl stage under their plan), and the report names
    each candidate's method and the measured cost."""
    counts, calls, data = auto_env
    out = tmp_path / "auto"
    assert main(_auto_args(tiny_llama_dir, out, data, "--recovery-budget", "0", "--max-ppl-increase", "1.0")) == 0
    dist = json.loads((out / "distill.json").read_text())
    assert set(dist["recovery"]["methods"].values()) == {"zs"} and dist["trained_blocks"] == []
    ppl = json.loads((out / "ppl.json").read_text())
    assert all(r["ppl_distilled"] == r["ppl_zero_shot"] for r in ppl["rows"])

    assert main(_auto_args(tiny_llama_dir, out, data, "--recovery-budget", "1h", "--e2e-samples", "1",
                           "--max-ppl-increase", "1.0")) == 0
    dist = json.loads((out / "distill.json").read_text())
    rec = dist["recovery"]
    assert rec["methods"]["0"] == "zs" and {rec["methods"]["0.5"], rec["methods"]["1"]} <= {"b2b+e2e", "e2e"}
    for key in ("0.5", "1"):
        assert dist["models"][key].endswith("_e2e") and rec["e2e_measured_s"][key] > 0
        assert all(b["tier"] == "e2e" for b in resolve_model(dist["models"][key]).spd.blocks.values())
    ppl = json.loads((out / "ppl.json").read_text())
    assert all(r["ppl_distilled"] != r["ppl_zero_shot"] for r in ppl["rows"] if r["fraction"] > 0)
    report = (out / "report.md").read_text()
    assert "Recovery within --recovery-budget 1h" in report and "SPD 1: " in report
    assert rec["e2e_windows"] == {"0.5": 1, "1": 1} and "end to end on 1 windows" in report
    assert "fixed by `--e2e-samples 1`: the same command repeats this recovery" in report

    # the default, auto windows: an hour pays for every calibration window there is (the tiny text's windows
    # of 32 tokens, less the block stage's held-out one), and each candidate trains on all of them
    assert main(_auto_args(tiny_llama_dir, out, data, "--recovery-budget", "1h", "--max-ppl-increase", "1.0")) == 0
    rec = json.loads((out / "distill.json").read_text())["recovery"]
    text = load_text("auto:valid", str(data)).text
    n = len(resolve_model(str(tiny_llama_dir)).load_tokenizer()(text, add_special_tokens=False)["input_ids"]) // 32 - 1
    assert rec["e2e_windows"] == {"0.5": n, "1": n} and n > 8
    assert f"pass `--e2e-samples {n}` (the windows this budget bought here)" in (out / "report.md").read_text()
    dist = json.loads((out / "distill.json").read_text())
    for key in ("0.5", "1"):
        assert json.loads((Path(dist["models"][key]) / "syncdrop.json").read_text())["distill"]["train_windows"][0] == n


def test_cost_model_not_fitted_recommends_dense(tiny_llama_dir, auto_env, tmp_path, monkeypatch, capsys) -> None:
    """A bench file the cost model cannot be fitted to (the committed no-emulation file with its two
    all-reduce medians raised to 50 ms, so 60 sync points would take longer than the measured TTFT):
    the bench stage records the error, predictions are None, and since no prediction confirms any gain
    (nor, in this file from before intervals, any interval) the choice is dense, and the report says why."""
    counts, calls, data = auto_env
    bad = json.loads((RESULTS / "latency" / "tp2_none.json").read_text())
    for phase in ("prefill", "decode"):
        bad["allreduce"][phase]["median_ms"] = 50.0
    bad_path = tmp_path / "unfittable.json"
    bad_path.write_text(json.dumps(bad))
    monkeypatch.setattr(bench_run, "run_bench", _fake_bench(bad_path, bad_path, calls))
    out = tmp_path / "auto"
    assert main(_auto_args(tiny_llama_dir, out, data, "--max-ppl-increase", "1.0")) == 0
    bench = json.loads((out / "bench.json").read_text())
    assert "could not fit a positive compute rate" in bench["calibration"]["error"]
    assert len(calls) == 1 and calls[0].links is None and not calls[0].link.active  # no link: one un-emulated bench
    assert bench["rows"] and all(r["predicted_ms"] is None and r["link"] == "none" for r in bench["rows"])
    measured = {r["fraction"]: r["measured_ms"] for r in bench["rows"] if r["what"] == "ttft"}
    file_ttft = {p["spd_fraction"]: p["ttft_ms"] for p in bad["plans"]}
    assert all(measured[f] == file_ttft[f] for f in (0.0, 0.5, 1.0))
    choice = json.loads((out / "choice.json").read_text())
    assert choice["chosen"]["fraction"] == 0.0 and choice["recommend_dense"]
    assert all(c["predicted_ttft_ms"] is None for c in choice["candidates"])
    assert "could not be fitted" in (out / "report.md").read_text()
    assert "recommends dense" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the bench stage's real ranks
# run_bench (syncdrop/bench/run.py) at --tp 2 from this one process: it starts the ranks itself and hands
# rank 0's results back in memory; a rank that fails or dies makes it raise, in bounded time.

HANG_GUARD_S = 120  # far above what these take; a hang, not slowness, would pass it


def _bench_settings(model: Path, text: Path, **kw):
    from syncdrop.bench.run import BenchSettings

    return BenchSettings(**{"model": str(model), "tp": 2, "plans": ("none", "all"), "prompt_len": 16,
                            "decode_tokens": 2, "reps": 2, "warmup": 0, "dataset": str(text), "dist_timeout": 20.0,
                            **kw})


def test_run_bench_starts_the_ranks_and_returns_rank0s_results(tiny_llama_dir, text_file, tmp_path,
                                                                monkeypatch) -> None:
    """Two ranks, two links interleaved: one result per link, in order, measured by the distributed
    runtime (every rank's memory), recorded with this process's command; nothing left in the temp folder."""
    import sys
    import tempfile

    from syncdrop.bench.ring import Link

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    links = (("none", Link()), ("inf+20us", Link(None, 2e-5)))
    docs = bench_run.run_bench(_bench_settings(tiny_llama_dir, text_file, links=links))
    assert [d["settings"]["link"]["latency_s"] for d in docs] == [0.0, pytest.approx(2e-5)]
    for d in docs:
        s = d["settings"]
        assert (s["runtime"], s["tp"], d["reps_run"]) == ("distributed", 2, 2)
        assert s["interleaved_links"] == ["none", "inf+20us"]
        assert [p["plan"] for p in d["plans"]] == ["none", "all"] and len(d["memory"]["ranks"]) == 2
        assert shlex.split(d["provenance"]["command"])[1:] == sys.argv[1:]  # the rank's command: the caller's
    assert list(tmp_path.iterdir()) == []  # the job folder is gone


def test_run_bench_usage_error_on_the_ranks_is_raised_here(tiny_llama_dir, text_file) -> None:
    """A setting only the ranks can refuse (a prompt longer than the text): the ranks' SyncdropError, the
    same message and field, raised to the caller."""
    from syncdrop.errors import SyncdropError

    with pytest.raises(SyncdropError) as e:
        bench_run.run_bench(_bench_settings(tiny_llama_dir, text_file, prompt_len=100_000))
    assert e.value.field == "dataset" and "has fewer than 100000 tokens" in e.value.message


def test_run_bench_fails_in_bounded_time_when_a_rank_dies(tiny_llama_dir, text_file) -> None:
    """Rank 1 killed (SIGKILL) while the job runs: run_bench raises RankFailure naming it, long before the
    hang guard (the launcher stops rank 0 at most --dist-timeout after the death)."""
    import os
    import signal
    import threading
    import time

    from syncdrop.parallel.dist import RankFailure

    stop, killed = threading.Event(), []

    def kill_rank1() -> None:
        while not stop.is_set():
            for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"syncdrop.bench.run" in cmd and b"RANK=1" in env:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_rank1, daemon=True)
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RankFailure) as e:
            bench_run.run_bench(_bench_settings(tiny_llama_dir, text_file, reps=50, dist_timeout=10.0))
    finally:
        stop.set()
    assert killed and time.monotonic() - t0 < HANG_GUARD_S
    assert "bench at TP=2 failed" in str(e.value) and "rank 1 was killed by SIGKILL" in str(e.value), str(e.value)


# ---------------------------------------------------------------------------- slow: real ranks, lm-eval


@pytest.mark.slow
def test_auto_end_to_end_with_report(tiny_llama_dir, tmp_path, capsys) -> None:
    """Every stage runs (the bench's real ranks, lm-eval in this process), a rerun is fully cached, and the
    HTML is self-contained."""
    out = tmp_path / "auto"
    args = ["auto", "--model", str(tiny_llama_dir), "--tp", "2", "--link-bandwidth", "100MB/s", "--link-latency",
            "50us", "--fractions", "0,0.5,1", "--calib-samples", "1", "--seq-len", "64", "--distill-samples", "2",
            "--distill-epochs", "1", "--eval-windows", "2", "--zs-tasks", "arc_easy", "--zs-limit", "4",
            "--prompt-len", "32", "--decode-tokens", "2", "--reps", "1", "--wire", "none,int8:g16", "--out", str(out)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "report:" in first
    for f in ("report.md", "report.html", "fig_sensitivity.json", "fig_accuracy.json", "fig_latency.json",
              "summary.json", "profile.json", "distill.json", "ppl.json", "bench.json", "choice.json"):
        assert (out / f).is_file(), f
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4
    assert not re.search(r"""(src|href)=['"](?!data:)""", html)  # nothing external
    assert main(args) == 0
    again = capsys.readouterr().out
    assert again.count(": cached") == 7
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chosen"]["fraction"] in (0.0, 0.5, 1.0)
    # every candidate, compressed ones too, timed on real ranks and scored on the same documents as dense
    keys = {f"{f:g}{w}" for f in (0.0, 0.5, 1.0) for w in ("", "+int8:g16")}
    bench = json.loads((out / "bench.json").read_text())
    assert {r["key"] for r in bench["rows"] if r["link"] == "user" and r["what"] == "ttft"} == keys
    zs = json.loads((out / "zeroshot.json").read_text())
    assert set(zs["doc_acc"]) == keys and all(len(d["arc_easy"]) == 4 for d in zs["doc_acc"].values())
    choice = json.loads((out / "choice.json").read_text())
    dense = next(c for c in choice["candidates"] if c["key"] == "0")
    assert dense["acc_drop"] == 0 and dense["ppl_increase_ci"] == [0.0, 0.0]
    assert "| 0.5 | int8:g16 |" in (out / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_auto_report_renders_in_chromium(tmp_path: Path) -> None:
    """The committed demo report (written by the same report code, self-contained) renders to a page
    with its images, not a blank one."""
    report = DEMO / "report.html"
    assert report.read_text().count("data:image/png;base64,") == 4
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1000,2400", report.as_uri()], check=True, capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000
