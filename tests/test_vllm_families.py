"""The plugin's SPD variants of OPT (biases everywhere: added once, after the sum), Qwen2 (q/k/v biases),
Mistral and Llama in vLLM (CPU, fp32) against syncdrop's simulated executor under a mixed plan. The OPT
case is in the default run (one engine); the others are ``slow``."""

from __future__ import annotations

import pytest
import torch

from syncdrop.serve.engine import run_job
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import compare, reference_logprobs

pytestmark = pytest.mark.needs_vllm


def _case(tiny_vllm_dir, tmp_path, family: str, tp: int, plan: str) -> None:
    model = tiny_vllm_dir(family)
    prompts = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    exported = export_model(str(model), tp, tmp_path / "export", plan, progress=False)
    got = run_job({"model": str(exported.out), "tp": tp, "prompts": prompts, "max_tokens": 6}, tmp_path / "vllm.log")
    assert got["architectures"] == [exported.architecture] and exported.architecture.startswith("Syncdrop")
    cmp = compare(got, reference_logprobs(str(model), tp, prompts, 6, plan))
    assert cmp["max_abs_dlogp"] <= 1e-3 and cmp["tokens_equal"], cmp
    assert compare(got, reference_logprobs(str(model), tp, prompts, 6, "none"))["max_abs_dlogp"] > 1e-2


def test_opt_mixed_plan(tiny_vllm_dir, tmp_path) -> None:
    _case(tiny_vllm_dir, tmp_path, "opt", 2, "blocks:1")


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,plan", [("llama", 2, "all"), ("qwen2", 3, "blocks:0"), ("mistral", 3, "blocks:1")])
def test_llama_family(tiny_vllm_dir, tmp_path, family, tp, plan) -> None:
    _case(tiny_vllm_dir, tmp_path, family, tp, plan)


def test_a_failed_engine_start_is_one_line_naming_the_log(tiny_vllm_dir, tmp_path) -> None:
    """A config that vLLM's model build refuses (here a partial-sync plan written into an export by hand):
    the plugin's reason, from the worker's log, in one SyncdropError that names the log file."""
    import json

    from syncdrop.errors import SyncdropError
    from syncdrop.plan import SyncPlan

    exported = export_model(str(tiny_vllm_dir("llama")), 2, tmp_path / "export", "all", progress=False)
    cfg_path = exported.out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["syncdrop_plan"] = SyncPlan.partial(2, 0.5).to_dict()
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(SyncdropError) as e:
        run_job({"model": str(exported.out), "tp": 2, "prompts": [[1, 2, 3]], "max_tokens": 1}, tmp_path / "v.log")
    msg = str(e.value)
    assert "syncdrop plugin: config.json syncdrop_plan cannot be served by vLLM: partial-sync (CAAT-Net) plans are " \
        "not served" in msg
    assert f"log: {tmp_path / 'v.log'}" in msg and "\n" not in msg
