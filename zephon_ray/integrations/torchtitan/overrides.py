"""The ``--override.imports`` route: put :class:`ZephonRayDataLoader` into any stock TorchTitan config.

    torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --training.seq_len 64 --training.global_batch_size 16 --training.local_batch_size 2 \\
        --override.imports 'zephon_ray.integrations.torchtitan.overrides.zephon_dataloader={"recipe": "recipes/tiny.toml"}'

The factory replaces the trainer's ``dataloader`` node only (not a validator's). A second factory,
:func:`zephon_checkpoint`, replaces the stock checkpoint manager by :class:`ZephonCheckpointManager`, which hands the
restored ``train_state`` step to the loader: a resume whose weights and loader state are from different steps (a
checkpoint loaded with ``--checkpoint.exclude_from_loading dataloader``, say) then stops before its first batch,
naming both. List both for the check; with the loader alone, the loader warns once at its first batch that
nothing checks it::

    --override.imports 'zephon_ray.integrations.torchtitan.overrides.zephon_dataloader={"recipe": "tiny"}' \
        zephon_ray.integrations.torchtitan.overrides.zephon_checkpoint

Keyword arguments (the JSON object) are :class:`ZephonRayDataLoader.Config` fields; unset ones come from the same environment variables as
the config registry (``ZEPHON_RAY_RECIPE``, ``ZEPHON_RAY_MODE``, ``ZEPHON_RAY_RUN_ID``, ...).

TorchTitan hands an override factory only the node it replaces, and never passes its global batch to the loader.
So the factory reads the trainer config that ``apply_overrides`` is applying it to (its ``config_root``), and
checks there, before any model is built: ``training.seq_len`` and ``training.global_batch_size`` against the
recipe (-1, TorchTitan's default, is checked against ``local_batch_size x dp`` when the loader is built), and the
tokenizer that TorchTitan will build from ``hf_assets_path`` against the recipe's. It copies the global batch
into the loader config, whose build checks the whole geometry again with the dp degree. Each mismatch is one
:class:`~zephon_ray.integrations.torchtitan.trainer_checks.TrainerMismatchError` line.

Limits: the trainer config is found by walking up to TorchTitan 0.3.0's ``apply_overrides`` frame, TorchTitan's
private internals fenced in :mod:`zephon_ray.integrations.torchtitan.internals`; if a future TorchTitan applies
overrides another way, the factory says so rather than skipping the checks (the loader's build still checks
everything but an explicit global batch). This route cannot install the CPU shims early enough (TorchTitan picks
its device before overrides are applied), so on a CPU-only torch use the examples' ``*_cpu`` configs
(``--module examples.torchtitan_cpu``) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from torchtitan.components.checkpoint import TRAIN_STATE, CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.config.override import derive, override

from zephon_ray.integrations.torchtitan.config_registry import zephon_loader_config
from zephon_ray.integrations.torchtitan.internals import trainer_config_being_overridden
from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader
from zephon_ray.integrations.torchtitan.trainer_checks import check_tokenizer
from zephon_ray.recipe import Recipe
from zephon_ray.stream.geometry import TrainerMismatchError, check_global_batch_setting, check_seq_len


@override(
    target=BaseDataLoader.Config,
    fqns=["dataloader"],
    description="zephon-ray: deterministic global batches that survive any change of dp degree",
)
def zephon_dataloader(cfg: BaseDataLoader.Config, **kwargs: Any) -> ZephonRayDataLoader.Config:
    loader = zephon_loader_config(kwargs.pop("recipe", None), **kwargs)
    trainer_config = trainer_config_being_overridden()
    check_trainer_config(trainer_config, loader)
    loader.global_batch_size = trainer_config.training.global_batch_size
    return loader


def check_trainer_config(trainer_config: Any, loader: ZephonRayDataLoader.Config) -> None:
    """Check a TorchTitan ``Trainer.Config`` against the loader's recipe: seq_len, global batch, tokenizer."""
    recipe = Recipe.from_toml(loader.recipe)
    training = trainer_config.training
    check_global_batch_setting(recipe, training.global_batch_size)
    check_seq_len(recipe, training.seq_len)
    try:
        tokenizer = trainer_config.tokenizer.build(tokenizer_path=trainer_config.hf_assets_path)
    except Exception as exc:  # noqa: BLE001 - TorchTitan raises several types for a missing/bad tokenizer
        raise TrainerMismatchError(
            f"cannot build the trainer's tokenizer from hf_assets_path "
            f"{trainer_config.hf_assets_path!r} to check it against the recipe "
            f"{recipe.describe()}: {type(exc).__name__}: {exc}"
        ) from None
    check_tokenizer(recipe, tokenizer)


class ZephonCheckpointManager(CheckpointManager):
    """TorchTitan's DCP ``CheckpointManager`` that, after a load, hands the restored trainer step to the zephon-ray
    loader (``ZephonRayDataLoader.expect_trainer_step``): the loader refuses, before its first batch, a ``next_step``
    other than that step, naming both numbers. The check the config registry's ``ZephonTrainer`` makes, for a stock
    ``Trainer`` on the ``--override.imports`` route (``Trainer.load_state_dict`` has no hook; the checkpoint manager
    is a ``Configurable`` that an override can replace, and it holds both the trainer and the loader)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # its own Config: build() makes this class
        pass

    def __init__(self, config: Config, *, dataloader: Any, states: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(config, dataloader=dataloader, states=states, **kwargs)
        self._zr_loader, self._zr_trainer = dataloader, states.get(TRAIN_STATE)
        register = getattr(dataloader, "register_trainer_step_check", None)
        if register is not None:
            register(type(self).__name__)

    def _load(self, step: int = -1) -> bool:
        loaded: bool = super()._load(step)
        expect = getattr(self._zr_loader, "expect_trainer_step", None)
        trainer_step = getattr(self._zr_trainer, "step", None)
        if loaded and expect is not None and trainer_step is not None:
            expect(int(trainer_step))
        return loaded


@override(
    target=CheckpointManager.Config,
    fqns=["checkpoint"],
    exact=True,
    description="zephon-ray: check the restored trainer step against the data loader's next_step",
)
def zephon_checkpoint(cfg: CheckpointManager.Config) -> ZephonCheckpointManager.Config:
    return cast(ZephonCheckpointManager.Config, derive(cfg, ZephonCheckpointManager.Config))
