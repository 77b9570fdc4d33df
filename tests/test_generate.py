"""KV-cache generation: equals full recomputation, and equals transformers' greedy output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from syncdrop.generate import SamplingParams, generate, sample_next
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import parse_plan


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_opt_dir"])
@pytest.mark.parametrize("plan", ["none", "all", "blocks:1"])
def test_cached_steps_equal_full_forward(family, plan, request) -> None:
    """Prefill + one-token steps through the cache give the same logits as one full forward."""
    src = resolve_model(str(request.getfixturevalue(family)))
    model = simulated_model(src.config, src.reader.get, 3, parse_plan(plan, src.config.num_layers))
    ids = torch.randint(0, src.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model.hidden_states(ids)
    cache = model.new_cache(2, 12)
    parts = [model.hidden_states(ids[:, :5], cache, 0), model.hidden_states(ids[:, 5:8], cache, 5)]
    parts += [model.hidden_states(ids[:, i : i + 1], cache, i) for i in range(8, 12)]
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-5


def test_tiny_greedy_matches_transformers(tiny_llama_dir) -> None:
    src = resolve_model(str(tiny_llama_dir))
    prompt = torch.randint(0, src.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ref = hf.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
    got = generate(simulated_model(src.config, src.reader.get, 4), prompt, 20).tokens
    assert torch.equal(got, ref)


def test_smollm2_greedy_32_tokens_match_transformers(smollm2_source, smollm2_hf) -> None:
    tok = smollm2_source.load_tokenizer()
    text = "Tensor parallelism splits every layer of a neural network across several devices, so that"
    prompt = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    # no EOS stopping on either side (min_new_tokens would instead *suppress* EOS in transformers)
    cfg = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
    ref = smollm2_hf.generate(prompt, generation_config=cfg)
    assert ref.shape[1] == prompt.shape[1] + 32, "transformers stopped early: pick a prompt without EOS in 32 tokens"
    got = generate(simulated_model(smollm2_source.config, smollm2_source.reader.get, 2), prompt, 32).tokens
    assert torch.equal(got, ref), (tok.decode(got[0]), tok.decode(ref[0]))


def test_sampling_is_seeded_and_respects_top_k() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=3, seed=5)
    a = sample_next(logits, p, torch.Generator().manual_seed(5))
    b = sample_next(logits, p, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    top3 = logits.topk(3, dim=-1).indices
    assert all(a[i] in top3[i] for i in range(4))
    nucleus = sample_next(logits, SamplingParams(temperature=1.0, top_p=1e-6), torch.Generator())
    assert torch.equal(nucleus, logits.argmax(-1))
