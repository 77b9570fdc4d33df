"""Settings of a from-scratch training run (torch-free, so building the CLI parser stays cheap)."""

from __future__ import annotations

from dataclasses import dataclass

from syncdrop.errors import SyncdropError


@dataclass(frozen=True)
class TrainSettings:
    tp: int = 8
    sync_fraction: float = 1.0
    steps: int = 1000
    batch: int = 8
    seq_len: int = 256
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    ffn: int = 688
    vocab_size: int = 8192
    val_books: int = 2
    val_every: int = 100
    val_windows: int = 32
    ckpt_every: int = 100
    mask: str = "fixed"
    scale: bool = True

    def check(self) -> None:
        from syncdrop.plan import PARTIAL_MASKS

        if self.mask not in PARTIAL_MASKS:
            raise SyncdropError(f"--mask must be one of {', '.join(PARTIAL_MASKS)}, got {self.mask!r}")
        if not 0 <= self.sync_fraction <= 1:
            raise SyncdropError(f"--sync-fraction must be between 0 and 1, got {self.sync_fraction}")
        for k in ("steps", "batch", "seq_len", "hidden", "layers", "heads", "kv_heads", "ffn", "val_every",
                  "val_windows", "ckpt_every"):
            if getattr(self, k) < 1:
                raise SyncdropError(f"--{k.replace('_', '-')} must be at least 1, got {getattr(self, k)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise SyncdropError(f"--hidden ({self.hidden}) must be a multiple of --heads ({self.heads}), and --heads "
                                f"of --kv-heads ({self.kv_heads})")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr and self.warmup >= 0 and self.clip > 0):
            raise SyncdropError("need --lr > 0, 0 <= --min-lr <= --lr, --warmup >= 0, --clip > 0")
