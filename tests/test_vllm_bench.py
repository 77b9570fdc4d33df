"""``syncdrop bench --engine vllm`` in vLLM's compiled path (slow: three engines): one engine per plan on
one export, then a diagnostic engine with the sync clock on; payload bytes in the engine's dtype (bf16)."""

from __future__ import annotations

import pytest

from syncdrop.bench.ring import Link
from syncdrop.models.loading import resolve_model
from syncdrop.serve.vllm_bench import vllm_bench

pytestmark = [pytest.mark.needs_vllm, pytest.mark.slow]


def test_one_compiled_engine_per_plan_and_a_diagnostic_run(tiny_vllm_dir, tmp_path) -> None:
    model = tiny_vllm_dir("llama")
    prompt = list(range(3, 35))  # 32 tokens
    res = vllm_bench(str(model), 2, ["none", "all"], prompt, 2, 2, 1, tmp_path, link=Link(latency=1e-4),
                     max_reps=2, dtype="bfloat16")
    engine = res["engine"]
    assert engine["name"] == "vllm+syncdrop" and engine["architectures"] == ["SyncdropLlamaForCausalLM"]
    assert engine["compilation"]["mode"] != "NONE" and set(engine["startup_s"]) == {"none", "all", "diagnostic"}
    assert [r["plan"] for r in res["plans"]] == ["none", "all"] and all(len(r["ttft_samples_ms"]) == 2
                                                                      for r in res["plans"])
    assert res["sync_points"]["baseline_plan"] == "none" and len(res["sync_points"]["prefill_ms"]) == 4
    assert min(res["sync_points"]["prefill_ms"]) >= 2 * 0.1  # ms: the link's two ring steps, clocked
    hidden = resolve_model(str(model)).config.hidden_size
    assert res["allreduce"]["prefill"]["bytes"] == 32 * hidden * 2  # bf16: 2 bytes per element
    assert {log.name for log in tmp_path.glob("vllm_bench_*.log")} == {
        "vllm_bench_plan0.log", "vllm_bench_plan1.log", "vllm_bench_diagnostic.log"}
