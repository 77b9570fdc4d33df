"""Perplexity over consecutive non-overlapping windows.

Convention (fixed so numbers are comparable across runs): the text as-is, tokenized once without
special tokens, cut into consecutive non-overlapping windows of L tokens (the tail shorter than L
is dropped; with ``max_windows`` K only the first K windows), and

    ppl = exp( sum_w sum_{t=1}^{L-1} -log p(x_{w,t} | x_{w,<t}) / (W * (L - 1)) )

i.e. every token after the first in each window is scored, with no context carried across windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from syncdrop.errors import SyncdropError
from syncdrop.parallel.block_store import release_free_memory


class CausalLM(Protocol):
    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor: ...  # (B, S) -> (B, S, h)
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # (..., h) -> (..., V)


@dataclass
class PerplexityResult:
    ppl: float
    nll_sum: float
    tokens: int  # scored tokens = windows * (seq_len - 1)
    windows: int
    seq_len: int
    window_nll: list[float]  # mean NLL of each window (raw samples)


def make_windows(token_ids: list[int] | torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """``(W, L)`` tensor of consecutive non-overlapping windows."""
    if seq_len < 2:
        raise SyncdropError(f"--seq-len must be at least 2, got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise SyncdropError(f"--max-windows must be at least 1, got {max_windows}")
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    n = ids.numel() // seq_len
    if n == 0:
        raise SyncdropError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seq_len].view(n, seq_len)


def text_windows(tokenizer, text: str, seq_len: int, count: int, what: str, required: int | None = None
                 ) -> torch.Tensor:
    """The first ``count`` windows of ``seq_len`` tokens of ``text`` as a ``(W, seq_len)`` tensor
    (no special tokens added; W <= count); a :class:`SyncdropError` naming ``what`` (e.g.
    ``"--calib wikitext2:valid"``) when the text holds fewer than ``required`` (default ``count``)."""
    w = make_windows(tokenizer(text, add_special_tokens=False)["input_ids"], seq_len, count)
    release_free_memory()  # the tokenizer's encoding of the whole text, freed: its heap pages back to the system
    if w.shape[0] < (count if required is None else required):
        raise SyncdropError(f"{what} has only {w.shape[0]} windows of {seq_len} tokens; {count} are needed")
    return w


def window_nll(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Summed NLL of tokens 1..L-1 of each window; ``windows`` ``(B, L)`` (any device) -> ``(B,)`` fp32 on
    the logits' device (the targets are moved there)."""
    return nll_of_hidden(model, model.hidden_states(windows), windows)


def nll_of_hidden(model: CausalLM, hidden: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """:func:`window_nll` from the windows' final hidden states ``(B, L, h)``, already computed."""
    h = hidden[:, :-1]  # (B, L-1, h)
    logits = model.logits(h).float()  # (B, L-1, V)
    B, T, V = logits.shape
    targets = windows[:, 1:].reshape(B * T).to(logits.device)  # (B*T,)
    # flat (B*T, V) layout: cross_entropy over a strided class axis is ~8x slower on CPU
    nll = F.cross_entropy(logits.reshape(B * T, V), targets, reduction="none")
    return nll.view(B, T).sum(-1)


def streams_blocks(model: object) -> bool:
    """True for a model that reads its blocks from the checkpoint on demand (``resident_blocks``)."""
    return bool(getattr(getattr(model, "blocks", None), "streams", False))


def perplexity(
    model: CausalLM, windows: torch.Tensor, batch_size: int = 1, progress: bool = True, desc: str = "perplexity"
) -> PerplexityResult:
    """Perplexity of ``model`` on ``windows`` ``(W, L)``, evaluated ``batch_size`` windows at a time (one
    host read per batch: its windows' NLL sums, for the running figure). A model that streams its
    blocks is evaluated layer-wise (every batch through a block before the next block is read;
    :meth:`~syncdrop.parallel.executor.TPModel.layerwise_hidden_states`): the same numbers, bit for bit."""
    from syncdrop.progress import progress_bar

    W, L = windows.shape
    sums: list[float] = []
    if streams_blocks(model):
        batches = [windows[i : i + batch_size] for i in range(W)[::batch_size]]
        with torch.inference_mode():
            hidden = model.layerwise_hidden_states(batches, progress=progress)  # type: ignore[attr-defined]
            for h, ids in zip(hidden, batches, strict=True):
                sums += nll_of_hidden(model, h, ids).tolist()
        total = sum(sums)
        return PerplexityResult(math.exp(total / (W * (L - 1))), total, W * (L - 1), W, L, [s / (L - 1) for s in sums])
    with torch.inference_mode(), progress_bar(total=W, desc=desc, unit="win", disable=not progress, leave=False) as bar:
        for i in range(0, W, batch_size):
            sums += window_nll(model, windows[i : i + batch_size]).tolist()
            bar.update(min(batch_size, W - i))
            bar.set_postfix(ppl=f"{math.exp(sum(sums) / (len(sums) * (L - 1))):.3f}")
    total = sum(sums)
    tokens = W * (L - 1)
    return PerplexityResult(math.exp(total / tokens), total, tokens, W, L, [s / (L - 1) for s in sums])
