"""Tensor parallelism: which slice each rank owns, communicators, executors."""
