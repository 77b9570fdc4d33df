"""Tensor-parallel model execution over R local ranks with a per-block sync plan.

:class:`TPModel` holds the replicated parts (embeddings, final norm, LM head) and each block's
per-rank weights, and runs :func:`syncdrop.parallel.block.block_forward` block by block. With a
:class:`SimulatedComm` and all N ranks local it is the exact single-process simulation used for
accuracy work; the distributed runtime uses the same class with one local rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig
from syncdrop.models.rope import inv_frequencies, rope_tables
from syncdrop.parallel.block import ForwardContext, LayerKV, block_forward, norm
from syncdrop.parallel.block_store import BlockStore
from syncdrop.parallel.comm import Communicator, SimulatedComm
from syncdrop.parallel.sharding import ShardLayout, _even_split
from syncdrop.parallel.weights import BlockWeights, TensorSource, block_weights, local_geometry
from syncdrop.plan import SyncPlan


class TPModel:
    """A decoder-only LM split over ``layout.tp`` ranks, of which ``ranks`` are held here.

    ``weights``: a checkpoint reader (``get``, optionally ``get_rows``/``get_cols`` so that only the
    local ranks' slices are read), a ``{name: tensor}`` dict, or a ``name -> tensor`` callable.

    ``block_layouts``: per-block exceptions to ``layout`` (head grouping reassigns heads and MLP
    channels to ranks block by block); each block gets its own :class:`LocalGeometry` (``geos[i]``),
    padded to the largest rank of its layout. ``geo`` is the geometry of the shared ``layout``.

    ``device``: where weights, caches and activations live. Weights are read, sharded and cast to
    ``dtype`` where the source holds them (the host for checkpoints) and then moved, so what crosses to
    the device is already in the model dtype. Token ids may come from anywhere (they are moved).

    ``resident_blocks``: None (default) builds every block now; ``k`` streams them from ``weights``,
    holding at most ``k`` (:class:`~syncdrop.parallel.block_store.BlockStore`); :meth:`layerwise_hidden_states`
    then runs a batch of inputs block by block, reading each block once.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: object,
        layout: ShardLayout,
        comm: Communicator,
        plan: SyncPlan | None = None,
        ranks: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        progress: bool = False,
        device: torch.device | str = "cpu",
        block_layouts: Mapping[int, ShardLayout] | None = None,
        resident_blocks: int | None = None,
    ) -> None:
        self.cfg, self.layout, self.comm, self.dtype = cfg, layout, comm, dtype
        self.device = torch.device(device)
        src = TensorSource(weights)

        target = self.device

        def get(name: str) -> torch.Tensor:  # cast on the host, then move: the copy is in the model dtype
            return src.read(name, dtype).to(target)

        local = list(ranks if ranks is not None else range(layout.tp))
        block_layouts = dict(block_layouts or {})
        for i, lay in block_layouts.items():
            if not 0 <= i < cfg.num_layers or lay.tp != layout.tp:
                raise SyncdropError(f"block layout for block {i}: needs 0 <= block < {cfg.num_layers} and "
                                    f"tp {layout.tp}, got tp {lay.tp}")
        self.layouts = [block_layouts.get(i, layout) for i in range(cfg.num_layers)]
        self.geo = local_geometry(cfg, layout, local)
        geos = {id(lay): local_geometry(cfg, lay, local) for lay in block_layouts.values()}
        self.geos = [geos.get(id(lay), self.geo) for lay in self.layouts]  # moved with the weights below
        self.plan = plan or SyncPlan.uniform(cfg.num_layers)
        self.pos_embed = get("pos_embed") if cfg.family == "opt" else None
        self.final_norm_w = get("final_norm.weight")
        self.final_norm_b = get("final_norm.bias") if cfg.norm == "layer" else None
        self.inv_freq = inv_frequencies(cfg).to(self.device) if cfg.uses_rope else None
        host_geos = list(self.geos)  # the slices are read and cast where the source holds them, then moved

        # a streaming model unmaps the checkpoint after each read: its pages would otherwise stay resident
        release = getattr(weights, "release", None) if resident_blocks is not None else None

        layouts = self.layouts  # not ``self``: the store must not hold its model in a cycle
        self._head_name = "embed" if cfg.tie_embeddings else "lm_head"

        def read(name: str) -> torch.Tensor:  # a replicated tensor of a streaming model, read when wanted
            t = get(name)
            if release is not None:
                release()
            return t

        self._read_replicated = read
        # the token embedding and the LM head: held here, or (streaming) in the block store under its budget
        self._replicated: dict[str, torch.Tensor] = {}
        if resident_blocks is None:
            self._replicated = {n: get(n) for n in dict.fromkeys(("embed", self._head_name))}

        def build(i: int) -> BlockWeights:  # (a cycle frees the weights only at a garbage collection, late)
            w = block_weights(src, cfg, host_geos[i], layouts[i], i, dtype).to(target)
            if release is not None:
                release()
            return w

        self.blocks = BlockStore(build, cfg.num_layers, resident_blocks, progress)
        self.geos = [g.to(self.device) for g in self.geos]
        self.geo = self.geo.to(self.device)

    @property
    def embed(self) -> torch.Tensor:
        """The token embedding ``(V, h)``, replicated (with streamed blocks: read when asked for, see
        :meth:`~syncdrop.parallel.block_store.BlockStore.replicated`)."""
        return self._replicated_tensor("embed")

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head ``(V, h)`` (the embedding itself when tied), replicated."""
        return self._replicated_tensor(self._head_name)

    def _replicated_tensor(self, name: str) -> torch.Tensor:
        if name in self._replicated:
            return self._replicated[name]
        read = self._read_replicated
        return self.blocks.replicated(name, lambda: read(name))

    @property
    def plan(self) -> SyncPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: SyncPlan) -> None:
        if plan.num_blocks != self.cfg.num_layers:
            raise SyncdropError(f"plan has {plan.num_blocks} blocks but the model has {self.cfg.num_layers}")
        self._plan = plan

    def context(self, batch: int, seq: int, start: int = 0) -> ForwardContext:
        """The :class:`ForwardContext` (batch geometry, RoPE tables) for ``batch`` sequences of ``seq``
        tokens at positions ``start..start+seq-1``; what :meth:`run_blocks` takes."""
        end = start + seq
        if self.cfg.sliding_window is not None and end > self.cfg.sliding_window:
            raise SyncdropError(
                f"sequence length {end} exceeds the model's sliding window {self.cfg.sliding_window}, "
                "which syncdrop does not implement; use shorter sequences"
            )
        if self.cfg.family == "opt" and end > self.cfg.max_positions:
            raise SyncdropError(f"sequence length {end} exceeds the model's {self.cfg.max_positions} positions")
        cos = sin = None
        if self.inv_freq is not None:
            cos, sin = rope_tables(self.inv_freq, torch.arange(start, end, device=self.device), self.dtype)
        return ForwardContext(batch, seq, cos, sin, start)

    def new_cache(self, batch: int, max_len: int) -> list[LayerKV]:
        """Empty KV cache for ``batch`` sequences of up to ``max_len`` tokens (all blocks, local ranks)."""
        def kv(g) -> LayerKV:
            shape = (batch, g.r * g.kv, max_len, g.head_dim)
            return LayerKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))

        return [kv(g) for g in self.geos]

    def embed_tokens(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Input of block 0 for token ids ``(B, S)`` at positions ``start..``: ``(1, B*S, h)``,
        replicated on every rank (token embeddings, plus learned positions for OPT)."""
        B, S = ids.shape
        ids = ids.to(self.device)
        x = self.embed[ids]  # (B, S, h)
        if self.pos_embed is not None:
            x = x + self.pos_embed[torch.arange(start, start + S, device=self.device) + self.cfg.pos_offset]
        return x.reshape(1, B * S, -1)

    @torch.inference_mode()
    def run_blocks(
        self, x: torch.Tensor, start_block: int, ctx: ForwardContext, cache: list[LayerKV] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`forward_blocks` under ``torch.inference_mode`` (what evaluation and serving use)."""
        return self.forward_blocks(x, start_block, ctx, cache, record)

    def forward_blocks(
        self, x: torch.Tensor, start_block: int, ctx: ForwardContext, cache: list[LayerKV] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run blocks ``start_block..L-1`` under ``self.plan`` from the residual ``x`` entering block
        ``start_block`` (``(1 or R, M, h)``, rank axis first); return rank 0's final-normed hidden
        states ``(B, S, h)``. ``cache``: the KV cache of *all* blocks (indexed by block number).
        ``record``: if given, the residual entering each block run is appended to it (what the
        sensitivity profiler caches so that later runs can start mid-model). Differentiable (training
        builds a model from parameters that require grad and calls this directly)."""
        if not 0 <= start_block <= self.cfg.num_layers:
            raise ValueError(f"start_block {start_block} outside 0..{self.cfg.num_layers}")
        for i in range(start_block, self.cfg.num_layers):
            if record is not None:
                record.append(x)
            x = block_forward(x, self.blocks[i], self.geos[i], self.cfg, self.comm, ctx, self.plan.blocks[i],
                              cache[i] if cache else None)
        return self._final(x, ctx)

    def _final(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The residual leaving the last block ``(1 or R, M, h)`` -> final-normed hidden states."""
        if self.plan.has_partial:  # every local rank's own stream, for the vocab-parallel LM head
            x = norm(x, self.final_norm_w, self.final_norm_b, self.cfg).expand(self.geo.r, -1, -1)  # (R, M, h)
            return x.transpose(0, 1).reshape(ctx.batch, ctx.seq, -1)  # (B, S, R*h)
        x = norm(x[0], self.final_norm_w, self.final_norm_b, self.cfg)  # rank 0's stream, (M, h)
        return x.view(ctx.batch, ctx.seq, -1)

    @torch.inference_mode()
    def layerwise_hidden_states(self, batches: list[torch.Tensor], progress: bool = False) -> list[torch.Tensor]:
        """:meth:`hidden_states` of each token-id batch ``(B, S)`` of ``batches``, computed block by block:
        every batch through block ``i`` before block ``i + 1``. Each block is read once and the
        activations of all batches are held (``sum B * S * h`` values, on the device) instead of all
        blocks: what a model with streamed blocks (``resident_blocks``) evaluates with. The same block
        calls on the same inputs as :meth:`hidden_states`, so the same results, bit for bit."""
        ctxs = [self.context(*ids.shape) for ids in batches]
        xs = [self.embed_tokens(ids) for ids in batches]  # each (1, B*S, h)
        layers = range(self.cfg.num_layers)
        if progress:
            from syncdrop.progress import progress_bar

            layers = progress_bar(layers, desc="blocks", unit="block", leave=False)
        for i in layers:
            w, geo, sync = self.blocks[i], self.geos[i], self.plan.blocks[i]
            xs = [block_forward(x, w, geo, self.cfg, self.comm, c, sync) for x, c in zip(xs, ctxs, strict=True)]
        return [self._final(x, c) for x, c in zip(xs, ctxs, strict=True)]

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor, cache: list[LayerKV] | None = None, start: int = 0) -> torch.Tensor:
        """Final-normed hidden states ``(B, S, h)`` as rank 0 sees them, for token ids ``(B, S)``.

        With ``cache`` (from :meth:`new_cache`) the tokens are positions ``start..start+S-1`` and
        their keys/values are appended; without it, ``start`` must be 0.
        """
        B, S = ids.shape
        if cache is None and start:
            raise ValueError("start > 0 needs a KV cache")
        if cache is not None and start + S > cache[0].k.shape[2]:
            raise SyncdropError(f"KV cache holds {cache[0].k.shape[2]} positions, {start + S} requested")
        ctx = self.context(B, S, start)
        return self.run_blocks(self.embed_tokens(ids, start), 0, ctx, cache)

    def weight_bytes(self) -> int:
        """Bytes of weights held by this process now (all local ranks, padding included; with streamed
        blocks, those in memory)."""
        ts = [*self._replicated.values(), *self.blocks.held_replicated().values(), self.final_norm_w,
              *(t for b in self.blocks.held() for t in b.tensors())]
        ts += [t for t in (self.pos_embed, self.final_norm_b) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., h)`` -> ``(..., V)`` with the (replicated) LM head.

        Plans with partial sync: ``hidden`` is ``(..., R*h)``, the local ranks' own final-normed
        streams side by side (:meth:`run_blocks`), and the head is vocab-parallel: rank r computes
        the logits of its vocabulary slice (:func:`vocab_slices`) from its own stream; the slices
        are concatenated in rank order by the communicator's ``all_gather_last``.
        """
        if not self.plan.has_partial:
            return hidden @ self.lm_head.t()
        h = self.cfg.hidden_size
        parts = hidden.unflatten(-1, (self.geo.r, h))  # (..., R, h)
        slices = vocab_slices(self.cfg.vocab_size, self.layout.tp)
        # a slice, not a range index: indexing with a range would copy the rows on every call
        local = [parts[..., j, :] @ self.lm_head[slices[r].start:slices[r].stop].t()
                 for j, r in enumerate(self.geo.ranks)]
        return self.comm.all_gather_last(torch.cat(local, dim=-1), [len(s) for s in slices])  # (..., V)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, S, V)``."""
        with torch.inference_mode():
            return self.logits(self.hidden_states(ids))


def vocab_slices(vocab: int, tp: int) -> list[range]:
    """Contiguous near-equal vocabulary ranges of the vocab-parallel LM head, one per rank (the
    sharding rule's even split)."""
    return _even_split(vocab, tp)


def simulated_model(
    cfg: ModelConfig, weights: object, tp: int, plan: SyncPlan | None = None,
    dtype: torch.dtype = torch.float32, layout: ShardLayout | None = None, progress: bool = False,
    block_layouts: Mapping[int, ShardLayout] | None = None, device: torch.device | str = "cpu",
    comm: Communicator | None = None, resident_blocks: int | None = None,
) -> TPModel:
    """All ``tp`` ranks in this process (exact simulation) on ``device``; ``comm``: a
    :class:`SimulatedComm` of ``tp`` ranks, possibly wrapped (default: a plain one); ``resident_blocks``:
    stream the blocks, holding at most that many (:class:`TPModel`)."""
    layout = layout or ShardLayout.build(cfg, tp)
    return TPModel(cfg, weights, layout, comm or SimulatedComm(tp), plan, dtype=dtype, progress=progress,
                   block_layouts=block_layouts, device=device, resident_blocks=resident_blocks)
