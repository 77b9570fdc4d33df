"""The runtime, chosen once: executor, device, backend, dtype, communicator and link emulation.

Every command and library entry point builds its models through one :class:`Runtime`
(:func:`choose_runtime` picks it from flags and the environment), so a fix to how a model is
placed, sharded or wired to its peers is made in one place:

* executor: ``distributed`` (one rank per process) when this process was started by torchrun or
  ``--launch`` and ``executor="auto"``; ``simulated`` (all N ranks in this process, exact) otherwise
  or when asked; ``hf`` (transformers' own dense model, the reference);
* device: ``auto`` = ``cuda:LOCAL_RANK`` when every local rank has a GPU of its own (one process:
  ``cuda:0`` when CUDA is available), else ``cpu``; ``cuda`` = the same GPU choice, an error
  without one (ranks share GPUs round-robin when there are fewer GPUs than local ranks, which
  only gloo allows); ``cuda:N`` / ``cpu`` as given;
* backend (distributed only): ``auto`` = NCCL when the device is CUDA and every local rank has its
  own GPU, else gloo; ``nccl`` without a GPU per local rank is an error;
* communicator: :class:`~syncdrop.parallel.comm.SimulatedComm` or
  :class:`~syncdrop.parallel.dist.DistComm`, wrapped in the link emulation when a link is given.

:meth:`Runtime.build` resolves the model, checks TP and plan against it, and returns a
:class:`Built`; switching plans afterwards goes through :meth:`Built.use_plan`, which applies the
checkpoint's plan logic (:func:`for_plan`) exactly as ``--plan`` does at build time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from syncdrop.bench.link import EmulatedLinkComm, Link
from syncdrop.errors import SyncdropError
from syncdrop.parallel.comm import Communicator, SimulatedComm
from syncdrop.parallel.dist import DistContext
from syncdrop.parallel.executor import TPModel
from syncdrop.parallel.sharding import distilled_layouts
from syncdrop.plan import SyncPlan, resolve_plan

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXECUTORS = ("auto", "simulated", "hf")
DEVICES_HELP = "auto | cpu | cuda | cuda:N"
BACKENDS = ("auto", "gloo", "nccl")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SyncdropError(f"must be one of {', '.join(DTYPES)}, got {name!r}", field="dtype")
    return DTYPES[name]


def _parse_device(spec: str) -> torch.device | None:
    """``auto`` -> None; ``cpu``, ``cuda``, ``cuda:N`` -> a device; anything else -> an error."""
    if spec == "auto":
        return None
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SyncdropError(f"must be {DEVICES_HELP}, got {spec!r}", field="device")
    return device


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str, distributed: bool) -> torch.device:
    """The device of this process for ``spec`` (see the module docstring)."""
    from syncdrop.parallel import dist

    device = _parse_device(spec)
    gpus = _cuda_count()
    if device is not None and device.type == "cpu":
        return device
    if device is not None and gpus == 0:
        raise SyncdropError(f"{spec}: no CUDA device is available (torch.cuda.is_available() is False)",
                            field="device")
    if device is not None and device.index is not None:
        if device.index >= gpus:
            raise SyncdropError(f"{spec}: this machine has {gpus} CUDA device(s)", field="device")
        if distributed and dist.local_world_size() > 1:
            raise SyncdropError(f"{spec}: every rank would use the same GPU; use --device cuda "
                                "(rank r takes cuda:LOCAL_RANK)", field="device")
        return device
    want_cuda = device is not None  # "cuda"
    if gpus == 0:
        return torch.device("cpu")
    if not distributed:
        return torch.device("cuda", 0)
    local, local_world = dist.local_rank(), dist.local_world_size()
    if gpus >= local_world:
        return torch.device("cuda", local)
    if want_cuda:  # fewer GPUs than local ranks: share them (gloo only, checked by resolve_backend)
        return torch.device("cuda", local % gpus)
    return torch.device("cpu")


def resolve_backend(spec: str, device: torch.device) -> str:
    """``gloo`` or ``nccl`` for a distributed rank on ``device`` (see the module docstring)."""
    from syncdrop.parallel import dist

    if spec not in BACKENDS:
        raise SyncdropError(f"must be one of {', '.join(BACKENDS)}, got {spec!r}", field="backend")
    own_gpu = device.type == "cuda" and _cuda_count() >= dist.local_world_size()
    if spec == "nccl" and not own_gpu:
        raise SyncdropError(f"nccl needs a CUDA device per local rank; this node has {_cuda_count()} GPU(s) for "
                            f"{dist.local_world_size()} rank(s) and the device is {device}: use --backend gloo",
                            field="backend")
    if spec == "auto":
        return "nccl" if own_gpu else "gloo"
    return spec


@dataclass(frozen=True)
class Runtime:
    """Where and how models run (chosen once by :func:`choose_runtime`)."""

    executor: str  # "simulated" | "distributed" | "hf"
    device: torch.device
    dtype: torch.dtype = torch.float32
    backend: str | None = None  # distributed: "gloo" | "nccl"
    link: Link = field(default_factory=Link)
    exact_reduce: bool = False
    dist_timeout: float = 60.0
    stream: bool = False  # hold one block's weights at a time, read from the checkpoint (TPModel resident_blocks)

    @property
    def distributed(self) -> bool:
        return self.executor == "distributed"

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def start(self) -> DistContext | None:
        """Join the process group (distributed; idempotent), else None."""
        if not self.distributed:
            return None
        from syncdrop.parallel import dist

        return dist.init(self.dist_timeout, self.backend or "gloo", self.device)

    def communicator(self, tp: int) -> Communicator:
        """The communicator of ``tp`` ranks for this runtime, link emulation included."""
        if self.distributed:
            from syncdrop.parallel.dist import DistComm

            ctx = self.start()
            if ctx.world != tp:
                raise SyncdropError(f"{tp} but the job has {ctx.world} ranks; they must match (torchrun "
                                    "--nproc-per-node, or --launch which starts --tp ranks)", field="tp")
            comm: Communicator = DistComm(tp, exact=self.exact_reduce)
        else:
            comm = SimulatedComm(tp)
        return self.emulate_link(comm, self.link) if self.link.active else comm

    def emulate_link(self, comm: Communicator, link: Link) -> EmulatedLinkComm:
        """``comm`` with ``link`` emulated on it; the wait spins when every local rank has a core of its
        own (:func:`~syncdrop.bench.link.ranks_have_own_cores`)."""
        from syncdrop.bench.link import ranks_have_own_cores
        from syncdrop.parallel import dist

        return EmulatedLinkComm(comm, link, spin=ranks_have_own_cores(dist.local_world_size()
                                                                      if self.distributed else 1))

    def local_ranks(self, tp: int) -> list[int]:
        """The ranks this process holds: all of them when simulated, its own when distributed."""
        return [self.start().rank] if self.distributed else list(range(tp))

    def describe(self) -> dict[str, Any]:
        """The runtime as result files record it."""
        return {"executor": self.executor, "device": str(self.device), "backend": self.backend,
                "dtype": self.dtype_name, "link": self.link.to_dict(), "exact_reduce": self.exact_reduce,
                "stream": self.stream}

    def build(self, model_spec: str, tp: int, plan_spec: str | SyncPlan | None = None, drop_variant: str = "drop",
              progress: bool = True) -> Built:
        """Resolve ``model_spec``, check ``tp`` and the plan against it, and build the model.

        ``plan_spec``: a spec string, a :class:`SyncPlan`, or None (the model's own plan, else
        ``none``)."""
        source, plan = prepare(model_spec, tp, plan_spec, drop_variant)
        cfg = source.config
        if self.executor == "hf":
            if tp != 1 or plan.dropped or source.spd is not None:
                raise SyncdropError("hf runs transformers' dense model: use --tp 1 --plan none and a model that is "
                                    "not a `syncdrop distill` directory", field="executor")
            return Built(self, source, HFReference(source, self.dtype, self.device), plan, tp)
        ctx = self.start()
        rss0 = _peak_rss_mb()
        built = Built(self, source, None, plan, tp, ctx)
        built.comm = self.communicator(tp)
        log.info("building %s at TP=%d on %s (%s), plan %s", source.name, tp, self.device, self.executor,
                 plan.summary())
        built.use_plan(plan, progress=progress)
        if ctx is not None:
            from syncdrop.parallel import dist

            dist.check_agreement({"model": source.name, "config": cfg.to_dict(), "plan": plan.to_dict(), "tp": tp,
                                  "runtime": {k: v for k, v in self.describe().items() if k != "device"}}, ctx)
        built.rss_before_load_mb = rss0
        log.info("layout: %s", built.model.layout.describe())
        return built


def choose_runtime(executor: str = "auto", device: str = "auto", backend: str = "auto", dtype: str = "float32",
                   link: Link | None = None, exact_reduce: bool = False, dist_timeout: float = 60.0,
                   stream: bool = False) -> Runtime:
    """Pick the whole runtime from these choices and the environment (see the module docstring)."""
    from syncdrop.parallel import dist

    if executor not in EXECUTORS:
        raise SyncdropError(f"must be one of {', '.join(EXECUTORS)}, got {executor!r}", field="executor")
    if dist_timeout <= 0:
        raise SyncdropError(f"must be positive, got {dist_timeout}", field="dist_timeout")
    torch_dtype = parse_dtype(dtype)
    link = link or Link()
    distributed = executor == "auto" and dist.launched_by_torchrun()
    if backend not in BACKENDS:
        raise SyncdropError(f"must be one of {', '.join(BACKENDS)}, got {backend!r}", field="backend")
    if not distributed and backend != "auto":
        log.info("--backend %s has no effect in a single process", backend)
    dev = resolve_device(device, distributed)
    name = "distributed" if distributed else ("hf" if executor == "hf" else "simulated")
    chosen_backend = resolve_backend(backend, dev) if distributed else None
    return Runtime(name, dev, torch_dtype, chosen_backend, link, exact_reduce, dist_timeout, stream)


@dataclass
class Built:
    """A model built by a :class:`Runtime`, and the means to switch its plan.

    ``source``: the model as resolved (a distilled directory with all its blocks); ``model``: the
    executor for the current ``plan`` (:meth:`use_plan` switches it). In the distributed runtime
    ``dist`` is this rank's context; call :meth:`memory` on every rank (it gathers)."""

    runtime: Runtime
    source: Any  # syncdrop.models.loading.ModelSource
    model: Any  # TPModel | HFReference
    plan: SyncPlan
    tp: int
    dist: DistContext | None = None
    comm: Communicator | None = None
    rss_before_load_mb: float | None = None
    _models: dict = field(default_factory=dict, repr=False)

    @property
    def is_main(self) -> bool:
        """True on the process that prints and writes results (rank 0, or the only process)."""
        return self.dist is None or self.dist.is_main

    def use_plan(self, plan: SyncPlan, progress: bool = False) -> TPModel:
        """The model to run under ``plan``, made current: the same weights when the plan needs no other
        ones; for a ``syncdrop distill`` directory, the distilled blocks that ``plan`` drops and the base
        model's blocks elsewhere (:func:`for_plan`), built once per distinct set and kept."""
        if self.runtime.executor == "hf":
            if plan.dropped or plan.has_partial:
                raise SyncdropError("hf runs the dense model only; use --plan none", field="plan")
            self.plan = plan
            return self.model
        src = for_plan(self.source, plan, warn=self.model is None)
        key = tuple(sorted(src.spd.blocks)) if src.spd is not None else ()
        model = self._models.get(key)
        if model is None:
            from syncdrop.parallel.sharding import ShardLayout

            cfg = src.config
            model = TPModel(cfg, src.reader, ShardLayout.build(cfg, self.tp), self.comm, plan,
                            ranks=self.runtime.local_ranks(self.tp), dtype=self.runtime.dtype,
                            progress=progress and self.is_main, device=self.runtime.device,
                            block_layouts=distilled_layouts(src.spd, cfg) if src.spd is not None else None,
                            resident_blocks=1 if self.runtime.stream else None)
            self._models[key] = model
        model.plan = plan
        self.model, self.plan = model, plan
        return model

    def use_link(self, link: Link) -> None:
        """Emulate ``link`` from now on (an inactive one: no emulation) on the communicator that every
        plan's model shares; the first call wraps it in an :class:`EmulatedLinkComm` (kept from then on:
        later calls only switch its link), so ``syncdrop bench --links`` can interleave links."""
        if not isinstance(self.comm, EmulatedLinkComm):
            self.comm = self.runtime.emulate_link(self.comm, link)
            for model in self._models.values():
                model.comm = self.comm
        self.comm.link = link

    def memory(self) -> dict[str, Any]:
        """Per-rank memory: weights held, peak host RSS (and before loading), CUDA peak allocated and
        reserved (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``; None off CUDA), and
        the size of one full dense copy. A collective in the distributed runtime: every rank calls it."""
        from syncdrop.parallel.device import cuda_memory_mb

        cuda = cuda_memory_mb(self.runtime.device) or {}
        weights = self.model.weight_bytes() if hasattr(self.model, "weight_bytes") else 0
        row = [weights / 2**20, _peak_rss_mb(), self.rss_before_load_mb or 0.0,
               cuda.get("max_allocated_mb", -1.0), cuda.get("max_reserved_mb", -1.0)]
        if self.dist is not None:
            from syncdrop.parallel import dist

            rows = dist.gather_floats(row, self.dist)
        else:
            rows = [row]
        ranks = [{"rank": r, "weights_mb": w, "peak_rss_mb": p, "rss_before_load_mb": b,
                  "cuda_max_allocated_mb": None if a < 0 else a, "cuda_max_reserved_mb": None if v < 0 else v}
                 for r, (w, p, b, a, v) in enumerate(rows)]
        return {"full_copy_mb": full_copy_bytes(self.source.config, self.runtime.dtype) / 2**20,
                "device": str(self.runtime.device), "ranks": ranks}


