"""``syncdrop auto``: stage caching, the choice rule, and (slow) the whole pipeline on a tiny model
with its report rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from syncdrop.auto.pipeline import AutoSettings, Stages, _choose
from syncdrop.cli import main


def test_stages_are_cached_by_inputs(tmp_path) -> None:
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


def _bench(ttft: dict[float, float]) -> dict:
    return {"rows": [{"link": "user", "what": "ttft", "fraction": f, "measured_ms": t, "predicted_ms": t}
                     for f, t in ttft.items()]}


def test_choice_is_fastest_within_budget() -> None:
    plans = {"candidates": {f"{f:g}": {"fraction": f, "path": f"/r/plans/spd{round(f * 100):03d}.json"}
                            for f in (0.0, 0.5, 1.0)}}
    ppl = {"dense_ppl": 10.0, "rows": [{"fraction": 0.0, "ppl_zero_shot": 10.0, "ppl_distilled": 10.0},
                                       {"fraction": 0.5, "ppl_zero_shot": 10.6, "ppl_distilled": 10.2},
                                       {"fraction": 1.0, "ppl_zero_shot": 30.0, "ppl_distilled": 12.0}]}
    bench = _bench({0.0: 100.0, 0.5: 80.0, 1.0: 60.0})
    c = _choose(AutoSettings(max_ppl_increase=0.05), plans, ppl, bench)
    assert c["chosen"]["fraction"] == 0.5 and c["chosen"]["variant"] == "distilled"
    assert _choose(AutoSettings(max_ppl_increase=0.25), plans, ppl, bench)["chosen"]["fraction"] == 1.0
    assert _choose(AutoSettings(max_ppl_increase=0.001), plans, ppl, bench)["chosen"]["fraction"] == 0.0
    fixed = _choose(AutoSettings(max_ppl_increase=None, spd=0.4), plans, ppl, bench)
    assert fixed["chosen"]["fraction"] == 0.5


def test_auto_bad_input(capsys) -> None:
    assert main(["auto", "--tp", "1", "--out", "/tmp/never"]) == 2
    assert "--tp must be at least 2" in capsys.readouterr().err
    assert main(["auto", "--fractions", "0,2", "--out", "/tmp/never"]) == 2
    assert "between 0 and 1" in capsys.readouterr().err


@pytest.mark.slow
def test_auto_end_to_end_with_report(tiny_llama_dir, tmp_path, capsys) -> None:
    """Every stage runs, a rerun is fully cached, the HTML is self-contained and renders."""
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
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (apt-get install chromium) for the rendering check")
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1000,2400", (out / "report.html").as_uri()], check=True, capture_output=True,
                   timeout=120)
    assert shot.stat().st_size > 20_000  # a rendered page with images, not a blank one
