"""One vLLM engine, driven from a JSON job; runs inside the vLLM environment (``.venv-vllm``).

``python -m syncdrop.serve.vllm_run JOB.json`` starts ``vllm.LLM`` once for the job's model and writes
``job["out"]`` (atomically): log-probs and greedy tokens (:func:`run`), or with ``mode = "bench"`` raw
latency samples (:func:`bench`). :mod:`syncdrop.serve.engine` writes the job and starts this module from
syncdrop's own environment, whose transformers differs from the one vLLM pins.

Job keys: ``model`` (a directory), ``tp``, ``dtype`` (default ``float32``), ``max_model_len``,
``architecture`` (optional: overrides ``config.json``'s, e.g. to run a plan-``none`` export through the
plugin's class), ``plan`` (optional: a plan dict that overrides ``config.json``'s ``syncdrop_plan``, e.g. to
serve a plan that drops fewer blocks than an export under plan ``all``), and ``prompts``: a list of
token-id lists. ``max_tokens`` (default 8) greedy tokens are generated per prompt; ``prompt_logprobs`` of
every prompt token but the first are returned (``log p(t_i | t_<i)`` from vLLM's raw logits, fp32), with
the generated tokens and their log-probs.

Compilation is a job setting: by default vLLM compiles the model as it does for a user (on its CPU
backend: one Dynamo trace, Inductor; on CUDA also CUDA graphs); ``eager: true`` runs it eagerly
(``enforce_eager``), ``cuda_graphs: false`` keeps the compilation and turns CUDA graphs off. Every result
says what ran (``compilation``). ``switch`` (a list of block indices) then switches the SPD blocks of the
running engine (:func:`syncdrop.serve.vllm_models.set_dropped`) and scores the prompts again
(``switch``: ``blocks`` and the fields above); a compiled engine refuses the switch (``switch``: ``error``,
the refusal as the workers raised it). ``record: true`` (with ``SYNCDROP_VLLM_INSTRUMENT=1`` in the environment) clocks
every tensor-parallel collective of the generation and returns their seconds per rank (``collectives``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from syncdrop.serve.vllm_link import ENV_INSTRUMENT


def start(job: dict[str, Any]) -> tuple[Any, float]:
    """``vllm.LLM`` for the job (compiled unless ``eager``; prefix caching off, so that repeated prompts are
    computed again)."""
    from vllm import LLM

    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    if job.get("architecture"):
        overrides["architectures"] = [job["architecture"]]
    if job.get("plan") is not None:
        overrides["syncdrop_plan"] = job["plan"]
    if overrides:
        kw["hf_overrides"] = overrides
    tp = int(job["tp"])
    if job.get("max_model_len"):
        kw["max_model_len"] = int(job["max_model_len"])
    if job.get("mode") == "bench" or job.get("switch") is not None or job.get("record"):
        from syncdrop.serve.vllm_worker import WORKER_EXTENSION

        kw["worker_extension_cls"] = WORKER_EXTENSION
    eager = bool(job.get("eager", False))
    if not eager and job.get("cuda_graphs", True) is False:
        kw["compilation_config"] = {"cudagraph_mode": "NONE"}
    llm = LLM(model=job["model"], tensor_parallel_size=tp, dtype=job.get("dtype", "float32"), enforce_eager=eager,
              distributed_executor_backend="mp" if tp > 1 else None, enable_prefix_caching=False,
              max_num_seqs=int(job.get("max_num_seqs", 8)), seed=0, trust_remote_code=False, **kw)
    return llm, time.perf_counter() - t0


def engine_facts(llm) -> dict[str, Any]:
    """What the engine ran: vLLM's version, the model's architectures and the compilation (``mode`` NONE:
    eager)."""
    import vllm

    config = llm.llm_engine.vllm_config
    cc = config.compilation_config
    graphs = getattr(cc, "cudagraph_mode", None)
    return {"vllm_version": vllm.__version__,
            "architectures": list(getattr(config.model_config, "architectures", None) or []),
            "compilation": {"mode": getattr(cc.mode, "name", str(cc.mode)), "backend": cc.backend,
                            "cudagraph_mode": getattr(graphs, "name", str(graphs)),
                            "enforce_eager": bool(config.model_config.enforce_eager)}}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Prompt log-probs and greedy tokens (the module docstring)."""
    from vllm import SamplingParams

    llm, startup = start(job)
    sp = SamplingParams(max_tokens=int(job.get("max_tokens", 8)), temperature=0.0, prompt_logprobs=0, logprobs=0,
                        ignore_eos=True)
    prompts = [{"prompt_token_ids": list(map(int, p))} for p in job["prompts"]]

    def chosen(entry: dict | None, token: int) -> float | None:
        return None if entry is None else float(entry[token].logprob)

    def scored() -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_logprobs": [], "tokens": [], "token_logprobs": []}
        for prompt, o in zip(job["prompts"], llm.generate(prompts, sp, use_tqdm=False), strict=True):
            out["prompt_logprobs"].append([chosen(e, t) for e, t in zip(o.prompt_logprobs, prompt, strict=True)][1:])
            gen = o.outputs[0]
            out["tokens"].append(list(gen.token_ids))
            out["token_logprobs"].append([chosen(e, t) for e, t in zip(gen.logprobs, gen.token_ids, strict=True)])
        return out

    record = bool(job.get("record"))
    if record and not all(llm.collective_rpc("syncdrop_start_recording")):
        raise RuntimeError(f"record needs the sync clock: set {ENV_INSTRUMENT}=1")
    res = {**engine_facts(llm), "startup_s": startup, **scored()}
    if record:
        res["collectives"] = [{kind: [sec for k, sec in rank if k == kind] for kind in ("all_reduce", "gather")}
                              for rank in llm.collective_rpc("syncdrop_stop_recording")]
    if job.get("switch") is not None:
        try:
            blocks = llm.collective_rpc("syncdrop_set_dropped", args=(list(map(int, job["switch"])),))[0]
        except Exception as e:  # a compiled engine refuses: the refusal, as the workers raised it
            res["switch"] = {"error": str(e)}
        else:
            res["switch"] = {"blocks": blocks, **scored()}
    return res


