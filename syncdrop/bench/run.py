"""``syncdrop bench`` as a library call: :func:`run_bench` measures the plans of a model and returns the
result documents in memory, one per link (exactly what ``syncdrop bench --json`` writes), starting the
ranks itself when it has to.

Where it measures (``engine="syncdrop"``, syncdrop's runtime):

* ``tp == 1``: in this process.
* this process is already a rank (torchrun, ``syncdrop bench --launch``): in this process; every rank
  calls :func:`run_bench`, rank 0 gets the documents and the other ranks None.
* ``tp > 1`` from a single process (``syncdrop auto``, a script): ``tp`` ranks started here by
  :func:`syncdrop.parallel.launch.launch`, each running ``python -m syncdrop.bench.run JOB_DIR``.
  ``JOB_DIR`` is a temporary directory that :func:`run_bench` creates and removes: the settings go in
  as ``job.json``; rank 0 writes its documents to ``result.json`` (atomically), read once after every
  rank has exited 0; a rank that fails leaves its one-line error in ``rank<R>.error.json``.

A rank that fails or dies makes :func:`run_bench` raise, within bounded time: the collective timeout
(``dist_timeout``) ends the other ranks' waits, and the launcher stops any rank still running
``min(dist_timeout, 30)`` s after the first failure. A usage error on rank 0 comes back as the same
:class:`SyncdropError`; anything else as :class:`~syncdrop.parallel.dist.RankFailure` naming how each
failed rank ended and the error each one left.

``engine="vllm"``: vLLM's own ranks in the vLLM interpreter (:func:`syncdrop.serve.vllm_bench.vllm_bench`),
whose job returns its result through the one result file of :func:`syncdrop.serve.engine.run_job`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from syncdrop.bench.ring import Link
from syncdrop.errors import SyncdropError

log = logging.getLogger(__name__)

ENGINES = ("syncdrop", "vllm")
LAUNCH_GRACE_S = 30.0  # at most this long between a rank's failure and the launcher stopping the others


@dataclass(frozen=True)
class BenchSettings:
    """What to measure and where (the ``syncdrop bench`` flags of the same names).

    ``link``: the emulated link of every collective; ``links``: ``((label, link), ...)`` interleaved in one
    run instead (one result document each, in this order; ``link`` must then be inactive). ``plans``:
    plan specs (``none``, ``all``, a plan file...; ``model`` = the plan of a distilled ``model``)."""

    model: str = "smollm2"
    tp: int = 1
    plans: tuple[str, ...] = ("none", "all")
    prompt_len: int = 256
    batch: int = 1
    decode_tokens: int = 16
    reps: int = 5
    max_reps: int | None = None
    target_ci: float = 0.03
    warmup: int = 1
    threads: int | None = None
    link: Link = field(default_factory=Link)
    links: tuple[tuple[str, Link], ...] | None = None
    dataset: str = "auto"
    data_dir: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    backend: str = "auto"
    executor: str = "auto"
    exact_reduce: bool = False
    dist_timeout: float = 60.0
    drop_variant: str = "drop"
    engine: str = "syncdrop"
    stock: bool = False  # vllm: unmodified vLLM on the original architecture (plan none only)
    work_dir: str = "runs/vllm_bench"  # vllm: the served export and the engine log

    def conditions(self) -> list[tuple[str | None, Link]]:
        """The links measured, in the order of the result documents: ``links``, else ``[(None, link)]``."""
        return [(None, self.link)] if self.links is None else list(self.links)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["link"] = self.link.to_dict()
        d["links"] = None if self.links is None else [[label, lk.to_dict()] for label, lk in self.links]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchSettings:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["plans"] = tuple(kw.get("plans", ()))
        kw["link"] = Link.from_dict(kw.get("link"))
        if kw.get("links") is not None:
            kw["links"] = tuple((label, Link.from_dict(lk)) for label, lk in kw["links"])
        return cls(**kw)

    def check(self) -> None:
        """Refuse what every rank would refuse, before any weights load (the model's header is read)."""
        for name in ("prompt_len", "decode_tokens", "reps", "batch", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SyncdropError(f"must be at least 1, got {value}", field=name)
        if self.warmup < 0:
            raise SyncdropError(f"must be at least 0, got {self.warmup}", field="warmup")
        if not self.target_ci > 0:
            raise SyncdropError(f"must be positive, got {self.target_ci}", field="target_ci")
        if self.max_reps is not None and self.max_reps < self.reps:
            raise SyncdropError(f"must be at least reps ({self.reps}), got {self.max_reps}", field="max_reps")
        if self.engine not in ENGINES:
            raise SyncdropError(f"must be one of {', '.join(ENGINES)}, got {self.engine!r}", field="engine")
        if not self.plans:
            raise SyncdropError("list at least one plan", field="plans")
        if self.links is not None:
            if self.engine == "vllm":
                raise SyncdropError("--links interleaves links in syncdrop's runtime: with --engine vllm, run one "
                                    "bench per link (--link-bandwidth/--link-latency)")
            if not self.links:
                raise SyncdropError("list at least one link", field="links")
            if self.link.active:
                raise SyncdropError("--links lists every link to interleave: drop --link-bandwidth/--link-latency "
                                    "(or add that link to --links)")
        if self.engine == "vllm":
            if self.batch != 1 or self.executor != "auto":
                raise SyncdropError("--engine vllm measures batch 1 in vLLM's own runtime: drop --batch, --launch "
                                    "and --executor")
            if "model" in self.plans:
                raise SyncdropError("--engine vllm times plan specs (weights do not change latency): list them, "
                                    "not `model`")
        elif self.executor == "hf":
            raise SyncdropError("bench runs syncdrop's executors: use --executor auto")
        from syncdrop.models.loading import resolve_model

        cfg = resolve_model(self.model).config  # the header only
        for _, lk in self.conditions():
            check_link(cfg, lk, self.dtype, self.batch * self.prompt_len, self.tp, self.dist_timeout)

    def check_plans(self) -> None:
        """Every plan spec resolves against the model (a plan file is read; ``model``: its own plan)."""
        from syncdrop.runtime import model_plan, prepare

        source, _ = prepare(self.model, self.tp, None, self.drop_variant)
        for spec in self.plans:
            model_plan(source, spec, self.tp, self.drop_variant, what="plans")


def check_link(cfg, link: Link, dtype: str, tokens: int, tp: int, timeout_s: float) -> None:
    """The prefill all-reduce (``tokens`` x hidden in ``dtype``) must be emulated on ``link`` in less than
    the collective timeout ``timeout_s`` (a longer wait looks like a dead rank)."""
    import torch

    from syncdrop.bench.ring import check_within_timeout
    from syncdrop.runtime import parse_dtype

    elem = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    check_within_timeout(link, tokens * cfg.hidden_size * elem, tp, timeout_s)


def run_bench(s: BenchSettings, progress: bool = False) -> list[dict[str, Any]] | None:
    """Measure ``s`` (see the module docstring); the result documents, one per link of
    :meth:`BenchSettings.conditions` (``settings``, ``provenance``, ``memory``, ``allreduce``,
    ``sync_points``, ``plans``...), or None on a rank other than 0 of a job this process is part of."""
    s.check()
    if s.engine == "vllm":
        return [_measure_vllm(s)]
    from syncdrop.parallel import dist

    if s.tp == 1 or dist.launched_by_torchrun():
        return _measure(s, progress)
    s.check_plans()
    return _launch_ranks(s, progress)


def _measure(s: BenchSettings, progress: bool) -> list[dict[str, Any]] | None:
    """Build the model once and time every plan on every link, in this process (one rank of a job, or
    the only process); rank 0's documents, None on the other ranks."""
    import torch

    from syncdrop.bench.latency import latency_bench
    from syncdrop.eval.data import prompt_tokens
    from syncdrop.io_utils import provenance
    from syncdrop.parallel import dist
    from syncdrop.parallel.device import pin_cpu_threads
    from syncdrop.runtime import choose_runtime, model_plan

    launched = dist.launched_by_torchrun()
    pinned = pin_cpu_threads(s.threads, dist.local_rank() if launched else 0,
                             dist.local_world_size() if launched else 1)
    rt = choose_runtime(s.executor, s.device, s.backend, s.dtype, s.link, s.exact_reduce, s.dist_timeout)
    built = rt.build(s.model, s.tp, None, s.drop_variant, progress=False)
    L = built.source.config.num_layers
    plans = [(spec, model_plan(built.source, spec, s.tp, s.drop_variant, what="plans")) for spec in s.plans]
    ids, prompt_text = prompt_tokens(built.source.load_tokenizer(), s.dataset, s.prompt_len * s.batch, s.data_dir)
    prompt = torch.tensor(ids).view(s.batch, s.prompt_len)  # (B, S)
    for _, plan in plans:  # build every plan's model before timing (distilled directories: once per block set)
        built.use_plan(plan)
    links = None if s.links is None else list(s.links)
    if links is not None:
        built.use_link(links[0][1])  # the emulation wrapper exists before the bench reads the communicator
    res = latency_bench(built.use_plan, plans, prompt, s.decode_tokens, s.reps, s.warmup,
                        progress=progress and built.is_main, max_reps=s.max_reps, target_rel_ci=s.target_ci,
                        links=links, use_link=built.use_link)
    memory = built.memory()  # a collective: every rank
    if not built.is_main:
        return None
    settings = {"model": built.source.name, "tp": s.tp, "prompt_len": s.prompt_len, "prompt_text": prompt_text,
                "batch": s.batch,
                "decode_tokens": s.decode_tokens, "reps": s.reps, "warmup": s.warmup, "dtype": s.dtype,
                "exact_reduce": s.exact_reduce,
                "runtime": "distributed" if built.dist else "single-process", "backend": rt.backend,
                "device": str(rt.device), "executor": rt.executor, "threads_per_rank": pinned["threads"],
                "cpu_cores_rank0": pinned["cores"], "max_reps": s.max_reps, "target_ci": s.target_ci,
                "hidden_size": built.source.config.hidden_size, "num_layers": L, "model_spec": s.model,
                "model_config": built.source.config.to_dict()}
    docs = []
    for label, lk in s.conditions():
        st = {**settings, "link": lk.to_dict(), "link_description": lk.describe()}
        if links is not None:
            st["interleaved_links"] = [lb for lb, _ in links]
        docs.append({"settings": st, "provenance": provenance(), "memory": memory,
                     **(res if label is None else res[label])})
    return docs


def _measure_vllm(s: BenchSettings) -> dict[str, Any]:
    """The plans measured inside vLLM (:mod:`syncdrop.serve.vllm_bench`), as one result document."""
    from syncdrop.eval.data import prompt_tokens
    from syncdrop.io_utils import provenance
    from syncdrop.models.loading import resolve_model
    from syncdrop.serve.vllm_bench import vllm_bench

    source = resolve_model(s.model)
    prompt, prompt_text = prompt_tokens(source.load_tokenizer(), s.dataset, s.prompt_len, s.data_dir)
    res = vllm_bench(s.model, s.tp, list(s.plans), prompt, s.decode_tokens, s.reps, s.warmup, s.work_dir, s.link,
                     s.max_reps, s.target_ci, stock=s.stock, dtype=s.dtype)
    settings = {"model": source.name, "tp": s.tp, "prompt_len": s.prompt_len, "prompt_text": prompt_text, "batch": 1,
                "decode_tokens": s.decode_tokens, "reps": s.reps, "warmup": s.warmup, "dtype": s.dtype,
                "link": s.link.to_dict(), "link_description": s.link.describe(), "engine": res["engine"]["name"],
                "max_reps": s.max_reps, "target_ci": s.target_ci, "hidden_size": source.config.hidden_size,
                "num_layers": source.config.num_layers, "model_spec": s.model,
                "model_config": source.config.to_dict()}
    return {"settings": settings, "provenance": provenance(), **res}


# ---------------------------------------------------------------------------- ranks started here

RESULT, JOB = "result.json", "job.json"


def _launch_ranks(s: BenchSettings, progress: bool) -> list[dict[str, Any]]:
    """Start ``s.tp`` ranks running :func:`_worker`, wait for them and return rank 0's documents (see the
    module docstring)."""
    import tempfile

    from syncdrop.cli_args import check_launch_devices
    from syncdrop.io_utils import atomic_write_json, command_line
    from syncdrop.parallel.dist import RankFailure
    from syncdrop.parallel.launch import launch

    check_launch_devices(s.device, s.backend, s.tp)
    command = command_line()  # the caller's, for the documents' provenance
    with tempfile.TemporaryDirectory(prefix="syncdrop_bench_") as tmp:
        job = Path(tmp)
        atomic_write_json(job / JOB, {"settings": s.to_dict(), "progress": progress, "command": command})
        failed: list[str] = []
        code = launch([str(job)], s.tp, grace_s=min(s.dist_timeout, LAUNCH_GRACE_S),
                      program=["-m", "syncdrop.bench.run"], on_failure=failed.append)
        if code == 130:
            raise KeyboardInterrupt
        errors = {}
        for r in range(s.tp):
            p = job / f"rank{r}.error.json"
            if p.is_file():
                errors[r] = json.loads(p.read_text())
        if code != 0:
            first = errors.get(0)
            if first is not None and first.get("usage"):  # rank 0 refused the settings: the same error here
                raise SyncdropError(first["message"], field=first.get("field"))
            said = [e["message"] if e["message"].startswith(f"rank {r}") else f"rank {r}: {e['message']}"
                    for r, e in sorted(errors.items())]
            raise RankFailure(f"bench at TP={s.tp} failed (exit {code}): "
                              + "; ".join(failed + said or ["no rank said why"]))
        if not (job / RESULT).is_file():
            raise RankFailure(f"bench at TP={s.tp}: every rank exited 0 but rank 0 left no result")
        return json.loads((job / RESULT).read_text())


def _note(job: Path, rank: int, message: str, field: str | None = None, usage: bool = False) -> None:
    from syncdrop.io_utils import atomic_write_json

    atomic_write_json(job / f"rank{rank}.error.json", {"message": message, "field": field, "usage": usage})


def _worker(job_dir: str) -> None:
    """One rank of :func:`_launch_ranks` (``python -m syncdrop.bench.run JOB_DIR``): measure, rank 0 writes
    the documents to ``JOB_DIR/result.json``; leave the process group and exit (0, 1: failed, 2: refused
    the settings, 130: interrupted) as ``python -m syncdrop`` workers do."""
    import traceback

    from syncdrop.io_utils import atomic_write_json
    from syncdrop.parallel import dist

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    job = Path(job_dir)
    spec = json.loads((job / JOB).read_text())
    rank = int(os.environ.get("RANK", "0"))
    code = 1
    try:
        docs = _measure(BenchSettings.from_dict(spec["settings"]), bool(spec.get("progress")))
        if docs is not None:
            docs = [{**d, "provenance": {**d["provenance"], "command": spec["command"]}} for d in docs]
            atomic_write_json(job / RESULT, docs)
        code = 0
    except SyncdropError as e:
        _note(job, rank, e.message, e.field, usage=True)
        code = 2
    except dist.RankFailure as e:
        _note(job, rank, str(e))
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # a bug: the traceback on standard error, its last line for the caller
        traceback.print_exc()
        text = str(e).strip()
        _note(job, rank, f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__)
    try:
        dist.shutdown(ok=code == 0)
    except dist.RankFailure as e:
        _note(job, rank, str(e))
        code = 1
    dist.exit_worker(code)


if __name__ == "__main__":
    _worker(sys.argv[1])
