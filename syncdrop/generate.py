"""Autoregressive generation with a KV cache: one prefill forward, then one forward per new token.

Works with any executor that has ``hidden_states(ids, cache, start)``, ``logits`` and ``new_cache``
(:class:`~syncdrop.parallel.executor.TPModel`), under any sync plan. In the distributed runtime
every rank runs this loop; ``agree`` makes all ranks use rank 0's tokens (a broadcast), which is
needed only when ranks may disagree (plans with diverging ablation blocks).

Everything per token stays on the model's device (``model.device``): the prompt is moved there once,
the sampling generator and the EOS flags live there, and the loop reads nothing back to the host
except, when ``eos_id`` is given, whether every sequence has finished. Timings use
:func:`~syncdrop.parallel.device.device_clock`, which waits for the device before each reading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from syncdrop.errors import SyncdropError
from syncdrop.parallel.device import device_clock


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise sample from softmax(logits / T) restricted to the
    ``top_k`` most likely tokens and/or the smallest set with cumulative probability >= ``top_p``."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.temperature < 0:
            raise SyncdropError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise SyncdropError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise SyncdropError(f"--top-p must be in (0, 1], got {self.top_p}")


def sample_next(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """Next token ids ``(B,)`` from last-position logits ``(B, V)``, on their device; ``gen`` must be on
    that device (:func:`sampling_generator`)."""
    if p.temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / p.temperature
    if p.top_k is not None:
        kth = scores.topk(min(p.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p is not None:
        sorted_s, order = scores.sort(dim=-1, descending=True)
        cum = sorted_s.softmax(-1).cumsum(-1)
        drop = cum - sorted_s.softmax(-1) >= p.top_p  # tokens after the nucleus is complete
        scores = scores.scatter(-1, order, sorted_s.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(-1), 1, generator=gen).squeeze(-1)


def sampling_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """The seeded generator that :func:`sample_next` draws from on ``device``."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, S + new) prompt and generated ids
    new_tokens: int
    ttft_s: float  # prefill forward + first token
    decode_s: list[float] = field(default_factory=list)  # one entry per further token


@torch.inference_mode()
def generate(
    model, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams = SamplingParams(),
    eos_id: int | None = None, agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    clock: Callable[[], float] | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt`` ``(B, S)`` (equal-length prompts, any device).

    Stops early only when every sequence has produced ``eos_id``; finished sequences repeat it.
    ``tokens`` are on the model's device. ``clock``: default :func:`device_clock` of that device.
    """
    if max_new_tokens < 1:
        raise SyncdropError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    params.validate()
    B, S = prompt.shape
    device = getattr(model, "device", prompt.device)
    prompt = prompt.to(device)
    gen = sampling_generator(device, params.seed)
    cache = model.new_cache(B, S + max_new_tokens)
    agree = agree or (lambda t: t)
    clock = clock or device_clock(device)

    t0 = clock()
    h = model.hidden_states(prompt, cache, 0)[:, -1]  # (B, h)
    nxt = agree(sample_next(model.logits(h), params, gen))
    ttft = clock() - t0
    out = [prompt, nxt[:, None]]
    done = nxt == eos_id if eos_id is not None else None  # (B,) on the device
    decode: list[float] = []
    for i in range(1, max_new_tokens):
        if done is not None and bool(done.all()):  # the one host read per token, and only with an EOS
            break
        t0 = clock()
        h = model.hidden_states(nxt[:, None], cache, S + i - 1)[:, -1]
        nxt = agree(sample_next(model.logits(h), params, gen))
        if done is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done = done | (nxt == eos_id)
        decode.append(clock() - t0)
        out.append(nxt[:, None])
    tokens = torch.cat(out, dim=1)
    return Generation(tokens, tokens.shape[1] - S, ttft, decode)
