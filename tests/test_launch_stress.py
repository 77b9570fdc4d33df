"""Teardown under stress (slow): many short ``--launch`` jobs must all exit 0 on every rank.

Runs ``benchmarks/launch_stress.py`` (generate, bench and ppl on the tiny Llama and on SmolLM2, at
TP=2 and TP=3) and fails on any job that did not exit cleanly: a non-zero exit, a rank killed by a
signal, or ``terminate called`` on a rank's stderr (the abort this guards against).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "launch_stress.py"


@pytest.mark.slow
def test_thirty_six_launch_jobs_exit_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "stress"
    r = subprocess.run([sys.executable, str(SCRIPT), "--jobs", "36", "--out", str(out)], capture_output=True,
                       text=True, timeout=3600)
    res = json.loads((tmp_path / "stress.json").read_text())
    bad = [(j["name"], j["exit_code"], j["failure_lines"]) for j in res["jobs"] if not j["clean"]]
    assert res["summary"]["jobs"] == 36
    assert not bad, f"{len(bad)} of 36 jobs did not exit cleanly: {bad}"
    assert r.returncode == 0, r.stderr[-2000:]
