"""The vLLM plugin (entry point ``vllm.general_plugins`` -> ``syncdrop = syncdrop.serve.vllm_plugin:register``).

vLLM calls :func:`register` in every process it starts. It registers ``Syncdrop<arch>`` for the
architectures syncdrop loads, lazily (``"module:Class"``: nothing of vLLM's model code, and nothing of
CUDA, is imported until a model of that architecture is built). A directory written by ``syncdrop
export`` with a plan that drops sync points names one of these architectures in its ``config.json``.
It also installs :mod:`syncdrop.serve.vllm_link` when ``SYNCDROP_LINK_*`` or ``SYNCDROP_VLLM_INSTRUMENT``
is set (benchmarks only).
"""

from __future__ import annotations

from syncdrop.models.hf_reader import SERVED_ARCH_PREFIX, SUPPORTED_HF_ARCHS

MODELS_MODULE = "syncdrop.serve.vllm_models"


def served_architectures() -> dict[str, str]:
    """``{"SyncdropLlamaForCausalLM": "syncdrop.serve.vllm_models:SyncdropLlamaForCausalLM", ...}``."""
    return {SERVED_ARCH_PREFIX + a: f"{MODELS_MODULE}:{SERVED_ARCH_PREFIX}{a}" for a in SUPPORTED_HF_ARCHS}


def register() -> None:
    from vllm import ModelRegistry

    from syncdrop.serve.vllm_link import install

    install()  # the link emulation and the collective clock, only when the environment asks (vllm_link)

    known = set(ModelRegistry.get_supported_archs())
    for arch, target in served_architectures().items():
        if arch not in known:
            ModelRegistry.register_model(arch, target)
