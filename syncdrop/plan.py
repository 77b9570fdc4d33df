"""The sync plan: which sync points each transformer block keeps. It is data, not code.

A plan is a list with one entry per block, ``{"attn": MODE, "mlp": "full"}``. Attention modes:

``full``        the standard block (docs/methods.md): all-reduce after attention and after the MLP.
``drop``        the SPD block (docs/methods.md): no attention all-reduce; each rank's MLP reads
                ``X + A_r``; the attention partials ride in the MLP all-reduce:
                ``X_out = X + AllReduce(A_r + Z_r) + b_o + b_down``.
``naive``       ablation: attention partial kept local, never summed:
                ``X_out_r = X + A_r + b_o + AllReduce(Z_r) + b_down`` (ranks diverge).
``desync``      ablation (Ladder-Residual's code): ``X_out = AllReduce(Z_r + (X + A_r + b_o)/N) + b_down``
                ``= X + (sum_r A_r)/N + b_o + sum_r Z_r + b_down``.
``bias-in-sum`` ablation: like ``drop`` but biases added inside the sum (counted N times):
                ``X_out = X + AllReduce(A_r + b_o + Z_r + b_down)``.

Partial sync (CAAT-Net, docs/methods.md): ``{"partial": p}`` for ``attn`` or ``mlp`` all-reduces only
the first ``k = round(p * h)`` channels; each rank keeps its other channels, scaled by sqrt(N)
(:meth:`syncdrop.parallel.comm.Communicator.partial_reduce`). The residual stream then differs per rank, and the
LM head becomes vocab-parallel. ``mlp`` may be partial under ``attn: drop`` too (SPD + partial).
Models must be trained this way (``syncdrop train``).

On disk a plan is JSON: ``{"format": "syncdrop-plan", "version": 1, "num_blocks": L,
"blocks": [...], "meta": {...}}``. The CLI accepts a spec string (:func:`parse_plan`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError

ATTN_MODES = ("full", "drop", "naive", "desync", "bias-in-sum")
DROP_VARIANTS = ATTN_MODES[1:]
MLP_MODES = ("full",)
PLAN_FORMAT = "syncdrop-plan"
PLAN_SPEC_HELP = "none | all | last:K | first:K | frac:F | blocks:0,3,7 | partial:P | PATH.json"


PARTIAL_MASKS = ("fixed", "random", "topk")


@dataclass(frozen=True)
class Partial:
    """Partial channel reduce of one sync point: ``round(p * h)`` channels are summed.

    ``mask``: which channels are shared: ``fixed`` (the first k, CAAT-Net), or the ablations
    ``random`` (a fresh random set of k per call, the same on every rank) and ``topk`` (per token,
    each rank shares its own k largest-magnitude channels). ``scale``: multiply private channels by
    sqrt(N) (CAAT-Net) or not (ablation).
    """

    p: float
    scale: bool = True
    mask: str = "fixed"

    def channels(self, hidden: int) -> int:
        return round(self.p * hidden)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"partial": self.p}
        if not self.scale:
            d["scale"] = False
        if self.mask != "fixed":
            d["mask"] = self.mask
        return d


SyncMode = str | Partial  # "full", a drop variant (attention only), or Partial


def _mode_dict(m: SyncMode) -> Any:
    return m.to_dict() if isinstance(m, Partial) else m


def payload_of(mode: SyncMode, hidden: int) -> float:
    """Payload of one sync point in ``mode`` as a fraction of a full ``(M, h)`` all-reduce: 1 for
    ``full``, 0 for a drop variant, ``round(p h) / h`` for a partial one, except the ``topk`` mask,
    which all-reduces all ``h`` channels (unshared ones zeroed): 1, or 0 when ``round(p h) = 0``."""
    if isinstance(mode, Partial):
        k = mode.channels(hidden)
        return (1.0 if k > 0 else 0.0) if mode.mask == "topk" else k / hidden
    return 1.0 if mode == "full" else 0.0


@dataclass(frozen=True)
class SyncPoint:
    """One collective of a forward: block index, ``attn`` or ``mlp`` sync point, and its payload as
    a fraction of a full ``(M, h)`` all-reduce (see :meth:`SyncPlan.sync_points`)."""

    block: int
    where: str
    payload: float


@dataclass(frozen=True)
class BlockSync:
    """Sync points of one block."""

    attn: SyncMode = "full"
    mlp: SyncMode = "full"

    def to_dict(self) -> dict[str, Any]:
        return {"attn": _mode_dict(self.attn), "mlp": _mode_dict(self.mlp)}


def _parse_mode(v: Any, allowed: tuple[str, ...], where: str) -> SyncMode:
    if isinstance(v, str) and v in allowed:
        return v
    if isinstance(v, dict) and "partial" in v and set(v) <= {"partial", "scale", "mask"}:
        p, scale, mask = v["partial"], v.get("scale", True), v.get("mask", "fixed")
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1):
            raise SyncdropError(f"{where}: partial fraction must be a number in [0, 1], got {p!r}")
        if not isinstance(scale, bool) or mask not in PARTIAL_MASKS:
            raise SyncdropError(f"{where}: scale must be true/false and mask one of {', '.join(PARTIAL_MASKS)}")
        return Partial(float(p), scale, mask)
    raise SyncdropError(f"{where}={v!r}; expected one of {', '.join(allowed)} or {{\"partial\": p}}")


@dataclass
class SyncPlan:
    """Per-block sync decisions for a model with ``len(blocks)`` blocks."""

    blocks: list[BlockSync]
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def uniform(cls, num_blocks: int, attn: str = "full") -> SyncPlan:
        return cls([BlockSync(attn=attn) for _ in range(num_blocks)])

    @classmethod
    def dropping(cls, num_blocks: int, dropped: Iterable[int], variant: str = "drop") -> SyncPlan:
        """Plan that applies ``variant`` to the attention sync of the ``dropped`` blocks."""
        if variant not in DROP_VARIANTS:
            raise SyncdropError(f"drop variant must be one of {', '.join(DROP_VARIANTS)}, got {variant!r}")
        dropped = set(dropped)
        for i in dropped:
            if not 0 <= i < num_blocks:
                raise SyncdropError(f"block index {i} out of range: the model has blocks 0..{num_blocks - 1}")
        return cls([BlockSync(attn=variant if i in dropped else "full") for i in range(num_blocks)])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @classmethod
    def partial(cls, num_blocks: int, p: float, scale: bool = True, mask: str = "fixed") -> SyncPlan:
        """Every sync point of every block partial with fraction ``p`` (CAAT-Net)."""
        m = Partial(p, scale, mask)
        return cls([BlockSync(m, m) for _ in range(num_blocks)])

    @property
    def dropped(self) -> list[int]:
        """Blocks whose attention sync point is removed (any drop variant)."""
        return [i for i, b in enumerate(self.blocks) if isinstance(b.attn, str) and b.attn != "full"]

    @property
    def has_partial(self) -> bool:
        """True if any sync point is partial (ranks keep private channels; vocab-parallel LM head)."""
        return any(isinstance(m, Partial) for b in self.blocks for m in (b.attn, b.mlp))

    def contiguous_serving_blocker(self) -> str | None:
        """Why an engine with one replicated residual stream per token (vLLM, a Megatron-style block
        with ``reduce_results`` switched off) cannot run this plan, or None when it can: it serves
        ``full`` and the SPD ``drop`` block only. Partial sync gives each rank a residual stream of its
        own (private channels) and a vocab-parallel LM head on per-rank hidden states; the ablation
        variants (``naive``, ``desync``, ``bias-in-sum``) are not meant for serving."""
        if self.has_partial:
            return ("partial-sync (CAAT-Net) plans are not served: each rank carries its own residual stream "
                    "(private channels) into a vocab-parallel LM head, while vLLM's layers carry one "
                    "replicated residual per token")
        odd = sorted({b.attn for b in self.blocks if b.attn not in ("full", "drop")})
        if odd:
            return f"only the SPD drop block is served; the plan uses the ablation variant(s) {', '.join(odd)}"
        return None

    def payload_fraction(self, hidden: int) -> list[float]:
        """Per sync point (attention then MLP, block by block, ``2 L`` entries) the payload sent as a
        fraction of a full ``(M, h)`` all-reduce (:func:`payload_of`); 0 for a dropped attention sync."""
        return [payload_of(m, hidden) for b in self.blocks for m in (b.attn, b.mlp)]

    def sync_points(self, hidden: int) -> list[SyncPoint]:
        """The collectives one forward issues on the residual stream, in order (block by block,
        attention then MLP), each with its payload as a fraction of a full ``(M, h)`` all-reduce:

        * ``full``: 1 (``AllReduce(P_r)`` after attention, ``AllReduce(Z_r)`` after the MLP);
        * a drop variant at the attention point: none; the block's MLP point carries what is left
          (``drop``: ``AllReduce(P_r + Z_r)``, payload 1; ``desync``/``naive``/``bias-in-sum``: 1);
        * ``{"partial": p}``: ``k / h`` with ``k = round(p h)`` (masks ``fixed``, ``random``); the
          ``topk`` ablation all-reduces all ``h`` channels with the unshared ones zeroed, payload 1;
          ``k = 0`` sends nothing and is not listed.

        The vocab-parallel LM head's logits all-gather (:attr:`needs_vocab_gather`) is not a sync
        point and is not listed.
        """
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
            raise SyncdropError(f"hidden size must be a positive integer, got {hidden!r}")
        out = []
        for i, b in enumerate(self.blocks):
            for where, m in (("attn", b.attn), ("mlp", b.mlp)):
                f = payload_of(m, hidden)
                if f > 0:
                    out.append(SyncPoint(i, where, f))
        return out

    @property
    def collectives_per_forward(self) -> int:
        """How many all-reduces one forward issues on the residual stream (``len(sync_points(h))``):
        two per block, one fewer per dropped attention sync; a partial sync counts as one collective
        (whatever its payload) unless ``p == 0``, which sends nothing. So ``2 L - len(dropped)`` for
        plans without a ``p = 0`` partial. Independent of ``h`` except for a partial ``0 < p < 0.5 / h``,
        which rounds to ``k = 0`` channels and is counted here but sends nothing: use
        ``len(sync_points(h))`` for such plans. The logits all-gather of :attr:`needs_vocab_gather` is
        not counted (nor by :attr:`syncdrop.parallel.comm.Communicator.calls`)."""
        return sum(1 for b in self.blocks for m in (b.attn, b.mlp)
                   if m == "full" or (isinstance(m, Partial) and m.p > 0))

    def comm_units(self, hidden: int) -> float:
        """Residual-stream communication of one forward in full-all-reduce units: the sum of the
        payload fractions of :meth:`sync_points` (``2 L`` for the dense plan, ``2 L - len(dropped)``
        without partial syncs, ``sum k / h`` over partial ones)."""
        return float(sum(p.payload for p in self.sync_points(hidden)))

    @property
    def ranks_diverge(self) -> bool:
        """True when the residual streams of different ranks can differ somewhere in a forward
        (:mod:`syncdrop.parallel.block`): after a ``naive`` block (each rank keeps ``X + A_r``
        unsummed) or a partial sync with ``p < 1`` (each rank keeps its private channels). The
        other drop variants re-sync within the block: ``drop`` and ``bias-in-sum`` sum the attention
        partials in the MLP all-reduce, and ``desync``'s output is an all-reduce (it even re-syncs
        streams that differed before it); ``p = 1`` is an ordinary all-reduce. Conservative for
        ``p`` so close to 1 that ``round(p h) = h``."""
        return any(b.attn == "naive" or any(isinstance(m, Partial) and m.p < 1 for m in (b.attn, b.mlp))
                   for b in self.blocks)

    @property
    def needs_vocab_gather(self) -> bool:
        """True when the LM head is vocab-parallel (any partial sync, :attr:`has_partial`): each rank
        computes the logits of its vocabulary slice from its own stream and the slices are
        all-gathered once per forward (:meth:`syncdrop.parallel.executor.TPModel.logits`)."""
        return self.has_partial

    @property
    def spd_fraction(self) -> float:
        return len(self.dropped) / max(1, self.num_blocks)

    def summary(self) -> str:
        d = self.dropped
        parts = []
        if d:
            variants = sorted({str(self.blocks[i].attn) for i in d})
            parts.append(f"{len(d)}/{self.num_blocks} dropped ({','.join(variants)}): {d}")
        ps = sorted({m.p for b in self.blocks for m in (b.attn, b.mlp) if isinstance(m, Partial)})
        if ps:
            n = sum(isinstance(m, Partial) for b in self.blocks for m in (b.attn, b.mlp))
            parts.append(f"{n}/{2 * self.num_blocks} sync points partial (p={','.join(f'{p:g}' for p in ps)})")
        return "; ".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": 1,
            "num_blocks": self.num_blocks,
            "blocks": [b.to_dict() for b in self.blocks],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Any, num_blocks: int | None = None, source: str = "plan") -> SyncPlan:
        if not isinstance(d, dict) or not isinstance(d.get("blocks"), list):
            raise SyncdropError(f"{source}: expected a JSON object with a 'blocks' list")
        blocks = []
        for i, b in enumerate(d["blocks"]):
            if not isinstance(b, dict):
                raise SyncdropError(f"{source}: blocks[{i}] must be an object like {{\"attn\": \"drop\"}}")
            attn = _parse_mode(b.get("attn", "full"), ATTN_MODES, f"{source}: blocks[{i}].attn")
            mlp = _parse_mode(b.get("mlp", "full"), MLP_MODES, f"{source}: blocks[{i}].mlp")
            if isinstance(mlp, Partial) and attn not in ("full", "drop") and not isinstance(attn, Partial):
                raise SyncdropError(f"{source}: blocks[{i}]: a partial MLP sync combines with attn full, drop or "
                                    f"partial, not {attn!r}")
            blocks.append(BlockSync(attn=attn, mlp=mlp))
        declared = d.get("num_blocks", len(blocks))
        if declared != len(blocks):
            raise SyncdropError(f"{source}: num_blocks={declared} but {len(blocks)} blocks listed")
        if num_blocks is not None and len(blocks) != num_blocks:
            raise SyncdropError(f"{source}: plan has {len(blocks)} blocks but the model has {num_blocks}")
        meta = d.get("meta", {})
        return cls(blocks, meta if isinstance(meta, dict) else {})

    def save(self, path: str | Path) -> None:
        from syncdrop.io_utils import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, num_blocks: int | None = None) -> SyncPlan:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise SyncdropError(f"plan file not found: {p}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SyncdropError(f"plan file {p} is not valid JSON: {e}") from None
        return cls.from_dict(d, num_blocks, source=f"plan file {p}")


def _parse_int(text: str, what: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SyncdropError(f"malformed plan {spec!r}: {what} must be an integer, got {text!r}") from None


def parse_plan(spec: str, num_blocks: int, variant: str = "drop") -> SyncPlan:
    """Build a plan from a CLI spec: ``none | all | last:K | first:K | frac:F | blocks:0,3,7 | PATH.json``.

    ``frac:F`` drops the last ``round(F * L)`` blocks (a fixed choice for latency work; a
    sensitivity-guided plan file is what accuracy work should use).

    ``variant`` is what "dropped" means for the spec forms (``drop`` = the SPD block); a JSON file
    states its modes itself.
    """
    s = spec.strip()
    if s == "none":
        return SyncPlan.uniform(num_blocks)
    if s == "all":
        return SyncPlan.dropping(num_blocks, range(num_blocks), variant)
    if s.startswith(("last:", "first:")):
        kind, _, k_text = s.partition(":")
        k = _parse_int(k_text, "K", spec)
        if not 0 <= k <= num_blocks:
            raise SyncdropError(f"plan {spec!r}: K must be between 0 and {num_blocks} (the number of blocks)")
        idx = range(num_blocks - k, num_blocks) if kind == "last" else range(k)
        return SyncPlan.dropping(num_blocks, idx, variant)
    if s.startswith("frac:"):
        try:
            f = float(s[len("frac:"):])
        except ValueError:
            raise SyncdropError(f"malformed plan {spec!r}: F must be a number between 0 and 1") from None
        if not 0 <= f <= 1:
            raise SyncdropError(f"plan {spec!r}: F must be between 0 and 1")
        k = round(f * num_blocks)
        return SyncPlan.dropping(num_blocks, range(num_blocks - k, num_blocks), variant)
    if s.startswith("partial:"):
        try:
            p = float(s[len("partial:"):])
        except ValueError:
            raise SyncdropError(f"malformed plan {spec!r}: P must be a number between 0 and 1") from None
        if not 0 <= p <= 1:
            raise SyncdropError(f"plan {spec!r}: P must be between 0 and 1")
        return SyncPlan.partial(num_blocks, p)
    if s.startswith("blocks:"):
        items = [t for t in s[len("blocks:"):].split(",") if t.strip()]
        if not items:
            raise SyncdropError(f"malformed plan {spec!r}: list at least one block index, e.g. blocks:0,3,7")
        return SyncPlan.dropping(num_blocks, [_parse_int(t.strip(), "block index", spec) for t in items], variant)
    if s.endswith(".json") or Path(s).is_file():
        return SyncPlan.load(s, num_blocks)
    raise SyncdropError(f"malformed plan {spec!r}: expected {PLAN_SPEC_HELP}")


def split_plan_list(text: str) -> list[str]:
    """Split a comma-separated list of plan specs; bare integers continue a ``blocks:`` spec, so
    ``"none,blocks:0,3,7,all"`` -> ``["none", "blocks:0,3,7", "all"]``."""
    out: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if tok.lstrip("-").isdigit() and out and out[-1].startswith("blocks:"):
            out[-1] += "," + tok
        else:
            out.append(tok)
    if not out:
        raise SyncdropError(f"--plans {text!r}: list at least one plan")
    return out
