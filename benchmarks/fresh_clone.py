"""A newcomer's first two commands, timed: clone the repository where no data folder lies beside it
and run ``make test`` and ``make demo`` there, each from a fresh ``.venv``.

Writes ``OUT.json`` (provenance, per command: exit code, wall seconds, the pytest summary line or
the demo's chosen plan, and the lines that say what was skipped, the temporary folder written as
``<workdir>``) and ``OUT.md``. The clone goes to
``--workdir`` (default: a new temporary folder whose parent has no ``shared/data``). Example:

    python benchmarks/fresh_clone.py --out results/fresh_clone
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance

log = logging.getLogger("fresh_clone")
REPO = Path(__file__).resolve().parent.parent


def run(cmd: list[str], cwd: Path, log_path: Path, env: dict[str, str]) -> tuple[int, float, str]:
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        code = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    return code, time.monotonic() - t0, log_path.read_text(errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="test,demo", help="make targets, in order (default test,demo)")
    ap.add_argument("--workdir", default=None, help="where to clone (its parent must have no shared/data)")
    ap.add_argument("--out", default="results/fresh_clone")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="syncdrop-fresh-"))
    if (work.parent / "shared" / "data").exists() or (work / "shared" / "data").exists():
        ap.error(f"--workdir {work}: a shared/data folder lies beside it, so this would not be a fresh machine")
    clone = work / "syncdrop"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("SYNCDROP_DATA", "SYNCDROP_REQUIRE_DATA", "VIRTUAL_ENV")}
    rows = []
    for target in args.targets.split(","):
        log.info("make %s in %s ...", target, clone)
        code, secs, text = run(["make", target], clone, work / f"make_{target}.log", env)
        summary_re = re.compile(r"\d+ passed|\d+ failed|error|^chosen:|^report:")
        log_lines = text.replace(str(work), "<workdir>").splitlines()  # no machine paths in results/
        summary = [ln for ln in log_lines if summary_re.search(ln)][-3:]
        skipped = [ln for ln in log_lines if "SKIPPED" in ln or "skipped" in ln.lower()][:20]
        rows.append({"target": target, "exit_code": code, "wall_s": secs, "summary": summary, "skipped": skipped})
        log.info("make %s: exit %d in %.0f s", target, code, secs)
    atomic_write_json(args.out + ".json", {"provenance": provenance(), "clone_commit": commit,
                                           "data_folder_beside_clone": False, "targets": rows})
    lines = ["| command | exit | wall time | summary |", "|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| make {r['target']} | {r['exit_code']} | {r['wall_s'] / 60:.1f} min | "
                     f"{'; '.join(s.strip() for s in r['summary'][-1:])} |")
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