def bench(job: dict[str, Any]) -> dict[str, Any]:
    """Raw latency samples of one plan in one engine (see :mod:`syncdrop.serve.vllm_bench`), or with
    ``diagnose`` the per-sync-point breakdown of one plan.

    Job keys besides the engine's (``plan``: the plan this engine serves; absent for stock vLLM): ``prompt``
    (token ids), ``decode_tokens``, ``reps``, ``warmup``. Timing (``diagnose`` false; the clock is off, so no
    collective synchronises the device except for an emulated link): TTFT and decode per rep until the TTFT
    median's relative 95% half-width is at most ``target_ci`` or ``max_reps`` reps ran. Diagnostic
    (``diagnose`` true; the plugin's clock installed, ``SYNCDROP_VLLM_INSTRUMENT=1``): ``reps`` generations
    with every tensor-parallel collective clocked, cut into the ``n_points`` sync points of each forward,
    and the isolated all-reduce of ``(tokens, hidden)`` for each of ``payload_tokens``."""
    from vllm import SamplingParams

    from syncdrop.bench.stats import relative_half_width

    llm, startup = start(job)
    D = int(job["decode_tokens"])
    prompt = [{"prompt_token_ids": list(map(int, job["prompt"]))}]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    whole = SamplingParams(max_tokens=1 + D, temperature=0.0, ignore_eos=True)

    def seconds(sp) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - t0

    out: dict[str, Any] = {**engine_facts(llm), "startup_s": startup}
    if not job.get("diagnose"):
        ttft, decode, rep, converged = [], [], 0, False
        while True:
            t1, total = seconds(first), seconds(whole)
            if rep >= job["warmup"]:
                ttft.append(t1)
                decode.append(max(0.0, total - t1) / max(1, D))
            rep += 1
            done = rep - job["warmup"]
            if done >= job["reps"]:
                converged = relative_half_width(ttft) <= job["target_ci"]
                if converged or done >= job["max_reps"]:
                    break
        return {**out, "ttft": ttft, "decode": decode, "converged": converged}

    if not all(llm.collective_rpc("syncdrop_start_recording")):
        raise RuntimeError(f"the diagnostic run needs the sync clock: set {ENV_INSTRUMENT}=1")
    llm.collective_rpc("syncdrop_stop_recording")
    sizes = []
    for tokens in job["payload_tokens"]:
        per_rank = llm.collective_rpc("syncdrop_time_all_reduce", args=(tokens, job["hidden"], job["dtype"], 20))
        sizes.append({"tokens": tokens, "samples_s": [max(col) for col in zip(*per_rank, strict=True)]})
    n_points, forwards = int(job["n_points"]), 1 + D
    sync_prefill, sync_decode, gather_prefill, embed_prefill = [], [], [], []
    for rep in range(job["warmup"] + job["reps"]):
        llm.collective_rpc("syncdrop_start_recording")
        seconds(whole)
        per_rank = llm.collective_rpc("syncdrop_stop_recording")
        ar = [[s for k, s in rank if k == "all_reduce"] for rank in per_rank]
        gat = [[s for k, s in rank if k == "gather"] for rank in per_rank]
        # per forward: vLLM's vocab-parallel embedding all-reduces first (syncdrop replicates the embedding),
        # then the blocks' sync points in order
        per_forward, rest = divmod(len(ar[0]), forwards)
        extra = per_forward - n_points
        if rest or extra < 0 or any(len(a) != len(ar[0]) for a in ar):
            raise RuntimeError(f"sync clock: {[len(a) for a in ar]} all-reduces per rank in {forwards} forwards, "
                               f"expected {n_points} sync points (plus the embedding's) each")
        slowest = [max(col) for col in zip(*ar, strict=True)]
        steps = [slowest[f * per_forward + extra:(f + 1) * per_forward] for f in range(forwards)]
        if rep >= job["warmup"]:
            sync_prefill.append(steps[0])
            sync_decode.append([sum(c) / len(c) for c in zip(*steps[1:], strict=True)] if D else [0.0] * n_points)
            gather_prefill.append(max(g[0] for g in gat) if all(gat) else 0.0)
            embed_prefill.append(sum(slowest[:extra]))
    return {**out, "sync_prefill": sync_prefill, "sync_decode": sync_decode, "gather_prefill": gather_prefill,
            "embed_prefill": embed_prefill, "sizes": sizes}


def main(argv: list[str] | None = None) -> int:
    from syncdrop.io_utils import atomic_write_json

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    atomic_write_json(job["out"], bench(job) if job.get("mode") == "bench" else run(job))
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the entry point must be guarded
    sys.exit(main())
