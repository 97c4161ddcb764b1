"""The public name of the TorchTitan integration: ``from zephon_ray.torchtitan import ZephonRayDataLoader``.

The code lives in :mod:`zephon_ray.integrations.torchtitan` (install the ``torchtitan`` extra). Importing this
module is cheap; TorchTitan is imported when a name is first used.
"""

from __future__ import annotations

from typing import Any

# Both names resolve lazily in __getattr__ below, which static checks cannot see.
__all__ = ["LoaderStateError", "ZephonRayDataLoader"]  # noqa: F822


def __getattr__(name: str) -> Any:
    if name in __all__:
        from zephon_ray.integrations import torchtitan

        return getattr(torchtitan, name)
    raise AttributeError(name)
