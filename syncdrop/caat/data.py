"""Training text for from-scratch runs: whole books split into train/validation, a byte-level BPE
tokenizer trained on the training books only, and seeded batches.

Corpus: a directory of ``.txt`` files (searched recursively; default the Gutenberg texts in the
data folder) or one file. ``val_books`` whole books are held out for validation, chosen by a seeded
shuffle of the sorted file list, so no validation text is ever seen in training (not even by the
tokenizer). Books are joined with the end-of-text token.

Batches: step ``t`` draws ``B`` random windows of ``S + 1`` tokens from the training stream with a
generator seeded by ``(seed, t)``, so a resumed run sees exactly the batches the uninterrupted run
would have. Validation: the first ``K`` non-overlapping windows of the validation stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from syncdrop.errors import SyncdropError

EOT = "<|endoftext|>"


@dataclass
class Corpus:
    train_books: list[str]
    val_books: list[str]
    train_text: list[str]
    val_text: list[str]


def load_corpus(path: str | Path, val_books: int, seed: int) -> Corpus:
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
    else:
        raise SyncdropError(f"--corpus {path}: no such file or directory")
    if not files:
        raise SyncdropError(f"--corpus {path}: no .txt files found")
    if val_books < 0 or val_books >= len(files) and len(files) > 1:
        raise SyncdropError(f"--val-books must be between 0 and {len(files) - 1} (the corpus has {len(files)} books)")
    order = list(files)
    random.Random(seed).shuffle(order)
    val, train = (order[:val_books], order[val_books:]) if len(files) > 1 else ([], order)
    read = [f.read_text(encoding="utf-8", errors="replace") for f in train]
    vtext = [f.read_text(encoding="utf-8", errors="replace") for f in val]
    if not vtext:  # one file: the last 10% is validation
        cut = int(len(read[0]) * 0.9)
        read, vtext = [read[0][:cut]], [read[0][cut:]]
    return Corpus([str(f) for f in train], [str(f) for f in val], read, vtext)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenisation) with ``<|endoftext|>`` as BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise SyncdropError(f"--vocab-size must be at least 300 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + [eot]
    return torch.tensor(ids, dtype=torch.long)


def train_batch(stream: torch.Tensor, batch: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """``(B, S + 1)`` random windows for step ``step`` (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    if stream.numel() <= seq + 1:
        raise SyncdropError(f"training text has {stream.numel()} tokens, fewer than one window of {seq + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def val_windows(stream: torch.Tensor, seq: int, k: int) -> torch.Tensor:
    n = min(k, stream.numel() // (seq + 1))
    if n < 1:
        raise SyncdropError(f"validation text has {stream.numel()} tokens, fewer than one window of {seq + 1}")
    return stream[: n * (seq + 1)].view(n, seq + 1)
