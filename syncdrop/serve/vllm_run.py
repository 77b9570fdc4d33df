"""One vLLM engine, driven from a JSON job; runs inside the vLLM environment (``.venv-vllm``).

``python -m syncdrop.serve.vllm_run JOB.json`` starts ``vllm.LLM`` once for the job's model and writes
``job["out"]`` (atomically): log-probs and greedy tokens (:func:`run`), or with ``mode = "bench"`` raw
latency samples (:func:`bench`). :mod:`syncdrop.serve.engine` writes the job and starts this module from
syncdrop's own environment, whose transformers differs from the one vLLM pins.

Job keys: ``model`` (a directory), ``tp``, ``dtype`` (default ``float32``), ``max_model_len``,
``architecture`` (optional: overrides ``config.json``'s, e.g. to run a plan-``none`` export through the
plugin's class), and ``prompts``: a list of token-id lists. ``max_tokens`` (default 8) greedy tokens are
generated per prompt; ``prompt_logprobs`` of every prompt token but the first are returned
(``log p(t_i | t_<i)`` from vLLM's raw logits, fp32), with the generated tokens and their log-probs.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def start(job: dict[str, Any]) -> tuple[Any, float]:
    """``vllm.LLM`` for the job (eager; prefix caching off, so that repeated prompts are computed again)."""
    from vllm import LLM

    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if job.get("architecture"):
        kw["hf_overrides"] = {"architectures": [job["architecture"]]}
    tp = int(job["tp"])
    if job.get("max_model_len"):
        kw["max_model_len"] = int(job["max_model_len"])
    if job.get("mode") == "bench":
        from syncdrop.serve.vllm_link import WORKER_EXTENSION

        kw["worker_extension_cls"] = WORKER_EXTENSION
    llm = LLM(model=job["model"], tensor_parallel_size=tp, dtype=job.get("dtype", "float32"), enforce_eager=True,
              distributed_executor_backend="mp" if tp > 1 else None, enable_prefix_caching=False,
              max_num_seqs=int(job.get("max_num_seqs", 8)), seed=0, trust_remote_code=False, **kw)
    return llm, time.perf_counter() - t0


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Prompt log-probs and greedy tokens (the module docstring)."""
    import vllm
    from vllm import SamplingParams

    llm, startup = start(job)
    sp = SamplingParams(max_tokens=int(job.get("max_tokens", 8)), temperature=0.0, prompt_logprobs=0, logprobs=0,
                        ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in job["prompts"]], sp, use_tqdm=False)

    def chosen(entry: dict | None, token: int) -> float | None:
        return None if entry is None else float(entry[token].logprob)

    archs = list(getattr(llm.llm_engine.model_config, "architectures", None) or [])
    res = {"vllm_version": vllm.__version__, "startup_s": startup, "architectures": archs, "prompt_logprobs": [],
           "tokens": [], "token_logprobs": []}
    for prompt, o in zip(job["prompts"], outs, strict=True):
        res["prompt_logprobs"].append([chosen(e, t) for e, t in zip(o.prompt_logprobs, prompt, strict=True)][1:])
        gen = o.outputs[0]
        res["tokens"].append(list(gen.token_ids))
        res["token_logprobs"].append([chosen(e, t) for e, t in zip(gen.logprobs, gen.token_ids, strict=True)])
    return res


def bench(job: dict[str, Any]) -> dict[str, Any]:
    """Raw latency samples of the job's plans in one engine, interleaved (see :mod:`syncdrop.serve.vllm_bench`).

    Job keys besides the engine's: ``prompt`` (token ids), ``decode_tokens``, ``reps``, ``warmup``,
    ``max_reps``, ``target_ci``, ``hidden``, ``payload_tokens`` (the isolated all-reduce sizes), and
    ``plans``: ``[{"spec", "dropped"}]`` (``dropped`` None: leave the model as loaded, for stock vLLM) with
    ``baseline`` the spec whose sync points are timed (``n_points`` all-reduces per forward)."""
    from vllm import SamplingParams

    from syncdrop.bench.stats import relative_half_width

    llm, startup = start(job)
    D = int(job["decode_tokens"])
    prompt = [{"prompt_token_ids": list(map(int, job["prompt"]))}]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    whole = SamplingParams(max_tokens=1 + D, temperature=0.0, ignore_eos=True)

    def use(plan: dict[str, Any]) -> None:
        if plan["dropped"] is not None:
            llm.collective_rpc("syncdrop_set_dropped", args=(plan["dropped"],))

    def seconds(sp) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - t0

    sizes = []
    for tokens in job["payload_tokens"]:
        per_rank = llm.collective_rpc("syncdrop_time_all_reduce", args=(tokens, job["hidden"], job["dtype"], 20))
        sizes.append({"tokens": tokens, "samples_s": [max(col) for col in zip(*per_rank, strict=True)]})
    plans, base = job["plans"], next(p for p in job["plans"] if p["spec"] == job["baseline"])
    n_points, forwards = int(job["n_points"]), 1 + D
    samples: dict[str, dict[str, list[float]]] = {p["spec"]: {"ttft": [], "decode": []} for p in plans}
    sync_prefill, sync_decode, gather_prefill, embed_prefill = [], [], [], []
    rep, converged = 0, False
    while True:
        for plan in plans:
            use(plan)
            ttft, total = seconds(first), seconds(whole)
            if rep >= job["warmup"]:
                samples[plan["spec"]]["ttft"].append(ttft)
                samples[plan["spec"]]["decode"].append(max(0.0, total - ttft) / max(1, D))
        use(base)
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
        rep += 1
        done = rep - job["warmup"]
        if done >= job["reps"]:
            converged = max(relative_half_width(samples[p["spec"]]["ttft"]) for p in plans) <= job["target_ci"]
            if converged or done >= job["max_reps"]:
                break
    return {"startup_s": startup, "samples": samples, "sync_prefill": sync_prefill, "sync_decode": sync_decode,
            "gather_prefill": gather_prefill, "embed_prefill": embed_prefill, "sizes": sizes, "converged": converged,
            "architectures": list(getattr(llm.llm_engine.model_config, "architectures", None) or [])}


def main(argv: list[str] | None = None) -> int:
    from syncdrop.io_utils import atomic_write_json

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    atomic_write_json(job["out"], bench(job) if job.get("mode") == "bench" else run(job))
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the entry point must be guarded
    sys.exit(main())
