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
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from syncdrop.auto import pipeline
from syncdrop.auto.pipeline import AutoSettings, Stages, _choose
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
    return {"candidates": {f"{f:g}": {"fraction": f, "path": f"/r/plans/spd{round(f * 100):03d}.json"}
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


def test_auto_bad_input(capsys) -> None:
    """Bad --tp and --fractions exit 2 with a message naming the flag."""
    assert main(["auto", "--tp", "1", "--out", "/tmp/never"]) == 2
    assert "--tp must be at least 2" in capsys.readouterr().err
    assert main(["auto", "--fractions", "0,2", "--out", "/tmp/never"]) == 2
    assert "between 0 and 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------- stage reruns and fallbacks
# The pipeline runs in-process on the tiny Llama with the smallest settings. Two things are replaced:
# lm-eval is made absent (the no-lm-eval fallback), and ``pipeline._syncdrop``, which would start
# `syncdrop bench --launch` subprocesses, writes a committed bench file instead (real SmolLM2 TP=2
# measurements: results/latency/tp2_none.json without emulation, tp2_share30.json with a link). The
# real subprocesses run in the slow end-to-end test. Stage functions are wrapped to count calls; the
# wrappers call the real stage.

STAGES = ("_profile", "_plans", "_distill", "_ppl", "_bench", "_choose", "_zeroshot")


def _fake_bench(noemul: Path, emul: Path, calls: list[list[str]]):
    """Writes what `syncdrop bench` would: with --links, OUT_<link>.json and .md per link (the first link
    un-emulated, the second the user's), else OUT.json."""
    from syncdrop.bench.ring import link_slug

    def run(args: list[str]) -> None:
        assert args[0] == "bench", args  # zero-shot must not start `syncdrop eval` without lm-eval
        calls.append(args)
        out = Path(args[args.index("--json") + 1])
        if "--links" in args:
            for label, src in zip(args[args.index("--links") + 1].split(","), (noemul, emul), strict=True):
                path = out.with_name(f"{out.stem}_{link_slug(label)}.json")
                path.write_text(src.read_text())
                path.with_suffix(".md").write_text("table\n")
            return
        src = emul if "--link-bandwidth" in args or "--link-latency" in args else noemul
        out.write_text(src.read_text())
    return run


@pytest.fixture
def auto_env(monkeypatch, tmp_path: Path, text_file: Path) -> tuple[Counter, list[list[str]], Path]:
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
    calls: list[list[str]] = []
    monkeypatch.setattr(pipeline, "_syncdrop", _fake_bench(RESULTS / "latency" / "tp2_none.json",
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
            "--out", str(out), *extra]


def test_changed_input_reruns_only_later_stages(tiny_llama_dir, auto_env, tmp_path, capsys) -> None:
    """A rerun recomputes nothing; a new budget reruns choice and zero-shot only; a new link reruns bench,
    choice and zero-shot; more eval windows rerun ppl, choice and zero-shot. Also: the dense candidate is
    evaluated though --fractions left out 0, and without lm-eval zero-shot is skipped with a note."""
    counts, calls, data = auto_env
    out = tmp_path / "auto"
    link = ["--link-bandwidth", "100MB/s", "--link-latency", "50us"]

    def run(*extra: str) -> dict[str, int]:
        counts.clear()
        assert main(_auto_args(tiny_llama_dir, out, data, *link, *extra)) == 0
        return dict(counts)

    assert run() == {n: 1 for n in STAGES}
    # one bench, the un-emulated link and the user's interleaved
    assert len(calls) == 1 and calls[0][calls[0].index("--links") + 1] == "none,100MB/s+50us"
    assert {p.name for p in out.glob("bench_*.json")} == {"bench_noemul.json", "bench_link.json"}
    ppl = json.loads((out / "ppl.json").read_text())
    assert [r["fraction"] for r in ppl["rows"]] == [0.0, 0.5, 1.0]
    assert ppl["dense_ppl"] == ppl["rows"][0]["ppl_zero_shot"] > 0
    zs = json.loads((out / "zeroshot.json").read_text())
    assert "lm-eval is not installed" in zs["skipped"]
    assert "Zero-shot tasks skipped: lm-eval is not installed" in (out / "report.md").read_text()
    assert "chosen: SPD fraction" in capsys.readouterr().out

    assert run() == {}
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert run("--max-ppl-increase", "0.5") == {"_choose": 1, "_zeroshot": 1}
    for name in ("profile.json", "plans.json", "distill.json", "ppl.json", "bench.json"):
        assert (out / name).stat().st_mtime_ns == mtimes[name], name  # the cached files were not rewritten
    link[-1] = "100us"
    assert run("--max-ppl-increase", "0.5") == {"_bench": 1, "_choose": 1, "_zeroshot": 1}
    assert calls[-1][calls[-1].index("--links") + 1] == "none,100MB/s+100us"
    assert run("--max-ppl-increase", "0.5", "--eval-windows", "2") == {"_ppl": 1, "_choose": 1, "_zeroshot": 1}
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

    # the default, auto windows: an hour pays for every calibration window there is (the tiny text's windows
    # of 32 tokens, less the block stage's held-out one), and each candidate trains on all of them
    assert main(_auto_args(tiny_llama_dir, out, data, "--recovery-budget", "1h", "--max-ppl-increase", "1.0")) == 0
    rec = json.loads((out / "distill.json").read_text())["recovery"]
    text = load_text("auto:valid", str(data)).text
    n = len(resolve_model(str(tiny_llama_dir)).load_tokenizer()(text, add_special_tokens=False)["input_ids"]) // 32 - 1
    assert rec["e2e_windows"] == {"0.5": n, "1": n} and n > 8
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
    monkeypatch.setattr(pipeline, "_syncdrop", _fake_bench(bad_path, bad_path, calls))
    out = tmp_path / "auto"
    assert main(_auto_args(tiny_llama_dir, out, data, "--max-ppl-increase", "1.0")) == 0
    bench = json.loads((out / "bench.json").read_text())
    assert "could not fit a positive compute rate" in bench["calibration"]["error"]
    assert len(calls) == 1  # no link given: one un-emulated bench
    assert bench["rows"] and all(r["predicted_ms"] is None and r["link"] == "none" for r in bench["rows"])
    measured = {r["fraction"]: r["measured_ms"] for r in bench["rows"] if r["what"] == "ttft"}
    file_ttft = {p["spd_fraction"]: p["ttft_ms"] for p in bad["plans"]}
    assert all(measured[f] == file_ttft[f] for f in (0.0, 0.5, 1.0))
    choice = json.loads((out / "choice.json").read_text())
    assert choice["chosen"]["fraction"] == 0.0 and choice["recommend_dense"]
    assert all(c["predicted_ttft_ms"] is None for c in choice["candidates"])
    assert "could not be fitted" in (out / "report.md").read_text()
    assert "recommends dense" in capsys.readouterr().out


# ---------------------------------------------------------------------------- slow: real subprocesses


@pytest.mark.slow
def test_auto_end_to_end_with_report(tiny_llama_dir, tmp_path, capsys) -> None:
    """Every stage runs (real `bench --launch` and lm-eval subprocesses), a rerun is fully cached, and the
    HTML is self-contained."""
    out = tmp_path / "auto"
    args = ["auto", "--model", str(tiny_llama_dir), "--tp", "2", "--link-bandwidth", "100MB/s", "--link-latency",
            "50us", "--fractions", "0,0.5,1", "--calib-samples", "1", "--seq-len", "64", "--distill-samples", "2",
            "--distill-epochs", "1", "--eval-windows", "2", "--zs-tasks", "arc_easy", "--zs-limit", "4",
            "--prompt-len", "32", "--decode-tokens", "2", "--reps", "1", "--out", str(out)]
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
