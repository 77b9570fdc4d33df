"""Partial channel reduce (CAAT-Net, docs/methods.md): training Llama-style models from scratch with
partially synchronised activations, in the simulated executor (exact gradients through the
rank axis) or under torchrun (one process per rank)."""
