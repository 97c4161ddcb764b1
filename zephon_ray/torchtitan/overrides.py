"""The ``--override.imports`` route: put :class:`ZephonRayDataLoader` into any stock TorchTitan config.

    torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --training.seq_len 64 --training.global_batch_size 16 --training.local_batch_size 2 \\
        --override.imports 'zephon_ray.torchtitan.overrides.zephon_dataloader={"recipe": "recipes/tiny.toml"}'

The factory replaces the trainer's ``dataloader`` node only (not a validator's). Keyword arguments (the JSON
object) are :class:`ZephonRayDataLoader.Config` fields; unset ones come from the same environment variables as
the config registry (``ZEPHON_RAY_RECIPE``, ``ZEPHON_RAY_MODE``, ``ZEPHON_RAY_RUN_ID``, ...). The trainer's
seq_len and global batch must match the recipe; the loader checks both and says which to set. This route cannot
install the CPU shims early enough (TorchTitan picks its device before overrides are applied), so on a CPU-only
torch use the config registry's ``*_cpu`` configs instead.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.config.override import override

from zephon_ray.torchtitan.config_registry import zephon_loader_config
from zephon_ray.torchtitan.loader import ZephonRayDataLoader


@override(target=BaseDataLoader.Config, fqns=["dataloader"],
          description="zephon-ray: deterministic global batches that survive any change of dp degree")
def zephon_dataloader(cfg: BaseDataLoader.Config, **kwargs: Any) -> ZephonRayDataLoader.Config:
    return zephon_loader_config(kwargs.pop("recipe", None), **kwargs)
