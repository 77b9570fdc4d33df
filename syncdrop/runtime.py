"""Building a ready-to-run model from CLI-level choices (model spec, TP degree, plan, dtype)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from syncdrop.errors import SyncdropError
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


def build(model_spec: str, tp: int, plan_spec: str, dtype: str = "float32", executor: str = "simulated",
          drop_variant: str = "drop", progress: bool = True) -> Built:
    """Resolve the model, validate TP and plan, and build the executor."""
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel.sharding import check_tp

    source = resolve_model(model_spec)
    cfg = source.config
    check_tp(cfg, tp)
    plan = parse_plan(plan_spec, cfg.num_layers, drop_variant)
    torch_dtype = parse_dtype(dtype)
    if executor == "hf":
        if tp != 1 or plan.dropped:
            raise SyncdropError("--executor hf runs transformers' dense model: use --tp 1 --plan none")
        return Built(source, HFReference(source, torch_dtype), plan)
    if executor != "simulated":
        raise SyncdropError(f"--executor must be simulated or hf, got {executor!r}")
    log.info("building %s at TP=%d, plan %s", source.name, tp, plan.summary())
    model = simulated_model(cfg, source.reader.get, tp, plan, torch_dtype, progress=progress)
    log.info("layout: %s", model.layout.describe())
    return Built(source, model, plan)
