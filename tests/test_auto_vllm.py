"""``syncdrop auto --engine vllm``: candidates benchmarked in vLLM, the choice exported and its serve command
in the report (slow: a whole auto run with two vLLM engines); a TP that vLLM cannot shard is refused before
any stage runs."""

from __future__ import annotations

import json

import pytest

from syncdrop.cli import main


def test_unservable_tp_is_refused_up_front(tmp_path, capsys) -> None:
    out = tmp_path / "auto"
    code = main(["auto", "--model", "smollm2", "--tp", "2", "--engine", "vllm", "--link-bandwidth", "1GB/s",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--tp 2: vLLM cannot serve it" in err and err.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
@pytest.mark.needs_vllm
def test_auto_engine_vllm_exports_the_choice(tiny_vllm_dir, text_file, tmp_path, capsys, monkeypatch) -> None:
    import shutil
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # zero-shot skipped (the tiny model's 128 positions)
    data = tmp_path / "data" / "wikitext2"
    data.mkdir(parents=True)
    for split in ("test.txt", "valid.txt"):
        shutil.copy(text_file, data / split)
    out = tmp_path / "auto"
    code = main(["auto", "--model", str(tiny_vllm_dir("llama")), "--tp", "2", "--engine", "vllm", "--spd", "1",
                 "--data-dir", str(data.parent),
                 "--fractions", "0,1", "--wire", "none", "--link-bandwidth", "20MB/s", "--link-latency", "100us",
                 "--reps", "3", "--max-reps", "3", "--prompt-len", "32", "--seq-len", "32", "--calib-samples", "1",
                 "--distill-samples", "2", "--distill-epochs", "1", "--eval-windows", "1", "--zs-limit", "1",
                 "--out", str(out), "-q"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    served = summary["served"]
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["SyncdropLlamaForCausalLM"] and cfg["syncdrop_tp"] == 2
    assert served["serve"]["gpu"] == f"vllm serve {out / 'export'} --tensor-parallel-size 2"
    assert "## Serve it in vLLM" in (out / "report.md").read_text()
    bench = json.loads((out / "bench_link.json").read_text())
    assert bench["settings"]["engine"] == "vllm+syncdrop"
