"""The committed results say where they came from, and the docs say which of them were made at a modified tree.

Every JSON file under ``results/`` that records a provenance ``commit`` anywhere in it is read; a file counts as
made at a modified tree when any commit it records ends in ``-dirty``. That set must equal the list in
``experiments/README.md`` (section "Result files made at a modified tree"), so a rerun at a clean commit, or a
new run at a modified one, cannot leave the list wrong. No result file may hold a home or work-tree path of the
machine that made it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|Users)/")


def _commits(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [v for k, v in node.items() if k == "commit" and isinstance(v, str)]
        return own + [c for v in node.values() for c in _commits(v)]
    if isinstance(node, list):
        return [c for v in node for c in _commits(v)]
    return []


def _dirty_files() -> set[str]:
    dirty = set()
    for path in RESULTS.rglob("*.json"):
        if any(c.endswith("-dirty") for c in _commits(json.loads(path.read_text()))):
            dirty.add(path.relative_to(REPO).as_posix())
    return dirty


def _listed_files() -> set[str]:
    text = (REPO / "experiments" / "README.md").read_text()
    section = text.split("## Result files made at a modified tree", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    return {line.split("  (", 1)[0] for line in block.splitlines() if line.strip()}


def test_the_list_of_results_made_at_a_modified_tree_is_complete_and_current() -> None:
    dirty, listed = _dirty_files(), _listed_files()
    unlisted, stale = sorted(dirty - listed), sorted(listed - dirty)
    assert not unlisted, f"made at a modified tree, not listed in experiments/README.md: {unlisted}"
    assert not stale, f"listed in experiments/README.md, but clean or gone: {stale}"


def test_no_result_file_holds_a_machine_path() -> None:
    found = [p.relative_to(REPO).as_posix() for p in RESULTS.rglob("*") if p.suffix in (".json", ".md")
             and MACHINE_PATH.search(p.read_text(errors="replace"))]
    assert not found, found
