"""The sync plan: which sync mode each transformer block's two sync points use. It is data, not code.

A plan is a list with one :class:`BlockSync` per block, ``{"attn": MODE, "mlp": MODE}``, each MODE a
:class:`~syncdrop.plan.modes.SyncMode` (``full``, ``drop`` and its ablations at the attention point,
``{"partial": p}`` at either). Everything a command needs to know about a plan (which blocks drop,
its payload, whether ranks diverge, whether vLLM serves it) is asked of it here, and it answers by
asking its modes.

On disk a plan is JSON: ``{"format": "syncdrop-plan", "version": 1, "num_blocks": L,
"blocks": [...], "meta": {...}}``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError
from syncdrop.plan.modes import (
    ATTN,
    FULL,
    MLP,
    Compressed,
    Full,
    Partial,
    SyncMode,
    drop_variants,
    mode_named,
    named_modes,
    parse_mode,
)

PLAN_FORMAT = "syncdrop-plan"


def _combination_error(attn: SyncMode, mlp: SyncMode) -> str:
    ok = [n for n in named_modes(ATTN) if mode_named(n).combines_with(mlp)] + ["partial"]
    return f"an MLP sync point in mode {mlp} combines with attn {', '.join(ok)}, not {attn}"


@dataclass(frozen=True)
class SyncPoint:
    """One collective of a forward: block index, ``attn`` or ``mlp`` sync point, and its payload as
    a fraction of a full ``(M, h)`` all-reduce (see :meth:`SyncPlan.sync_points`)."""

    block: int
    where: str
    payload: float


@dataclass(frozen=True)
class BlockSync:
    """The sync modes of one block's attention and MLP sync points (names are accepted:
    ``BlockSync(attn="drop")``)."""

    attn: SyncMode = FULL
    mlp: SyncMode = FULL

    def __post_init__(self) -> None:
        attn = parse_mode(self.attn, ATTN, "attn")
        mlp = parse_mode(self.mlp, MLP, "mlp")
        if not attn.combines_with(mlp):
            raise SyncdropError(_combination_error(attn, mlp))
        object.__setattr__(self, "attn", attn)
        object.__setattr__(self, "mlp", mlp)

    def modes(self) -> tuple[tuple[str, SyncMode], tuple[str, SyncMode]]:
        return (ATTN, self.attn), (MLP, self.mlp)

    @property
    def is_dense(self) -> bool:
        """True when both sync points are ``full`` all-reduces: the stock block."""
        return self.attn == FULL and self.mlp == FULL

    def to_dict(self) -> dict[str, Any]:
        return {"attn": self.attn.to_json(), "mlp": self.mlp.to_json()}


@dataclass
class SyncPlan:
    """Per-block sync decisions for a model with ``len(blocks)`` blocks."""

    blocks: list[BlockSync]
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- builders ----
    @classmethod
    def uniform(cls, num_blocks: int, attn: str | SyncMode = FULL) -> SyncPlan:
        return cls([BlockSync(attn=attn) for _ in range(num_blocks)])

    @classmethod
    def dropping(cls, num_blocks: int, dropped: Iterable[int], variant: str = "drop") -> SyncPlan:
        """Plan that applies ``variant`` to the attention sync of the ``dropped`` blocks."""
        if variant not in drop_variants():
            raise SyncdropError(f"drop variant must be one of {', '.join(drop_variants())}, got {variant!r}")
        mode = mode_named(variant)
        dropped = set(dropped)
        for i in dropped:
            if not 0 <= i < num_blocks:
                raise SyncdropError(f"block index {i} out of range: the model has blocks 0..{num_blocks - 1}")
        return cls([BlockSync(attn=mode if i in dropped else FULL) for i in range(num_blocks)])

    @classmethod
    def partial(cls, num_blocks: int, p: float, scale: bool = True, mask: str = "fixed") -> SyncPlan:
        """Every sync point of every block partial with fraction ``p`` (CAAT-Net)."""
        m = Partial(p, scale, mask)
        return cls([BlockSync(m, m) for _ in range(num_blocks)])

    def compressed(self, wire: str, group: int | None = None) -> SyncPlan:
        """This plan with every kept ``full`` sync point compressed to ``wire`` (:class:`Compressed`) and
        the shared channels of every partial one too; a dropped block's MLP point is its one all-reduce,
        so SPD blocks compress that."""
        mode = Compressed(wire) if group is None else Compressed(wire, group)

        def swap(m: SyncMode) -> SyncMode:
            if isinstance(m, Partial):
                return dataclasses.replace(m, wire=mode.wire, group=mode.group)
            return mode if isinstance(m, Full) else m

        blocks = [BlockSync(b.attn if b.attn.drops else swap(b.attn),
                            swap(b.mlp) if b.attn.combines_with(mode) else b.mlp) for b in self.blocks]
        return SyncPlan(blocks, dict(self.meta))

    def check(self, hidden: int) -> None:
        """Raise :class:`SyncdropError` when a mode cannot run on a model of hidden size ``hidden``
        (:meth:`SyncMode.check`, e.g. a wire group size that does not divide it)."""
        for m in dict.fromkeys(self.modes()):
            m.check(hidden)

    # ---- derived facts ----
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def modes(self) -> Iterable[SyncMode]:
        """Every sync point's mode, block by block, attention then MLP."""
        return (m for b in self.blocks for m in (b.attn, b.mlp))

    @property
    def dropped(self) -> list[int]:
        """Blocks whose attention sync point is removed (any drop variant)."""
        return [i for i, b in enumerate(self.blocks) if b.attn.drops]

    @property
    def changed(self) -> list[int]:
        """Blocks that are not the stock block (a sync point dropped, compressed or partial): the blocks whose
        weights recovery training adapts to the plan."""
        return [i for i, b in enumerate(self.blocks) if not b.is_dense]

    @property
    def is_dense(self) -> bool:
        """True when every sync point is a ``full`` all-reduce (plan ``none``): the stock model, which stock
        vLLM serves without the plugin."""
        return all(b.is_dense for b in self.blocks)

    @property
    def has_partial(self) -> bool:
        """True if any sync point keeps private channels (partial sync; vocab-parallel LM head)."""
        return any(m.private_channels for m in self.modes())

    def vllm_blocker(self) -> str | None:
        """Why vLLM's plugin (one replicated residual stream per token) cannot serve this plan, or
        None when it can: the first sync mode that says why (:meth:`SyncMode.vllm_blocker`)."""
        for m in self.modes():
            why = m.vllm_blocker()
            if why:
                return why
        return None

    def payload_fraction(self, hidden: int) -> list[float]:
        """Per sync point (attention then MLP, block by block, ``2 L`` entries) the payload sent as a
        fraction of a full ``(M, h)`` all-reduce (:meth:`SyncMode.payload`); 0 for a removed sync."""
        return [m.payload(hidden) for m in self.modes()]

    def sync_points(self, hidden: int) -> list[SyncPoint]:
        """The collectives one forward issues on the residual stream, in order (block by block,
        attention then MLP), each with its payload as a fraction of a full ``(M, h)`` all-reduce
        (:meth:`SyncMode.payload`): 1 for ``full``; none at a removed attention sync, whose block's
        MLP point then carries what is left; ``k / h`` for a partial one (``k = 0`` sends nothing and
        is not listed). The vocab-parallel LM head's logits all-gather (:attr:`needs_vocab_gather`) is
        not a sync point and is not listed."""
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
            raise SyncdropError(f"hidden size must be a positive integer, got {hidden!r}")
        out = []
        for i, b in enumerate(self.blocks):
            for where, m in b.modes():
                f = m.payload(hidden)
                if f > 0:
                    out.append(SyncPoint(i, where, f))
        return out

    def point_bytes(self, hidden: int, element_size: int) -> dict[tuple[int, str], int]:
        """``(block, "attn" | "mlp")`` -> bytes one rank hands that sync point per token
        (:meth:`SyncMode.wire_bytes`), for the points of :meth:`sync_points`."""
        modes = {(i, where): m for i, b in enumerate(self.blocks) for where, m in b.modes()}
        return {(p.block, p.where): modes[p.block, p.where].wire_bytes(1, hidden, element_size)
                for p in self.sync_points(hidden)}

    def wire_bytes(self, tokens: int, hidden: int, element_size: int) -> int:
        """Bytes each rank hands to the all-reduces of one forward over ``tokens`` tokens."""
        return sum(m.wire_bytes(tokens, hidden, element_size) for m in self.modes())

    @property
    def collectives_per_forward(self) -> int:
        """How many all-reduces one forward issues on the residual stream: two per block, one fewer
        per removed attention sync; a partial sync counts as one collective unless ``p == 0``, which
        sends nothing (a partial ``0 < p < 0.5 / h`` rounds to ``k = 0`` channels and is counted here
        but sends nothing: use ``len(sync_points(h))`` for such plans). The logits all-gather is not
        counted."""
        return sum(1 for m in self.modes() if m.issues_collective)

    def comm_units(self, hidden: int, element_size: int | None = None) -> float:
        """Residual-stream communication of one forward in full-all-reduce units: the sum of the
        payload fractions of :meth:`sync_points`. With ``element_size`` (bytes of the model's dtype),
        in bytes: each sync point's :meth:`SyncMode.wire_bytes` over a full ``(1, h)`` all-reduce's, so
        a compressed point counts its encoded bytes (int8 in groups of 64 in an fp32 model: 66 / 256)."""
        if element_size is None:
            return float(sum(p.payload for p in self.sync_points(hidden)))
        full = hidden * element_size
        return float(sum(m.wire_bytes(1, hidden, element_size) / full for m in self.modes() if m.issues_collective))

    def codec_units(self, hidden: int) -> float:
        """Payload that one forward encodes and decodes, in full-all-reduce units: the payload fractions of
        the sync points with a wire format (:attr:`SyncMode.codec`: compressed, or partial with a wire); the
        cost model charges it the codec time per byte it fits (:mod:`syncdrop.bench.cost.fit`)."""
        return float(sum(m.payload(hidden) for m in self.modes() if m.issues_collective and m.codec is not None))

    @property
    def ranks_diverge(self) -> bool:
        """True when the residual streams of different ranks can differ somewhere in a forward
        (:attr:`SyncMode.diverges`: ``naive`` and a partial sync with ``p < 1``)."""
        return any(m.diverges for m in self.modes())

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
        partial = [m for m in self.modes() if isinstance(m, Partial)]
        if partial:
            ps = sorted({m.p for m in partial})
            parts.append(f"{len(partial)}/{2 * self.num_blocks} sync points partial "
                         f"(p={','.join(f'{p:g}' for p in ps)})")
        wires = [m for m in self.modes() if isinstance(m, Compressed)]
        if wires:
            parts.append(f"{len(wires)}/{2 * self.num_blocks} sync points compressed "
                         f"({','.join(sorted({str(m) for m in wires}))})")
        return "; ".join(parts) or "none"

    # ---- JSON ----
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
            attn = parse_mode(b.get("attn", "full"), ATTN, f"{source}: blocks[{i}].attn")
            mlp = parse_mode(b.get("mlp", "full"), MLP, f"{source}: blocks[{i}].mlp")
            if not attn.combines_with(mlp):
                raise SyncdropError(f"{source}: blocks[{i}]: {_combination_error(attn, mlp)}")
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
