"""The plugin's SPD variants of OPT (biases everywhere: added once, after the sum), Qwen2 (q/k/v biases),
Mistral, Llama (also with Llama 3.x ``llama3`` rope scaling), Qwen3 (q/k norms) and Phi-3 (fused qkv_proj and
gate_up_proj) in vLLM (CPU, fp32, vLLM's default compilation) against syncdrop's simulated executor
under a mixed plan. The OPT case is in the default run (one engine); the others are ``slow``. The OPT engine
also runs the plugin's sync clock and an emulated link (:mod:`syncdrop.serve.vllm_link`): under
compilation both are custom ops in the traced graph, and the clock shows them at every sync point of every
forward, the link's wait included, with the log-probs unchanged. Then it refuses a switch of its SPD blocks:
the trace would ignore it (the eager engine of ``test_vllm_compile.py`` takes the same switch). Every
``Syncdrop<arch>`` the plugin registers is checked to be defined (no engine)."""

from __future__ import annotations

import pytest
import torch

from syncdrop.models.hf_reader import SUPPORTED_HF_ARCHS
from syncdrop.plan import SyncPlan
from syncdrop.serve.engine import run_job
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import compare, reference_logprobs
from syncdrop.serve.vllm_link import ENV_INSTRUMENT, ENV_LATENCY

pytestmark = pytest.mark.needs_vllm


LINK_LATENCY = 2e-4  # s per ring step: an all-reduce over 2 ranks waits 2 steps


def _case(tiny_vllm_dir, tmp_path, family: str, tp: int, plan: str, clocked: bool = False, **job) -> dict:
    model = tiny_vllm_dir(family)
    prompts = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    exported = export_model(str(model), tp, tmp_path / "export", plan, progress=False)
    env = {ENV_INSTRUMENT: "1", ENV_LATENCY: repr(LINK_LATENCY)} if clocked else None
    got = run_job({"model": str(exported.out), "tp": tp, "prompts": prompts, "max_tokens": 6, "record": clocked,
                   **job}, tmp_path / "vllm.log", env=env)
    assert got["architectures"] == [exported.architecture] and exported.architecture.startswith("Syncdrop")
    assert got["compilation"]["mode"] != "NONE" and not got["compilation"]["enforce_eager"]
    cmp = compare(got, reference_logprobs(str(model), tp, prompts, 6, plan))
    assert cmp["max_abs_dlogp"] <= 1e-3 and cmp["tokens_equal"], cmp
    assert compare(got, reference_logprobs(str(model), tp, prompts, 6, "none"))["max_abs_dlogp"] > 1e-2
    return got


def test_opt_compiled_clock_link_and_a_refused_switch(tiny_vllm_dir, tmp_path) -> None:
    got = _case(tiny_vllm_dir, tmp_path, "opt", 2, "blocks:1", clocked=True, switch=[])
    ar = [rank["all_reduce"] for rank in got["collectives"]]
    per_forward = 1 + SyncPlan.dropping(2, [1]).collectives_per_forward  # the embedding's, then 3 sync points
    assert len(ar[0]) == len(ar[1]) and len(ar[0]) >= 6 * per_forward and len(ar[0]) % per_forward == 0
    assert min(min(a) for a in ar) >= 2 * LINK_LATENCY  # the link's wait ran at every call
    refusal = got["switch"]["error"]  # raised by every worker, after the engine compiled the model
    assert "syncdrop plugin: cannot switch SPD blocks from [1] to []: this engine compiled the model " \
        "(compilation mode DYNAMO_TRACE_ONCE), so the switch would be silently ignored" in refusal
    assert "start one engine per plan" in refusal and "\n" not in refusal


def test_every_registered_architecture_has_its_class() -> None:
    """Each ``Syncdrop<arch>`` the plugin registers (one per arch syncdrop loads) is defined, over vLLM's ``<arch>``."""
    import subprocess

    from syncdrop.serve.engine import vllm_python

    code = ("import syncdrop.serve.vllm_models as m; from syncdrop.serve.vllm_plugin import served_architectures\n"
            "for arch, target in served_architectures().items():\n"
            "    cls = getattr(m, target.split(':')[1], None)\n"
            "    print(arch, cls is not None and cls.__name__ == arch and cls.__mro__[1].__name__ == arch[8:])")
    out = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    got = dict(line.split() for line in out.stdout.splitlines() if line.startswith("Syncdrop"))
    assert got == {f"Syncdrop{a}": "True" for a in SUPPORTED_HF_ARCHS}, got


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,plan", [("llama", 2, "all"), ("qwen2", 3, "blocks:0"), ("mistral", 3, "blocks:1"),
                                            ("llama3", 2, "blocks:1"), ("qwen3", 2, "all"), ("phi3", 3, "blocks:0")])
def test_llama_family(tiny_vllm_dir, tmp_path, family, tp, plan) -> None:
    _case(tiny_vllm_dir, tmp_path, family, tp, plan)


def test_a_failed_engine_start_is_one_line_naming_the_log(tiny_vllm_dir, tmp_path) -> None:
    """A config that vLLM's model build refuses (here a partial-sync plan written into an export by hand):
    the plugin's reason, from the worker's log, in one SyncdropError that names the log file."""
    import json

    from syncdrop.errors import SyncdropError

    exported = export_model(str(tiny_vllm_dir("llama")), 1, tmp_path / "export", "all", progress=False)
    cfg_path = exported.out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["syncdrop_plan"] = SyncPlan.partial(2, 0.5).to_dict()
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(SyncdropError) as e:  # TP=1: the refusal does not depend on TP; one worker starts faster
        run_job({"model": str(exported.out), "tp": 1, "prompts": [[1, 2, 3]], "max_tokens": 1}, tmp_path / "v.log")
    msg = str(e.value)
    assert "syncdrop plugin: config.json syncdrop_plan cannot be served by vLLM: partial-sync (CAAT-Net) plans are " \
        "not served" in msg
    assert f"log: {tmp_path / 'v.log'}" in msg and "\n" not in msg
