"""Simulated tensor parallelism (plan none) equals transformers' own model, and SPD at N=1 equals dense.

References: transformers' forward on the same weights (tiny random models of each family, built
with transformers and saved to disk, and the real SmolLM2 GGUF), fp32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import DROP_VARIANTS, SyncPlan

FAMILIES = ["tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_phi3_dir", "tiny_opt_dir"]


def _batch(vocab: int, seq: int = 19, batch: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    assert not torch.equal(ids[0], ids[1])  # different sequences in the batch
    return ids


def _hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-4) -> None:
    diff = (out - ref).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_match_transformers_for_tp_1_to_4(family: str, request: pytest.FixtureRequest) -> None:
    path = str(request.getfixturevalue(family))
    src = resolve_model(path)
    ids = _batch(src.config.vocab_size)
    ref = _hf_logits(path, ids)
    for n in (1, 2, 3, 4):
        model = simulated_model(src.config, src.reader.get, n)
        _assert_close(model(ids), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_drop_variant_at_tp1_equals_dense(family: str, request: pytest.FixtureRequest) -> None:
    """With one rank there is nothing to sum: every drop variant must reduce to the dense block."""
    src = resolve_model(str(request.getfixturevalue(family)))
    ids = _batch(src.config.vocab_size)
    model = simulated_model(src.config, src.reader.get, 1)
    dense = model(ids)
    for variant in DROP_VARIANTS:
        model.plan = SyncPlan.uniform(src.config.num_layers, variant)
        _assert_close(model(ids), dense, tol=1e-5)


def test_drop_changes_output_at_tp2(tiny_llama_dir) -> None:
    """Guard against a plan that is silently ignored: dropping syncs at N=2 must change logits."""
    src = resolve_model(str(tiny_llama_dir))
    ids = _batch(src.config.vocab_size)
    model = simulated_model(src.config, src.reader.get, 2)
    full = model(ids)
    model.plan = SyncPlan.uniform(src.config.num_layers, "drop")
    assert (model(ids) - full).abs().max().item() > 1e-3


def test_smollm2_matches_transformers_for_tp_1_to_4(smollm2_source, smollm2_hf) -> None:
    ids = _batch(smollm2_source.config.vocab_size, seq=24, batch=2)
    with torch.no_grad():
        ref = smollm2_hf(ids).logits
    for n in (1, 2, 3, 4):
        model = simulated_model(smollm2_source.config, smollm2_source.reader.get, n)
        _assert_close(model(ids), ref)


def test_smollm2_spd_at_tp1_equals_dense(smollm2_source, smollm2_hf) -> None:
    ids = _batch(smollm2_source.config.vocab_size, seq=16, batch=2, seed=1)
    with torch.no_grad():
        ref = smollm2_hf(ids).logits
    plan = SyncPlan.uniform(smollm2_source.config.num_layers, "drop")
    _assert_close(simulated_model(smollm2_source.config, smollm2_source.reader.get, 1, plan)(ids), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_transformers_bf16_within_bf16_error(family: str, request: pytest.FixtureRequest) -> None:
    """In bfloat16, the simulated executor at TP 1-3 and transformers' own model in bfloat16 differ by no
    more than bfloat16 itself moves transformers' logits away from float32 (times 2): the two bfloat16
    implementations agree to bfloat16's precision. Both really run in bfloat16 (that error is not 0)."""
    path = str(request.getfixturevalue(family))
    src = resolve_model(path)
    ids = _batch(src.config.vocab_size)
    ref32 = _hf_logits(path, ids)
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref16 = hf16(ids).logits.float()
    precision = (ref16 - ref32).abs().max().item()
    assert precision > 0
    for n in (1, 2, 3):
        out = simulated_model(src.config, src.reader.get, n, dtype=torch.bfloat16)(ids)
        assert out.dtype == torch.bfloat16
        diff = (out.float() - ref16).abs().max().item()
        assert diff <= 2 * precision, f"tp={n}: {diff:.3g} > 2 x {precision:.3g}"
