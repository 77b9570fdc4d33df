"""syncdrop's own answer for the prompts a vLLM job scores: the reference the plugin is tested against.

:func:`reference_logprobs` runs the simulated executor (all N ranks in one process, exact) and returns the
same fields :mod:`syncdrop.serve.vllm_run` returns; :func:`compare` puts the two side by side.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def reference_logprobs(model_spec: str, tp: int, prompts: list[list[int]], max_tokens: int,
                       plan_spec: str | None = None, dtype: str = "float32") -> dict[str, Any]:
    """``prompt_logprobs`` (``log p(t_i | t_<i)`` for i >= 1, fp32) and ``max_tokens`` greedy ``tokens`` (no EOS
    stop) of ``model_spec`` at ``tp`` simulated ranks in ``dtype`` under ``plan_spec`` (default: the model's
    own plan)."""
    from syncdrop.generate import generate
    from syncdrop.runtime import choose_runtime

    built = choose_runtime("simulated", "cpu", dtype=dtype).build(model_spec, tp, plan_spec, progress=False)
    res: dict[str, Any] = {"prompt_logprobs": [], "tokens": [], "plan": built.plan.to_dict()}
    for p in prompts:
        ids = torch.tensor([p])  # (1, S)
        logp = torch.log_softmax(built.model.logits(built.model.hidden_states(ids)).float(), -1)[0]  # (S, V)
        res["prompt_logprobs"].append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist())
        res["tokens"].append(generate(built.model, ids, max_tokens).tokens[0, len(p):].tolist())
    return res


def compare(vllm: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``max_abs_dlogp`` over every scored prompt token, and whether the greedy tokens agree."""
    diffs = [abs(a - b) for va, ra in zip(vllm["prompt_logprobs"], ref["prompt_logprobs"], strict=True)
             for a, b in zip(va, ra, strict=True)]
    return {"max_abs_dlogp": max(diffs), "tokens_equal": vllm["tokens"] == ref["tokens"], "scored": len(diffs)}
