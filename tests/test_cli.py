"""The ``syncdrop`` command: perplexity end to end against a transformers reference, and bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from syncdrop.cli import main


def test_ppl_matches_transformers_reference(tiny_llama_dir, text_file, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(["ppl", "--model", str(tiny_llama_dir), "--tp", "3", "--plan", "none", "--dataset", str(text_file),
               "--seq-len", "16", "--max-windows", "5", "--batch-size", "2", "--json", str(out), "-q"])
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("ppl", "tokens", "windows", "model", "tp", "plan"):
        assert key in res
    assert res["windows"] == 5 and res["tokens"] == 5 * 15 and res["tp"] == 3

    # Independent reference: transformers' model and tokenizer, same windowing convention.
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = torch.tensor(tok(text_file.read_text(), add_special_tokens=False)["input_ids"][: 5 * 16]).view(5, 16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert math.isclose(res["ppl"], math.exp(nll.item()), rel_tol=1e-4)
    assert "ppl" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no/such-model-anywhere"], "unknown model"),
        (["--tp", "0"], "--tp must be a positive integer"),
        (["--tp", "-2"], "--tp must be a positive integer"),
        (["--tp", "7"], "exceeds the model's 6 query heads"),
        (["--plan", "blocks:0,x"], "malformed plan"),
        (["--plan", "blocks:5"], "block index 5 out of range"),
        (["--plan", "sideways"], "malformed plan"),
        (["--dataset", "/no/such/file.txt"], "not found"),
        (["--seq-len", "1"], "--seq-len must be at least 2"),
        (["--max-windows", "0"], "--max-windows must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_llama_dir, text_file, args, message, capsys) -> None:
    base = {"--model": str(tiny_llama_dir), "--dataset": str(text_file), "--seq-len": "16", "--max-windows": "2"}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    argv = ["ppl", "-q"] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_missing_wikitext_is_a_clear_error(tiny_llama_dir, tmp_path, capsys) -> None:
    """An empty --data-dir: one line naming the dataset, exit 2 (the wording belongs to syncdrop.eval.data)."""
    assert main(["ppl", "--model", str(tiny_llama_dir), "--dataset", "wikitext2", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "wikitext2" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_subprocess_error_has_no_traceback(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "syncdrop", "ppl", "--model", str(tmp_path / "nope.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown model" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "syncdrop", "ppl", "--tp", "two"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--tp" in r.stderr and "Traceback" not in r.stderr


def test_building_the_parser_imports_neither_torch_nor_lm_eval() -> None:
    """`syncdrop --help` and usage errors stay fast: heavy imports happen inside the commands."""
    code = ("import sys, syncdrop.cli as c; c.build_parser(); "
            "assert 'torch' not in sys.modules and 'lm_eval' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('torch', 'lm_eval'))][:3]")
    subprocess.run([sys.executable, "-c", code], check=True)


def _subparsers(parser) -> list:
    """Every parser below ``parser`` (sub-commands and their own sub-commands), depth first."""
    import argparse

    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += [sub, *_subparsers(sub)]
    return out


def test_every_command_help_renders() -> None:
    """``syncdrop CMD --help`` formats for every command: a help string with a bare ``%`` (argparse expands
    ``%(default)s``-style fields) raises instead of printing help."""
    from syncdrop.cli import build_parser

    subs = _subparsers(build_parser())
    assert len(subs) >= 12
    for sub in subs:
        assert sub.format_help().startswith("usage:"), sub.prog
