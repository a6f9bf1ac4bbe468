"""Shared fixtures: a clean environment, and GPU-test skipping."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest


@pytest.fixture
def clean_environ() -> Iterator[dict[str, str]]:
    """Run with no VLLM_/NCCL_/CUDA_ variables from the developer's shell; restore afterwards."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("VLLM_", "NCCL_", "CUDA_", "NIGHTSHIFT_")):
            del os.environ[key]
    try:
        yield dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _has_gpu_and_vllm() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu_and_vllm():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and vllm installed")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray for the session, with two GPUs declared (no real GPU needed), started as
    the daemon starts its own: on 127.0.0.1 only, whatever RAY_ADDRESS says."""
    import ray

    from optimizer.workers import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
                        configure_logging=False)
    yield
    ray.shutdown()
