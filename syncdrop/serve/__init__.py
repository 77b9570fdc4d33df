"""Serving what syncdrop chooses: export to a transformers directory and the vLLM plugin."""
