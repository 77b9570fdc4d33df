"""KV-cache generation: equals full recomputation and transformers' greedy output; sampling follows
softmax(logits / T) with the top-k / top-p restrictions computed by hand; EOS stops a batch."""

from __future__ import annotations

import math

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


# 0.999 quantiles of the chi-square distribution (scipy.stats.chi2.ppf(0.999, df)); a seeded run either
# passes or fails every time, and a sampler that drifts from the expected law lands far above these.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
DRAWS = 40_000


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """Token counts of DRAWS independent draws from one row of logits (one call: DRAWS rows)."""
    draws = sample_next(logits.expand(DRAWS, -1), params, torch.Generator().manual_seed(seed))
    return torch.bincount(draws, minlength=logits.shape[-1])


def _assert_law(counts: torch.Tensor, expected: dict[int, float]) -> None:
    """Only the tokens of ``expected`` are ever drawn, with frequencies that fit its probabilities
    (renormalised here) by a chi-square test at the 0.999 level."""
    support = sorted(expected)
    outside = [t for t in range(counts.numel()) if t not in expected]
    assert counts[outside].sum().item() == 0, f"tokens outside {support} drawn: {counts.tolist()}"
    total = sum(expected.values())
    n = counts.sum().item()
    assert n == DRAWS
    if len(support) == 1:
        return
    exp = torch.tensor([expected[t] / total * n for t in support], dtype=torch.float64)
    obs = counts[support].double()
    chi2 = ((obs - exp) ** 2 / exp).sum().item()
    assert chi2 < CHI2_999[len(support) - 1], (chi2, obs.tolist(), exp.tolist())


def test_sampling_is_seeded() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=3, seed=5)
    a = sample_next(logits, p, torch.Generator().manual_seed(5))
    b = sample_next(logits, p, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    nucleus = sample_next(logits, SamplingParams(temperature=1.0, top_p=1e-6), torch.Generator())
    assert torch.equal(nucleus, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_frequencies_follow_softmax_over_temperature(temperature) -> None:
    """Empirical frequencies of 40k draws fit softmax(logits / T) computed here (argmax, or a
    sampler that ignores T, fails by orders of magnitude)."""
    logits = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.0, 1.6, -0.5, 0.8])
    e = [math.exp(x / temperature) for x in logits.tolist()]
    _assert_law(_draw(logits, SamplingParams(temperature=temperature)), {t: v for t, v in enumerate(e)})


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_draws_only_the_k_most_likely_renormalised(k) -> None:
    """Top-k: nothing outside the k largest logits is ever drawn; inside, softmax renormalised."""
    logits = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.0, 1.6, -0.5, 0.8])
    by_logit = [1, 5, 3, 7, 0, 4, 6, 2]  # token ids sorted by logit, written out by hand
    T = 0.8
    expected = {t: math.exp(logits[t].item() / T) for t in by_logit[:k]}
    _assert_law(_draw(logits, SamplingParams(temperature=T, top_k=k)), expected)


# probabilities given directly (logits = their logs, T = 1), in scrambled token order; sorted:
# token 4: 0.40, 1: 0.25, 6: 0.15, 0: 0.10, 3: 0.05, 2: 0.03, 5: 0.02
# cumulative:   0.40    0.65    0.80    0.90    0.95    0.98    1.00
PROBS = [0.10, 0.25, 0.03, 0.05, 0.40, 0.02, 0.15]


@pytest.mark.parametrize("top_p, nucleus", [
    (0.3, [4]),              # the top token alone already reaches p
    (0.5, [4, 1]),           # 0.40 < 0.5 <= 0.65
    (0.7, [4, 1, 6]),        # 0.65 < 0.7 <= 0.80: the token that crosses p is in
    (0.92, [4, 1, 6, 0, 3]),  # 0.90 < 0.92 <= 0.95
    (1.0, [4, 1, 6, 0, 3, 2, 5]),
])
def test_top_p_nucleus_is_the_smallest_set_reaching_p(top_p, nucleus) -> None:
    """Top-p: exactly the smallest most-likely-first set with cumulative probability >= p is drawn
    from (tokens outside never), with the probabilities renormalised over it."""
    logits = torch.tensor(PROBS).log()
    _assert_law(_draw(logits, SamplingParams(temperature=1.0, top_p=top_p)), {t: PROBS[t] for t in nucleus})


def test_top_k_then_top_p_on_the_renormalised_top_k() -> None:
    """top_k=4 keeps {4, 1, 6, 0} (mass 0.90); renormalised, the cumulative probabilities are
    0.444, 0.722, ...: top_p=0.7 then keeps {4, 1} (on the raw probabilities it would keep {4, 1, 6})."""
    logits = torch.tensor(PROBS).log()
    _assert_law(_draw(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.7)), {4: 0.40, 1: 0.25})


def _eos_case(hf, vocab: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two prompts and a token that transformers' greedy run produces in both, first at different
    steps (searched deterministically over seeded prompts). Returns (prompts, greedy new tokens, eos)."""
    prompts = torch.randint(0, vocab, (6, 5), generator=torch.Generator().manual_seed(0))
    greedy = hf.generate(prompts, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    new = greedy[:, prompts.shape[1]:].tolist()
    for i in range(len(new)):
        for j in range(i + 1, len(new)):
            for t in new[i]:
                if t in new[j] and new[i].index(t) != new[j].index(t) < steps - 2 and new[i].index(t) < steps - 2:
                    return prompts[[i, j]], torch.tensor([new[i], new[j]]), t
    raise AssertionError("no token shared by two greedy runs at different steps: change the prompt seed")


def test_eos_stops_when_every_sequence_finished_and_finished_ones_repeat_it(tiny_llama_dir) -> None:
    """Batch of 2 whose rows reach EOS at different steps: each row is its own greedy run up to and
    including its first EOS, then EOS repeated; generation stops right after the later row's EOS.
    References: transformers' greedy run without EOS (built by hand into the expected tokens) and
    transformers' ``generate`` with that EOS (padding finished rows with it)."""
    steps = 16
    src = resolve_model(str(tiny_llama_dir))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts, greedy, eos = _eos_case(hf, src.config.vocab_size, steps)
    first = [row.index(eos) for row in greedy.tolist()]
    assert first[0] != first[1]
    stop = max(first) + 1
    expected = torch.stack([torch.cat([greedy[r, : first[r] + 1], torch.full((stop - first[r] - 1,), eos)])
                            for r in range(2)])
    model = simulated_model(src.config, src.reader.get, 3)
    out = generate(model, prompts, steps, eos_id=eos)
    assert out.new_tokens == stop < steps
    assert torch.equal(out.tokens[:, prompts.shape[1]:], expected)
    assert len(out.decode_s) == stop - 1
    ref = hf.generate(prompts, max_new_tokens=steps, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(out.tokens, ref)
    # only one row ever produces this EOS: generation runs to max_new_tokens, that row repeats EOS
    only = next((t for t in greedy[0].tolist()[: steps - 2] if t not in greedy[1].tolist()), None)
    assert only is not None, "row 0's greedy run has no token absent from row 1's"
    out = generate(model, prompts, steps, eos_id=only)
    f = greedy[0].tolist().index(only)
    assert out.new_tokens == steps
    assert torch.equal(out.tokens[1, prompts.shape[1]:], greedy[1])
    assert out.tokens[0, prompts.shape[1]:].tolist() == greedy[0, : f + 1].tolist() + [only] * (steps - f - 1)
