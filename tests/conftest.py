"""Shared fixtures: a clean environment, and GPU-test skipping."""

from __future__ import annotations

import os
import shutil
import sqlite3
import warnings
from collections.abc import Iterator
from typing import Any

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

    from optimizer.run.ray_cluster import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
                        configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def mlflow_schema_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A new MLflow sqlite store gets its tables by copying an empty store that MLflow's own
    migrations built once for this test process, not by running the ~60 migrations again.

    Every end-to-end test opens a fresh store in its tmp_path, and the migrations cost about
    1 s of CPU each time (a 2-core machine runs the suite CPU-bound). The copy is SQLite's
    backup of that store, schema and alembic revision alike, so what MLflow finds is what its
    migrations would have left; stores of other databases, and stores opened in other
    processes (a daemon started as a subprocess), run the migrations as before. Patched by
    string path, as a last resort: MLflow has no switch for it."""
    from unittest import mock

    import sqlalchemy
    from mlflow.store.db import utils

    migrate = utils._initialize_tables
    template = tmp_path_factory.mktemp("mlflow-schema") / "empty.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{template}")
    try:
        with warnings.catch_warnings():  # MLflow's own mappers, first configured here
            warnings.simplefilter("ignore", DeprecationWarning)
            migrate(engine)
    finally:
        engine.dispose()

    def initialize_tables(engine: Any) -> None:
        # Only an empty database is replaced by the copy: one holding other tables (an Optuna
        # storage in the same file, say) gets MLflow's migrations, which add to it.
        if engine.dialect.name != "sqlite" or sqlalchemy.inspect(engine).get_table_names():
            migrate(engine)
            return
        raw = engine.raw_connection()
        try:
            with sqlite3.connect(template) as source:
                source.backup(raw.driver_connection)
        finally:
            raw.close()

    with mock.patch("mlflow.store.db.utils._initialize_tables", initialize_tables):
        yield
