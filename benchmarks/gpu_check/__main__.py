"""``python3 benchmarks/gpu_check [...]``: the GPU check from the source tree, with the machine's own Python.

Nothing is installed: this tree's ``syncdrop`` goes first on ``sys.path`` (and on ``PYTHONPATH``, for every
process the check starts), then :func:`gpu_check.cli.main` runs. Only the standard library is imported
before the preflight (:mod:`gpu_check.preflight`) has checked torch, transformers, safetensors and numpy.
"""

import os
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parents[1]  # the syncdrop source tree


def bootstrap() -> None:
    """This tree first on ``sys.path`` (syncdrop, and ``benchmarks/`` for this package) and on ``PYTHONPATH``."""
    here = {str(PACKAGE), str(PACKAGE.parent), str(ROOT)}
    sys.path[:] = [str(ROOT), str(PACKAGE.parent)] + [p for p in sys.path if p not in here]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])


if __name__ == "__main__":
    bootstrap()
    from gpu_check.cli import main

    sys.exit(main())
