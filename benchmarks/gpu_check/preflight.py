"""What the check needs from the machine's Python, checked before anything but the standard library is imported.

The GPU check runs where syncdrop is not installed: an air-gapped cluster node with its own Python and
PyTorch. It needs the packages of :data:`NEEDED`, in the ranges ``pyproject.toml`` declares (the ranges the
test suite passes on). A missing package or a version outside its range is one line::

    gpu_check: needs torch>=2.11,<2.15 (found 2.10.0) in /usr/bin/python3 (ranges of pyproject.toml, ...): ...

and exit code 2, before anything is written. ``--skip-version-check`` runs anyway with versions outside the
ranges (a missing package still stops it); the result files record the versions and the ranges.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# distribution name -> import name: what the check imports (transformers brings tokenizers and the hub client)
NEEDED = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "numpy": "numpy",
          "tokenizers": "tokenizers"}
MIN_PYTHON = (3, 10)


def declared_ranges(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{"torch": ">=2.13,<2.15", ...}`` from ``[project] dependencies`` (a regex: ``tomllib`` is 3.11+); empty
    when the tree has no ``pyproject.toml``."""
    if not pyproject.is_file():
        return {}
    text = pyproject.read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    out = {}
    for spec in re.findall(r'"([^"]+)"', block[1] if block else ""):
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", spec)
        if m:
            out[m[1].lower()] = m[2].strip()
    return out


def version_tuple(v: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)`` (the release part; pre-release and local tags ignored)."""
    m = re.match(r"\d+(\.\d+)*", v.strip())
    return tuple(int(x) for x in m[0].split(".")) if m else ()


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (``>=``, ``>``, ``<=``, ``<``, ``==``, ``!=``)."""
    v = version_tuple(version)
    ops = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b,
           "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.match(r"(>=|<=|==|!=|>|<)\s*([\d.]+)", clause)
        if not m:
            continue
        want = version_tuple(m[2])
        width = max(len(v), len(want))
        if not ops[m[1]](v + (0,) * (width - len(v)), want + (0,) * (width - len(want))):
            return False
    return True


def installed_versions() -> dict[str, str | None]:
    """Version of each needed distribution in this interpreter (None when it cannot be imported)."""
    out: dict[str, str | None] = {}
    for dist, module in NEEDED.items():
        if importlib.util.find_spec(module) is None:
            out[dist] = None
            continue
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source build on the path)
            out[dist] = getattr(__import__(module), "__version__", "0")
    return out


def problems(skip_versions: bool = False) -> list[str]:
    """What stops the check, one phrase each (empty when it can run)."""
    if sys.version_info[:2] < MIN_PYTHON:
        return [f"Python>={'.'.join(map(str, MIN_PYTHON))} (this one is {sys.version.split()[0]})"]
    ranges, found = declared_ranges(), installed_versions()
    out = []
    for dist, version in found.items():
        spec = ranges.get(dist, "")
        if version is None:
            out.append(f"{dist}{spec} (not installed)")
        elif not skip_versions and not satisfies(version, spec):
            out.append(f"{dist}{spec} (found {version})")
    return out


def check(skip_versions: bool = False) -> str | None:
    """The one line that says what the check needs, or None when this interpreter has it."""
    bad = problems(skip_versions)
    if not bad:
        return None
    if bad[0].startswith("Python"):
        return f"gpu_check: needs {bad[0]}: run the check with a newer Python than {sys.executable}"
    if all("(found" in b for b in bad):
        where, hint = "ranges of pyproject.toml, where the test suite passes", \
            "--skip-version-check runs anyway and records the versions"
    else:
        where, hint = "ranges of pyproject.toml", "install them (pip) or run the check with a Python that has them"
    return f"gpu_check: needs {', '.join(bad)} in {sys.executable} ({where}): {hint}"


def report() -> dict[str, object]:
    """Declared ranges and found versions, for the result files."""
    ranges, found = declared_ranges(), installed_versions()
    return {dist: {"declared": ranges.get(dist, ""), "found": v,
                   "in_range": v is not None and satisfies(v, ranges.get(dist, ""))} for dist, v in found.items()}
