"""TorchTitan integration (the ``torchtitan`` extra): a data loader whose global batches survive any change of dp degree.

* :class:`ZephonRayDataLoader` (``loader``): TorchTitan's ``BaseDataLoader``, a thin adapter over the framework-free
  loader core :class:`zephon_ray.stream.loader.Loader`. Public alias: ``from zephon_ray.torchtitan import
  ZephonRayDataLoader``.
* ``config_registry``: the configs of ``torchtitan.train --module zephon_ray.integrations.torchtitan --config <name>``.
* ``overrides``: the ``--override.imports`` route onto TorchTitan's own configs.
* ``trainer_checks``: the trainer's tokenizer against the recipe's (batch geometry: :mod:`zephon_ray.stream.geometry`).
* ``internals``: the one module that relies on TorchTitan's private internals (a fence test of the suite fails
  loudly when they change).

Outside the wheel: ``examples/torchtitan_cpu.py`` (CPU shims and the ``*_cpu`` configs) and
``examples/torchtitan_ray_train.py`` (TorchTitan's Trainer under Ray Train).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoaderStateError", "ZephonRayDataLoader"]


def __getattr__(name: str) -> Any:
    # Importing torchtitan is slow; keep `import zephon_ray.torchtitan` cheap until the loader is needed.
    if name == "ZephonRayDataLoader":
        from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader

        return ZephonRayDataLoader
    if name == "LoaderStateError":
        from zephon_ray.formats.loader_state import LoaderStateError

        return LoaderStateError
    raise AttributeError(name)