class HFReference:
    """transformers' own model behind the :class:`~syncdrop.eval.perplexity.CausalLM` interface
    (dense, unsharded, on ``device``): the reference every executor is checked against."""

    def __init__(self, source, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        import os

        from transformers import AutoModelForCausalLM

        kw: dict[str, Any] = {"dtype": dtype}
        if source.kind == "gguf":
            kw["gguf_file"] = os.path.basename(source.path)
            path = os.path.dirname(source.path)
        else:
            path = source.path
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, **kw).to(self.device).eval()

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model(input_ids=ids.to(self.device)).last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def _peak_rss_mb() -> float:
    from syncdrop.parallel.dist import peak_rss_mb

    return peak_rss_mb()


def full_copy_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of one full dense copy of the model's weights in ``dtype``."""
    from syncdrop.models.config import model_names
    from syncdrop.models.loading import expected_shape

    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(expected_shape(n, cfg)) for n in model_names(cfg)) * elem


def prepare(model_spec: str, tp: int, plan_spec: str | SyncPlan | None = None, drop_variant: str = "drop",
            serving: bool = False) -> tuple[Any, SyncPlan]:
    """Resolve ``model_spec`` (the checkpoint's header only: no weights are read) and check ``tp`` and
    the plan against it: what every command checks before it builds, launches ranks or exports.
    ``plan_spec`` as :func:`~syncdrop.plan.resolve_plan` takes it (None: the model's own plan, the one a
    ``syncdrop distill`` directory was made for or a ``syncdrop train`` export was trained with, else
    ``none``); ``serving``: vLLM's plugin must be able to serve the plan. Returns (source, plan)."""
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel.sharding import check_tp

    source = resolve_model(model_spec)
    check_tp(source.config, tp)
    check_checkpoint_tp(source, tp)
    return source, model_plan(source, plan_spec, tp, drop_variant, serving)


