"""Teardown stress: run many short ``--launch`` jobs and count the ones that did not exit cleanly.

A job is clean when the launcher exits 0 and no rank printed ``terminate called`` or died of a
signal (the launcher reports ``rank N was killed by SIG...``). The jobs cycle through
``generate``, ``bench`` and ``ppl`` on a tiny random Llama and on SmolLM2, at TP=2 and TP=3
(3 ranks oversubscribe this machine's 2 cores, which makes teardown races more likely, not less).

Writes ``OUT.json`` (settings, provenance, one row per job: command, exit code, seconds, the
failure lines) and ``OUT.md``. Example:

    python benchmarks/launch_stress.py --jobs 36 --out results/launch_stress
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.progress import progress_bar
from syncdrop.tiny_models import build_tiny_family

log = logging.getLogger("launch_stress")

TEXT = "the quick brown fox jumps over the lazy dog and keeps running through the long grass. " * 4000
FAILURE_MARKS = ("terminate called", "was killed by", "Traceback", "Aborted", "core dumped")


def job_matrix(tiny: Path, text: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of one cycle: every command on both models and both TP degrees."""
    data = ["--dataset", str(text)]
    jobs = []
    for model, name in ((str(tiny), "tiny"), ("smollm2", "smollm2")):
        for tp in ("2", "3"):
            common = ["--launch", "--model", model, "--tp", tp]
            jobs += [
                (f"generate {name} tp={tp}", ["generate", *common, "--plan", "all", "--prompt", "the quick brown fox",
                                              "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3"]),
                (f"bench {name} tp={tp}", ["bench", *common, "--plans", "none,all", "--prompt-len", "16",
                                           "--decode-tokens", "2", "--reps", "1", "--warmup", "0", "-q",
                                           "--link-latency", "20us", *data]),
                (f"ppl {name} tp={tp}", ["ppl", *common, "--plan", "blocks:0", "--seq-len", "32", "--max-windows",
                                         "2", "-q", *data]),
            ]
    return jobs


def run_job(argv: list[str], timeout_s: float) -> dict:
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "syncdrop", *argv], capture_output=True, text=True,
                           timeout=timeout_s)
        code, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        code, err = None, (e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or "") + "\n[timed out]"
    marks = [line for line in err.splitlines() if any(m in line for m in FAILURE_MARKS)]
    return {"exit_code": code, "seconds": time.monotonic() - t0, "failure_lines": marks[:10],
            "clean": code == 0 and not marks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=36, help="number of jobs (cycles through the matrix; default 36)")
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated subset of tiny,smollm2")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    ap.add_argument("--out", default="results/launch_stress")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    models = set(args.models.split(","))
    if not models or not models <= {"tiny", "smollm2"}:
        ap.error(f"--models must be a comma-separated subset of tiny,smollm2, got {args.models!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_family(Path(tmp) / "tiny_llama", "llama")
        text = Path(tmp) / "text.txt"
        text.write_text(TEXT)
        matrix = [(n, a) for n, a in job_matrix(tiny, text) if n.split()[1] in models]
        rows = []
        for i in progress_bar(range(args.jobs), desc="launch jobs", unit="job"):
            name, argv = matrix[i % len(matrix)]
            row = {"job": i, "name": name, **run_job(argv, args.timeout)}
            rows.append(row)
            if not row["clean"]:
                log.warning("job %d (%s) not clean: exit %s; %s", i, name, row["exit_code"], row["failure_lines"])
    failed = [r for r in rows if not r["clean"]]
    aborts = [r for r in rows if any("terminate called" in x or "SIGABRT" in x for x in r["failure_lines"])]
    summary = {"jobs": len(rows), "clean": len(rows) - len(failed), "not_clean": len(failed), "aborts": len(aborts)}
    atomic_write_json(args.out + ".json", {"settings": vars(args), "provenance": provenance(), "summary": summary,
                                           "matrix": [n for n, _ in matrix], "jobs": rows})
    lines = ["| job | exit | seconds | clean |", "|---|---:|---:|---|"]
    by_name: dict[str, list[dict]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    lines = ["| job kind | runs | clean | aborts (SIGABRT / terminate) | median s |", "|---|---:|---:|---:|---:|"]
    for name, rs in by_name.items():
        secs = sorted(r["seconds"] for r in rs)
        lines.append(f"| {name} | {len(rs)} | {sum(r['clean'] for r in rs)} | "
                     f"{sum(r in aborts for r in rs)} | {secs[len(secs) // 2]:.1f} |")
    lines.append(f"| **all** | {summary['jobs']} | {summary['clean']} | {summary['aborts']} | |")
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
