"""Measure one vLLM engine configuration: launch, readiness, load, metrics, teardown.

Knows nothing of Optuna or MLflow; usable on its own as a benchmark harness.
"""
