"""zephon-ray: deterministic, step-keyed global batches for foundation-model training on Ray.

Global batch s is a pure function of (recipe, s): it does not depend on how many trainer ranks read it, how
many producers computed it, or how often anything was killed and resumed in between.
"""

from zephon_ray.batch import GlobalBatch, RankSlice, compute_digest
from zephon_ray.formats.materialized import MaterializedSource
from zephon_ray.recipe import Recipe, RecipeError
from zephon_ray.source import GlobalBatchSource

__version__ = "0.1.0"

__all__ = ["DataService", "GlobalBatch", "GlobalBatchSource", "MaterializedSource", "RankSlice", "Recipe", "RecipeError",
           "compute_digest"]


def __getattr__(name: str):
    # The service pulls in Ray; keep `import zephon_ray` light for in-process users and tools.
    if name == "DataService":
        from zephon_ray.service.client import DataService

        return DataService
    raise AttributeError(name)
