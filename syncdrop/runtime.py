"""Building a ready-to-run model from CLI-level choices (model spec, TP degree, plan, dtype)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from syncdrop.bench.link import EmulatedLinkComm, Link
from syncdrop.errors import SyncdropError
from syncdrop.parallel.dist import DistContext
from syncdrop.parallel.executor import TPModel, simulated_model
from syncdrop.plan import SyncPlan, parse_plan

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SyncdropError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


class HFReference:
    """transformers' own model behind the :class:`~syncdrop.eval.perplexity.CausalLM` interface
    (dense, unsharded): the reference every executor is checked against."""

    def __init__(self, source, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        kw = {"dtype": dtype}
        if source.kind == "gguf":
            import os

            kw["gguf_file"] = os.path.basename(source.path)
            path = os.path.dirname(source.path)
        else:
            path = source.path
        self.model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, **kw).eval()

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model(input_ids=ids).last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


@dataclass
class Built:
    source: object  # syncdrop.models.loading.ModelSource
    model: TPModel | HFReference
    plan: SyncPlan
    dist: DistContext | None = None  # set in the distributed runtime
    memory: dict | None = None  # distributed runtime: per-rank weight bytes and peak RSS

    @property
    def is_main(self) -> bool:
        """True on the process that prints and writes results (rank 0, or the only process)."""
        return self.dist is None or self.dist.is_main


def full_copy_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of one full dense copy of the model's weights in ``dtype``."""
    from syncdrop.models.config import model_names
    from syncdrop.models.loading import expected_shape

    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(expected_shape(n, cfg)) for n in model_names(cfg)) * elem


EXECUTORS = ("auto", "simulated", "hf")


def resolve_plan(source, plan_spec: str | None, drop_variant: str = "drop") -> SyncPlan:
    """The plan to run: ``plan_spec`` parsed, or (``None``) the model's own plan (the one a
    ``syncdrop distill`` directory was made for or a ``syncdrop train`` export was trained with),
    else ``none``."""
    cfg = source.config
    if plan_spec is None:
        own = source.own_plan()
        return own if own is not None else SyncPlan.uniform(cfg.num_layers)
    return parse_plan(plan_spec, cfg.num_layers, drop_variant)


def for_plan(source, plan: SyncPlan):
    """The model to run under ``plan``: ``source`` itself, except that the distilled blocks of a
    ``syncdrop distill`` directory whose sync ``plan`` keeps fall back to the base model's weights
    and layout. Distilled weights are trained for the SPD form of their block only; with the sync
    kept, the base block is the exact one. (A directory is therefore also usable as a bank.)"""
    if source.spd is None:
        return source
    kept = sorted(set(source.spd.blocks) - set(plan.dropped))
    if not kept:
        return source
    import dataclasses

    from syncdrop.spd.checkpoint import OverlayCheckpoint

    log.warning("blocks %s of %s were distilled as SPD blocks; the plan keeps their sync, so they run with "
                "the base model's weights", kept, source.spec)
    ckpt = dataclasses.replace(source.spd, blocks=source.spd.blocks_for(plan))
    return dataclasses.replace(source, reader=OverlayCheckpoint(source.reader.base, ckpt), spd=ckpt)


def check_checkpoint_tp(source, tp: int) -> None:
    """A distilled directory only runs at the TP degree its blocks were trained for; a model trained
    with partial sync is only the trained model at its training degree (warning)."""
    if source.spd is not None and source.spd.tp != tp:
        raise SyncdropError(f"--tp {tp}: model {source.spec} was distilled for --tp {source.spd.tp} "
                            "(its SPD blocks are trained for that split of heads over ranks)")
    t = source.trained
    if t is not None and t.plan.has_partial and t.tp is not None and t.tp != tp:
        log.warning("model %s was trained with partial sync at tp=%d; at --tp %d its private channels are split "
                    "differently, so it is not the trained model", source.spec, t.tp, tp)


def build(model_spec: str, tp: int, plan_spec: str | None, dtype: str = "float32", executor: str = "auto",
          drop_variant: str = "drop", progress: bool = True, dist_timeout: float = 60.0,
          exact_reduce: bool = False, link: Link | None = None) -> Built:
    """Resolve the model, validate TP and plan, and build the executor.

    ``auto``: the distributed runtime when this process was started by torchrun / ``--launch``
    (one rank per process, each reading only its own slices), else the simulated executor.
    ``link``: wrap the communicator in a slow-link emulation.
    """
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel import dist
    from syncdrop.parallel.sharding import ShardLayout, check_tp

    source = resolve_model(model_spec)
    cfg = source.config
    check_tp(cfg, tp)
    check_checkpoint_tp(source, tp)
    plan = resolve_plan(source, plan_spec, drop_variant)
    source = for_plan(source, plan)
    block_layouts = source.spd.layouts(cfg) if source.spd is not None else None
    torch_dtype = parse_dtype(dtype)
    if executor not in EXECUTORS:
        raise SyncdropError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "hf":
        if tp != 1 or plan.dropped or source.spd is not None:
            raise SyncdropError("--executor hf runs transformers' dense model: use --tp 1 --plan none "
                                "and a model that is not a `syncdrop distill` directory")
        return Built(source, HFReference(source, torch_dtype), plan)
    if executor == "auto" and dist.launched_by_torchrun():
        ctx = dist.init(dist_timeout)
        if ctx.world != tp:
            raise SyncdropError(f"--tp {tp} but the job has {ctx.world} ranks; they must match "
                                "(torchrun --nproc-per-node, or --launch which starts --tp ranks)")
        rss0 = dist.peak_rss_mb()
        comm = dist.DistComm(tp, exact=exact_reduce)
        comm = EmulatedLinkComm(comm, link) if link is not None and link.active else comm
        model = TPModel(cfg, source.reader, ShardLayout.build(cfg, tp), comm, plan, ranks=[ctx.rank], dtype=torch_dtype,
                        progress=progress and ctx.is_main, device=ctx.device, block_layouts=block_layouts)
        dist.check_agreement({"model": source.name, "config": cfg.to_dict(), "plan": plan.to_dict(), "tp": tp,
                              "dtype": dtype, "exact_reduce": exact_reduce}, ctx)
        rows = dist.gather_floats([model.weight_bytes() / 2**20, dist.peak_rss_mb(), rss0], ctx)
        memory = {"full_copy_mb": full_copy_bytes(cfg, torch_dtype) / 2**20,
                  "ranks": [{"rank": r, "weights_mb": w, "peak_rss_mb": p, "rss_before_load_mb": b}
                            for r, (w, p, b) in enumerate(rows)]}
        return Built(source, model, plan, ctx, memory)
    log.info("building %s at TP=%d, plan %s", source.name, tp, plan.summary())
    model = simulated_model(cfg, source.reader, tp, plan, torch_dtype, progress=progress, block_layouts=block_layouts)
    if link is not None and link.active:
        model.comm = EmulatedLinkComm(model.comm, link)
    log.info("layout: %s", model.layout.describe())
    return Built(source, model, plan)
