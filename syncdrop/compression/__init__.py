"""Accuracy tooling for compressed sync points (the sync mode itself is :mod:`syncdrop.plan.compressed`):
per-sync-point sensitivity to a wire format (:mod:`syncdrop.compression.profile`). docs/compression.md."""
