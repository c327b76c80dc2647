"""Benchmarks runnable as modules (python -m trace_jax.bench.<name>), JSON output."""