def model_plan(source, plan_spec: str | SyncPlan | None, tp: int | None = None, drop_variant: str = "drop",
               serving: bool = False, what: str = "plan") -> SyncPlan:
    """:func:`~syncdrop.plan.resolve_plan` for ``source``: its block count and its own plan."""
    return resolve_plan(plan_spec, source.config.num_layers, tp=tp, own=source.own_plan(), variant=drop_variant,
                        serving=serving, what=what, hidden=source.config.hidden_size)


def for_plan(source, plan: SyncPlan, warn: bool = True):
    """The model to run under ``plan``: ``source`` itself, except that the distilled blocks of a
    ``syncdrop distill`` directory that ``plan`` runs in another form than they were trained for fall back
    to the base model's weights and layout (:meth:`SPDCheckpoint.blocks_for`: an SPD block where the plan
    keeps its attention sync, a block trained with compressed sync points where the plan's modes differ).
    With plain sync points the base block is the exact one. (A directory is therefore also usable as a bank.)"""
    if source.spd is None:
        return source
    runs = source.spd.blocks_for(plan)
    kept = sorted(set(source.spd.blocks) - set(runs))
    if not kept:
        return source
    from syncdrop.models.distilled import OverlayCheckpoint

    if warn:
        log.warning("blocks %s of %s were distilled for another form of their block than the plan runs (SPD, or "
                    "other sync modes), so they run with the base model's weights", kept, source.spec)
    ckpt = dataclasses.replace(source.spd, blocks=runs)
    return dataclasses.replace(source, reader=OverlayCheckpoint(source.reader.base, ckpt), spd=ckpt)


