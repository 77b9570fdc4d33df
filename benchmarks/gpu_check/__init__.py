"""The prepared GPU check: syncdrop's CUDA, NCCL and vLLM paths against references (docs/gpu.md).

Run it with the machine's own Python, from the source tree, with no install step and no network::

    python3 benchmarks/gpu_check                      # on a GPU machine -> results/gpu/
    python3 benchmarks/gpu_check --checks vllm_tp1    # rerun one check
    python3 benchmarks/gpu_check --cpu-dry-run --out /tmp/gpu_dry

It needs torch, transformers, safetensors and numpy (and what transformers itself needs); nothing else is
imported (no gguf, lm-eval, datasets, matplotlib or accelerate; vLLM only in its own processes, where it is
installed). syncdrop comes from this tree: ``__main__`` puts the tree first on ``sys.path`` and
``PYTHONPATH``, so every process it starts (``python -m syncdrop``, the ranks, vLLM's workers) uses it too.
:mod:`.preflight` checks the versions first and says in one line what is missing.

Model and text: ``--model auto`` (the default) is SmolLM2 where its GGUF is installed, else a random-weight
Llama built on the spot (:mod:`syncdrop.tiny_models`); ``--dataset auto`` is WikiText-2 or the Shakespeare
text where present, else a synthetic text. The vLLM part always uses a random-weight Llama sized for vLLM.

Parts, one module each:

* :mod:`.checks`: ``sim_vs_cpu``, ``generate_vs_hf`` (in this process);
* :mod:`.distributed`: ``nccl_ppl``, ``nccl_fault``, ``bench_float32``, ``bench_bfloat16`` (``syncdrop``
  subprocesses, one rank per GPU);
* :mod:`.vllm_part`: ``vllm_tp1``, ``vllm_tp2`` (vLLM engines in subprocesses, :mod:`.vllm_worker`);
* :mod:`.context` (settings, the model and the text), :mod:`.report` (files, verdicts), :mod:`.cli`.
"""
