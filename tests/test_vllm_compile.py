"""Plan switching and vLLM's compilation. Under vLLM's default compilation (on its CPU backend one Dynamo trace,
Inductor) a switch of SPD blocks is refused
(``test_vllm_families.py::test_opt_compiled_clock_link_and_a_refused_switch``). In an eager engine nothing is
traced, so the same switch takes effect (tiny Llama, TP=2, fp32)."""

from __future__ import annotations

import pytest
import torch

from syncdrop.serve.engine import run_job
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import compare, reference_logprobs

pytestmark = pytest.mark.needs_vllm


def test_an_eager_engine_switches_plans(tiny_vllm_dir, tmp_path) -> None:
    """``eager: true`` (``enforce_eager``): an export under plan ``all`` serves ``all``, then, switched to
    ``blocks:1``, serves ``blocks:1`` (the simulated executor's log-probs and tokens under each)."""
    model = tiny_vllm_dir("llama")
    prompts = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(3)).tolist()
    exported = export_model(str(model), 2, tmp_path / "export", "all", progress=False)
    got = run_job({"model": str(exported.out), "tp": 2, "prompts": prompts, "max_tokens": 6, "eager": True,
                   "switch": [1]}, tmp_path / "vllm.log")
    assert got["compilation"]["mode"] == "NONE" and got["compilation"]["enforce_eager"]
    assert got["switch"]["blocks"] == [1]
    for res, plan in ((got, "all"), (got["switch"], "blocks:1")):
        cmp = compare(res, reference_logprobs(str(model), 2, prompts, 6, plan))
        assert cmp["max_abs_dlogp"] <= 1e-3 and cmp["tokens_equal"], (plan, cmp)
    assert compare(got["switch"], got)["max_abs_dlogp"] > 1e-2