def check_checkpoint_tp(source, tp: int) -> None:
    """A distilled directory only runs at the TP degree its blocks were trained for; a model trained
    with partial sync is only the trained model at its training degree (warning)."""
    if source.spd is not None and source.spd.tp != tp:
        raise SyncdropError(f"{tp}: model {source.spec} was distilled for --tp {source.spd.tp} "
                            "(its SPD blocks are trained for that split of heads over ranks)", field="tp")
    t = source.trained
    if t is not None and t.plan.has_partial and t.tp is not None and t.tp != tp:
        log.warning("model %s was trained with partial sync at tp=%d; at --tp %d its private channels are split "
                    "differently, so it is not the trained model", source.spec, t.tp, tp)


def build(model_spec: str, tp: int, plan_spec: str | SyncPlan | None = None, dtype: str = "float32",
          executor: str = "auto", drop_variant: str = "drop", progress: bool = True, dist_timeout: float = 60.0,
          exact_reduce: bool = False, link: Link | None = None, device: str = "auto",
          backend: str = "auto") -> Built:
    """``choose_runtime(...).build(...)`` in one call (the library's shortcut)."""
    rt = choose_runtime(executor, device, backend, dtype, link, exact_reduce, dist_timeout)
    return rt.build(model_spec, tp, plan_spec, drop_variant, progress)
