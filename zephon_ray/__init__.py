"""zephon-ray: deterministic, step-keyed global batches for foundation-model training on Ray.

Global batch s is a pure function of (recipe, s): it does not depend on how many trainer ranks read it, how
many producers computed it, or how often anything was killed and resumed in between.

Usage: ``GlobalBatchSource(Recipe.from_toml("tiny")).batch(s)`` in-process, ``DataService.start(...)`` /
``DataService.connect(...)`` for the Ray service; the trainer integrations live in :mod:`zephon_ray.integrations`.
Limits of the guarantee (the same environment; L fixed for the life of a run): docs/limits.md.
"""

from typing import Any

from zephon_ray.batch import GlobalBatch, RankSlice, compute_digest
from zephon_ray.formats.materialized import MaterializedSource
from zephon_ray.recipe import Recipe, RecipeError
from zephon_ray.source import GlobalBatchSource

__version__ = "0.1.0"

__all__ = [
    "DataService",
    "GlobalBatch",
    "GlobalBatchSource",
    "Loader",
    "LoaderConfig",
    "MaterializedSource",
    "RankSlice",
    "Recipe",
    "RecipeError",
    "ServiceConfig",
    "StepBatch",
    "ZephonDataConfig",
    "ZephonDataset",
    "compute_digest",
]

_LAZY = {
    "DataService": "zephon_ray.service.client",
    "ServiceConfig": "zephon_ray.service.config",
    "Loader": "zephon_ray.stream.loader",
    "LoaderConfig": "zephon_ray.stream.loader",
    "StepBatch": "zephon_ray.stream.loader",
    "ZephonDataset": "zephon_ray.integrations.ray_train",
    "ZephonDataConfig": "zephon_ray.integrations.ray_train",
}
"""Names imported on first use: the service and Ray Train pull in Ray, so ``import zephon_ray`` stays light for
in-process users and tools. (TorchTitan's loader: ``from zephon_ray.torchtitan import ZephonRayDataLoader``.)"""
_LAZY_MODULES = {"ray_train": "zephon_ray.integrations.ray_train"}
"""Integration modules by a short name, imported on first use: ``from zephon_ray import ray_train`` (then
``ray_train.ZephonDataset``, ``ray_train.ZephonDataConfig``, ...). A module file here would sit below the
integrations it re-exports; the package root may import any layer."""


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        module = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = module  # later attribute lookups skip this hook
        return module
    raise AttributeError(f"module 'zephon_ray' has no attribute {name!r}")
