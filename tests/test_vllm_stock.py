"""Plan ``none`` through the syncdrop plugin equals stock vLLM: the tiny Llama (vLLM-sized) served as it is by
stock vLLM, and exported under plan ``none`` and served through the plugin's ``SyncdropLlamaForCausalLM``
(forced with ``hf_overrides``), at TP=2 in fp32, both compiled as vLLM does by default. Both also equal
syncdrop's simulated executor."""

from __future__ import annotations

import pytest
import torch

from syncdrop.serve.engine import run_job
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import compare, reference_logprobs

pytestmark = pytest.mark.needs_vllm

TP = 2


@pytest.fixture(scope="module")
def runs(tiny_vllm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_stock")
    model = tiny_vllm_dir("llama")
    prompts = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0)).tolist()
    exported = export_model(str(model), TP, root / "export", "none", progress=False)
    stock = run_job({"model": str(model), "tp": TP, "prompts": prompts, "max_tokens": 6}, root / "stock.log")
    plugin = run_job({"model": str(exported.out), "tp": TP, "prompts": prompts, "max_tokens": 6,
                      "architecture": "SyncdropLlamaForCausalLM"}, root / "plugin.log")
    return {"stock": stock, "plugin": plugin, "ref": reference_logprobs(str(model), TP, prompts, 6, "none")}


def test_plan_none_through_the_plugin_is_stock_vllm(runs) -> None:
    assert runs["stock"]["architectures"] == ["LlamaForCausalLM"]
    assert runs["plugin"]["architectures"] == ["SyncdropLlamaForCausalLM"]
    assert runs["plugin"]["compilation"] == runs["stock"]["compilation"]
    assert runs["stock"]["compilation"]["mode"] != "NONE"
    assert runs["plugin"]["prompt_logprobs"] == runs["stock"]["prompt_logprobs"]
    assert runs["plugin"]["tokens"] == runs["stock"]["tokens"]


def test_stock_vllm_equals_the_simulated_executor(runs) -> None:
    cmp = compare(runs["stock"], runs["ref"])
    assert cmp["max_abs_dlogp"] <= 1e-3 and cmp["tokens_equal"], cmp
