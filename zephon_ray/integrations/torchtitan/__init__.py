"""TorchTitan integration: a data loader whose global batches survive any change of data-parallel degree.

* :class:`ZephonRayDataLoader` (``zephon_ray.integrations.torchtitan.loader``): the TorchTitan ``BaseDataLoader``.
* ``zephon_ray.integrations.torchtitan.config_registry``: ``--module zephon_ray.integrations.torchtitan --config <name>`` configs.
* ``zephon_ray.integrations.torchtitan.overrides``: the ``--override.imports`` route onto TorchTitan's own configs.
* ``examples.torchtitan_ray_train``: TorchTitan or a plain torch loop under Ray Train ``TorchTrainer``.
* ``examples.torchtitan_cpu``: the shims that let TorchTitan 0.3.0 train on a CPU-only torch (tests, examples).
* ``zephon_ray.stream.prefetch``: the ``SliceSource`` interface every delivery mode implements, and its thread.
* ``zephon_ray.stream.mesh``: TP/PP/CP peers of a dp rank share its slice (one Zephon participant per dp rank).
* ``zephon_ray.integrations.torchtitan.trainer_checks``: the trainer's global batch, seq_len and tokenizer against the recipe.
"""

from __future__ import annotations

__all__ = ["LoaderStateError", "ZephonRayDataLoader"]


def __getattr__(name: str):
    # Importing torchtitan is slow; keep `import zephon_ray.torchtitan` cheap until the loader is needed.
    if name == "ZephonRayDataLoader":
        from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader

        return ZephonRayDataLoader
    if name == "LoaderStateError":
        from zephon_ray.formats.loader_state import LoaderStateError

        return LoaderStateError
    raise AttributeError(name)
