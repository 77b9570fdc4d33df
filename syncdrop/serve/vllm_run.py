"""One vLLM engine, driven from a JSON job; runs inside the vLLM environment (``.venv-vllm``).

``python -m syncdrop.serve.vllm_run JOB.json`` starts ``vllm.LLM`` once for the job's model and writes
``job["out"]`` (atomically). :mod:`syncdrop.serve.engine` writes the job and starts this module from
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


def run(job: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if job.get("architecture"):
        kw["hf_overrides"] = {"architectures": [job["architecture"]]}
    tp = int(job["tp"])
    if job.get("max_model_len"):
        kw["max_model_len"] = int(job["max_model_len"])
    llm = LLM(model=job["model"], tensor_parallel_size=tp, dtype=job.get("dtype", "float32"), enforce_eager=True,
              distributed_executor_backend="mp" if tp > 1 else None,
              max_num_seqs=int(job.get("max_num_seqs", 8)), seed=0, trust_remote_code=False, **kw)
    startup = time.perf_counter() - t0
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


def main(argv: list[str] | None = None) -> int:
    from syncdrop.io_utils import atomic_write_json

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    atomic_write_json(job["out"], run(job))
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the entry point must be guarded
    sys.exit(main())
