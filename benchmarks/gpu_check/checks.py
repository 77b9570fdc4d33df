"""In-process checks: the simulated executor on the device against the CPU, and greedy generation against
transformers.

``sim_vs_cpu``      the simulated executor on CUDA vs the same on the CPU, TP = 1..4, plan ``none``, and the drop
                    plan (``--drop-plan``, default ``blocks:3,7``) at TP = 2; fp32 perplexity on W windows of L
                    tokens (4 x 256): ``|ppl_cuda - ppl_cpu| / ppl_cpu <= 1e-4``.
``generate_vs_hf``  greedy generation (:func:`syncdrop.generate.generate`, KV cache) of the simulated executor on
                    CUDA at TP = 1 and 2 vs transformers' ``generate`` of its own dense model on CUDA (the ``hf``
                    executor), 32 new tokens, no EOS stop: equal token for token.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from gpu_check.context import Context

log = logging.getLogger("gpu_check")


def rel_diff(a: float, b: float) -> float:
    """``|a - b| / |b|`` (inf when either is not finite)."""
    return abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) and b != 0 else math.inf


def simulated_ppl(ctx: Context, device: str, tp: int, plans: list[str]) -> dict[str, dict[str, Any]]:
    """Perplexity of the simulated executor at ``tp`` on ``device`` (fp32) under each plan spec, one build
    (plans switched with :meth:`~syncdrop.runtime.Built.use_plan`); cached in ``ctx.sim_ppl``."""
    import torch

    from syncdrop.eval.perplexity import perplexity
    from syncdrop.plan import parse_plan
    from syncdrop.runtime import choose_runtime

    built = choose_runtime("simulated", device, dtype="float32").build(ctx.settings.model, tp, "none", progress=False)
    out = {}
    for spec in plans:
        built.use_plan(parse_plan(spec, built.source.config.num_layers))
        res = perplexity(built.model, ctx.windows, 1, progress=False)
        out[spec] = {"ppl": res.ppl, "window_nll": res.window_nll, "device": str(built.runtime.device)}
        ctx.sim_ppl[(device, tp, spec)] = res.ppl
    del built
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def check_sim_vs_cpu(ctx: Context) -> dict[str, Any]:
    s = ctx.settings
    rows = []
    for tp in s.tps:
        plans = ["none"] + ([s.drop_plan] if tp == s.drop_tp else [])
        ref = simulated_ppl(ctx, s.reference_device, tp, plans)
        got = simulated_ppl(ctx, s.device, tp, plans)
        for spec in plans:
            d = rel_diff(got[spec]["ppl"], ref[spec]["ppl"])
            rows.append({"tp": tp, "plan": spec, "ppl_device": got[spec]["ppl"], "ppl_cpu": ref[spec]["ppl"],
                         "rel_diff": d, "passed": d <= s.rel_tol, "device": got[spec]["device"],
                         "window_nll_device": got[spec]["window_nll"], "window_nll_cpu": ref[spec]["window_nll"]})
            log.info("sim_vs_cpu tp=%d plan=%s: ppl %.6f (%s) vs %.6f (cpu), rel diff %.2e", tp, spec,
                     got[spec]["ppl"], got[spec]["device"], ref[spec]["ppl"], d)
    worst = max(r["rel_diff"] for r in rows)
    return {"passed": all(r["passed"] for r in rows), "summary": f"max rel ppl diff {worst:.2e} (tol {s.rel_tol:g})",
            "max_rel_diff": worst, "rows": rows}


def check_generate_vs_hf(ctx: Context) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    from syncdrop.generate import generate
    from syncdrop.runtime import choose_runtime

    s = ctx.settings
    hf = choose_runtime("hf", s.device, dtype="float32").build(s.model, 1, "none", progress=False)
    tok = hf.source.load_tokenizer()
    prompt = torch.tensor([tok(s.prompt, add_special_tokens=False)["input_ids"]])  # (1, S)
    # no EOS stop on either side (min_new_tokens would instead suppress EOS in transformers)
    cfg = GenerationConfig(max_new_tokens=s.gen_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        ref = hf.model.model.generate(prompt.to(hf.model.device), generation_config=cfg).cpu()[0, prompt.shape[1]:]
    del hf
    rows = []
    for tp in s.gen_tps:
        built = choose_runtime("simulated", s.device, dtype="float32").build(s.model, tp, "none", progress=False)
        got = generate(built.model, prompt, s.gen_tokens).tokens.cpu()[0, prompt.shape[1]:]
        same = got.tolist() == ref.tolist()
        first = next((i for i, (a, b) in enumerate(zip(got.tolist(), ref.tolist(), strict=False)) if a != b), None)
        rows.append({"tp": tp, "passed": same and len(got) == s.gen_tokens, "tokens": got.tolist(),
                     "first_mismatch": first, "text": tok.decode(got), "device": str(built.runtime.device)})
        log.info("generate_vs_hf tp=%d: %s", tp, "equal" if same else f"differs from token {first}")
        del built
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"passed": all(r["passed"] for r in rows) and len(ref) == s.gen_tokens,
            "summary": f"{s.gen_tokens} greedy tokens at TP={','.join(map(str, s.gen_tps))}: "
                       + ", ".join(f"tp{r['tp']} {'equal' if r['passed'] else 'DIFFER'}" for r in rows),
            "prompt": s.prompt, "prompt_ids": prompt[0].tolist(), "hf_tokens": ref.tolist(),
            "hf_text": tok.decode(ref), "rows": rows}
