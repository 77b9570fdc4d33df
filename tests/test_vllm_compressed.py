"""Compressed sync points served by the vLLM plugin (CPU, fp32, vLLM's default compilation) against syncdrop's
simulated executor, at TP=3 (three ranks: the two-step all-reduce's chunks, all-to-all and all-gather are not
a pairwise swap; the wire groups pad unevenly over the ranks).

The default run is one OPT engine (biases everywhere: each added once, after its compressed sum) under
``blocks:1+int8:g8``: block 0 compresses both sync points, block 1 is an SPD block whose one sync point is
compressed. The engine's log-probs and greedy tokens must be the simulated executor's under the same plan,
and clearly not those of the same plan uncompressed (``blocks:1``); Dynamo's graph (``TORCH_LOGS=graph_code``
into the engine's log) holds the custom op ``syncdrop::tp_compressed_all_reduce`` at each of the three
compressed sync points. ``slow``: int4 on every sync point of Mistral (compiled), plain and Hadamard-rotated
(``int4h``), and an SPD block with a compressed sum in an eager Qwen2 engine, which refuses to switch its SPD
blocks.

Tolerance. The served and simulated sums run the same code (``WireFormat.two_step``), but the partials they
encode come from different kernels (vLLM's sharded layers vs syncdrop's), so they agree to float32 rounding,
about 1e-6 relative. Quantisation is a step function: a partial within that distance of a rounding boundary
(or a group maximum within it of a bfloat16 scale boundary) may round the other way, moving one value by one
step of its group. Such flips are rare at these sizes (int8 in groups of 8: about 1e-5 of ~10^5 encoded
values per prompt); their effect stays far below the compression's own. The bound :data:`TOL` (2e-3 on
``max |dlogp|``, the full-sync plugin tests' 1e-3 with room for a flip) is an order of magnitude below what
the compression moves (:data:`MIN_EFFECT`, 1e-2; measured 0.029 for int8:g8 here), so the test fails when the
compressed sum is not what runs.
"""

from __future__ import annotations

import re

import pytest
import torch

from syncdrop.serve.engine import run_job
from syncdrop.serve.export import export_model
from syncdrop.serve.parity import compare, reference_logprobs

pytestmark = pytest.mark.needs_vllm

TOL = 2e-3  # max |dlogp| between the plugin and the simulated executor under the same compressed plan
MIN_EFFECT = 1e-2  # max |dlogp| the compression must move the output by (against the same plan uncompressed)
OP_CALL = " = torch.ops.syncdrop.tp_compressed_all_reduce("  # a call in the graph code (not its source comment)


def _case(tiny_vllm_dir, tmp_path, family: str, tp: int, plan: str, uncompressed: str, **job) -> tuple[dict, str]:
    model = tiny_vllm_dir(family)
    prompts = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    exported = export_model(str(model), tp, tmp_path / "export", plan, progress=False)
    assert exported.architecture.startswith("Syncdrop")
    log = tmp_path / "vllm.log"
    got = run_job({"model": str(exported.out), "tp": tp, "prompts": prompts, "max_tokens": 6, **job}, log,
                  env={"TORCH_LOGS": "graph_code"})
    assert got["architectures"] == [exported.architecture]
    cmp = compare(got, reference_logprobs(str(model), tp, prompts, 6, plan))
    assert cmp["tokens_equal"] and cmp["max_abs_dlogp"] <= TOL, cmp
    assert compare(got, reference_logprobs(str(model), tp, prompts, 6, uncompressed))["max_abs_dlogp"] > MIN_EFFECT
    return got, log.read_text()


def _graph_calls(log: str) -> int:
    """Calls of the custom op in the first graph Dynamo logged (every rank logs its own trace)."""
    graphs = re.split(r"TRACED GRAPH", log)
    assert len(graphs) > 1, "no Dynamo graph in the log"
    return graphs[1].count(OP_CALL)


def test_opt_int8_compiled_matches_simulated(tiny_vllm_dir, tmp_path) -> None:
    got, log = _case(tiny_vllm_dir, tmp_path, "opt", 3, "blocks:1+int8:g8", "blocks:1")
    assert got["compilation"]["mode"] != "NONE" and not got["compilation"]["enforce_eager"]
    assert _graph_calls(log) == 3  # block 0: attention and MLP; block 1 (SPD): its one sync point


@pytest.mark.slow
def test_mistral_int4_everywhere_compiled(tiny_vllm_dir, tmp_path) -> None:
    got, log = _case(tiny_vllm_dir, tmp_path, "mistral", 3, "int4:g8", "none")
    assert got["compilation"]["mode"] != "NONE"
    assert _graph_calls(log) == 4


@pytest.mark.slow
def test_mistral_hadamard_int4_compiled(tiny_vllm_dir, tmp_path) -> None:
    """The Hadamard-rotated format through vLLM's compiled graph: the same bits as the simulated executor."""
    got, log = _case(tiny_vllm_dir, tmp_path, "mistral", 3, "int4h:g8", "none")
    assert got["compilation"]["mode"] != "NONE"
    assert _graph_calls(log) == 4


@pytest.mark.slow
def test_qwen2_eager_spd_int4_refuses_a_switch(tiny_vllm_dir, tmp_path) -> None:
    got, _ = _case(tiny_vllm_dir, tmp_path, "qwen2", 3, "blocks:1+int4:g8", "blocks:1", eager=True, switch=[])
    assert got["compilation"]["enforce_eager"]
    refusal = got["switch"]["error"]
    assert "syncdrop plugin: cannot switch SPD blocks from [1] to []: the model's plan does more than drop " \
        "attention sync points" in refusal and "start one engine per plan" in refusal, refusal
