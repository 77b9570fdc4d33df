"""One vLLM engine for the GPU check's vLLM part; runs inside the vLLM interpreter, one process per engine.

``python vllm_worker.py JOB.json`` starts ``vllm.LLM`` with vLLM's defaults for compilation and CUDA graphs
(nothing of ``enforce_eager`` or ``compilation_config`` is set), scores the job's prompts and writes
``job["out"]``: prompt log-probs and greedy tokens (as :mod:`syncdrop.serve.vllm_run` returns them), and what
the engine actually ran, asked of the worker processes through :class:`Probe` (``worker_extension_cls``):

* ``model_class``, ``layer_classes``, ``spd_layers``: the model vLLM built, its decoder layers' classes and
  which of them run the plugin's SPD block;
* ``compiled``: every ``@support_torch_compile`` module of the model and whether it was compiled;
* ``cudagraph_requested`` (the engine's configuration, as the front end resolved it) and
  ``cudagraph_resolved`` (what the worker settled on once the attention backend was known: vLLM lowers the
  mode there, with a warning, when the backend or the model cannot capture it), and
  ``compilation_counter`` (vLLM's own counters: graphs traced, CUDA graphs captured).

Job keys: ``model``, ``tp``, ``dtype``, ``prompts`` (token-id lists), ``max_tokens``, ``max_model_len``, ``out``,
and optionally ``architecture`` (``hf_overrides`` of ``config.json``'s) and ``gpu_memory_utilization``.

vLLM loads general plugins through the ``vllm.general_plugins`` entry point, which only an installed syncdrop
has. From a source tree (``PYTHONPATH``, no ``pip install``) this module writes a one-entry-point
distribution (``*.dist-info``) into a folder beside the job's output and puts it on ``sys.path`` and
``PYTHONPATH``, so that every process vLLM starts loads the plugin exactly as an installed one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_ENTRY = "syncdrop = syncdrop.serve.vllm_plugin:register"


class Probe:
    """vLLM worker extension (``worker_extension_cls``): reports what the worker built and how it runs it."""

    def gpu_check_probe(self) -> dict[str, Any]:
        import dataclasses

        from vllm.compilation.counter import compilation_counter

        runner = self.model_runner
        model = runner.get_model()
        inner = getattr(model, "model", None)
        layers = getattr(getattr(inner, "decoder", inner), "layers", [])
        compiled = {name or "<root>": bool(getattr(m, "compiled", False) or getattr(m, "aot_compiled_fn", None))
                    for name, m in model.named_modules() if hasattr(m, "do_not_compile") and not m.do_not_compile}
        mode = runner.compilation_config.cudagraph_mode
        return {"model_class": type(model).__name__, "layer_classes": [type(x).__name__ for x in layers],
                "spd_layers": [i for i, x in enumerate(layers) if getattr(x, "spd_active", False)],
                "compiled": compiled, "cudagraph_resolved": getattr(mode, "name", str(mode)),
                "compilation_mode": getattr(runner.compilation_config.mode, "name",
                                            str(runner.compilation_config.mode)),
                "compilation_counter": dataclasses.asdict(compilation_counter)}


def ensure_plugin_visible(root: Path) -> str | None:
    """Make syncdrop's ``vllm.general_plugins`` entry point visible here and in every child, from a distribution
    written to the new folder ``root``; returns that folder, or None when an installed syncdrop provides it."""
    from importlib.metadata import entry_points

    if any(ep.name == "syncdrop" for ep in entry_points(group=PLUGIN_GROUP)):
        return None
    info = root / "syncdrop_gpu_check_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: syncdrop-gpu-check-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN_ENTRY}\n")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return str(root)


def run(job: dict[str, Any]) -> dict[str, Any]:
    out = Path(job["out"])
    shim = ensure_plugin_visible(out.parent / f"{out.stem}_plugin_shim")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    import syncdrop

    kw: dict[str, Any] = {}
    if job.get("architecture"):
        kw["hf_overrides"] = {"architectures": [job["architecture"]]}
    if job.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    tp = int(job["tp"])
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], tensor_parallel_size=tp, dtype=job["dtype"], seed=0, enable_prefix_caching=False,
              max_model_len=int(job["max_model_len"]), max_num_seqs=8, trust_remote_code=False,
              distributed_executor_backend="mp" if tp > 1 else None,
              worker_extension_cls="gpu_check.vllm_worker.Probe", **kw)
    startup = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.compilation_config
    sp = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0, prompt_logprobs=0, logprobs=0,
                        ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(map(int, p))} for p in job["prompts"]], sp, use_tqdm=False)

    def chosen(entry: dict | None, token: int) -> float | None:
        return None if entry is None else float(entry[token].logprob)

    res: dict[str, Any] = {
        "vllm_version": vllm.__version__, "torch": torch.__version__, "python": sys.executable,
        "device_type": current_platform.device_type,
        "syncdrop_file": syncdrop.__file__, "plugin_entry_point": "installed" if shim is None else "source tree shim",
        "startup_s": startup, "enforce_eager": bool(llm.llm_engine.model_config.enforce_eager),
        "architectures": list(getattr(llm.llm_engine.model_config, "architectures", None) or []),
        "cudagraph_requested": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "compilation_mode_requested": getattr(cc.mode, "name", str(cc.mode)),
        "prompt_logprobs": [], "tokens": [], "token_logprobs": []}
    for prompt, o in zip(job["prompts"], outs, strict=True):
        res["prompt_logprobs"].append([chosen(e, t) for e, t in zip(o.prompt_logprobs, prompt, strict=True)][1:])
        gen = o.outputs[0]
        res["tokens"].append(list(gen.token_ids))
        res["token_logprobs"].append([chosen(e, t) for e, t in zip(gen.logprobs, gen.token_ids, strict=True)])
    res["workers"] = llm.collective_rpc("gpu_check_probe")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    res = run(job)
    out = Path(job["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":  # vLLM may spawn its workers: the entry point must be guarded
    sys.exit(main())
