"""Evaluation: data loading, perplexity."""
