"""Latency benchmark, slow-link emulation, cost model."""
