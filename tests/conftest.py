"""Shared fixtures: the tiny recipe and a private local Ray cluster that the tests start and stop themselves."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TINY = RECIPES / "tiny.toml"


@pytest.fixture(scope="session")
def tiny_recipe():
    from zephon_ray import Recipe

    return Recipe.from_toml(TINY)


@pytest.fixture(scope="session")
def reference_digests(tiny_recipe):
    """Per-step digests of the tiny recipe from a fresh in-process run: the reference every test compares with."""
    from zephon_ray import GlobalBatchSource

    with GlobalBatchSource(tiny_recipe) as source:
        return [source.batch(step).digest for step in range(24)]


@pytest.fixture(scope="session")
def ray_cluster():
    """A private Ray cluster for this test session; never attaches to a cluster someone else started.

    Logical CPUs are oversubscribed (8 on a 2-core machine) and actors ask for fractions, so a Ray Data or
    Train job cannot starve behind actors holding every CPU (see shared notes on Ray hangs on 2 cores).
    """
    import ray

    temp_dir = tempfile.mkdtemp(prefix="zr-ray-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=temp_dir,
        namespace="zephon-ray-tests",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}},
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
