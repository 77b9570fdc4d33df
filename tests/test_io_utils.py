"""Provenance helpers: the commit a result records, and the command line."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from syncdrop.io_utils import command_line, git_commit


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_commit_is_dirty_for_code_changes_not_for_rewritten_results(tmp_path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("{}\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "c")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "results" / "r.json").write_text('{"rerun": 1}\n')  # a run rewriting its committed result
    (tmp_path / "new_untracked.py").write_text("")
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"


def test_command_line_reads_back_argument_by_argument(monkeypatch) -> None:
    argv = ["/some/where/script.py", "--configs", "spd:0.5+int8", "--out", "a path/with space", ""]
    monkeypatch.setattr(sys, "argv", argv)
    assert shlex.split(command_line()) == ["script.py", *argv[1:]]


def test_no_checkout_gives_none(tmp_path) -> None:
    if subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode == 0:
        pytest.skip("the temporary folder lies inside a git work tree")
    assert git_commit(tmp_path) is None
