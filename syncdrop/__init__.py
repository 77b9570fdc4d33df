"""syncdrop: tensor-parallel LLM inference with fewer synchronisation points."""

__version__ = "0.1.0"
