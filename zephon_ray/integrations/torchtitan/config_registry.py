"""TorchTitan config registry: ``torchtitan.train --module zephon_ray.integrations.torchtitan --config <name>``.

Each function returns a ``Trainer.Config`` whose data loader is :class:`ZephonRayDataLoader`. The recipe fixes
the data, so the trainer's ``seq_len`` and global batch are taken from it (and checked by the loader).

    torchrun --nproc_per_node 8 -m torchtitan.train --module zephon_ray.integrations.torchtitan \\
        --config zephon_llama3_debugmodel --training.steps 100

Environment knobs read when the config is built (each can also be changed through the usual CLI overrides of the
TorchTitan fields it sets):

* ``ZEPHON_RAY_RECIPE``: recipe TOML or packaged recipe name (default ``tiny``, packaged with the wheel);
* ``ZEPHON_RAY_MODE``: ``local`` (default), ``service`` or ``dataset``; ``ZEPHON_RAY_RUN_ID`` (default
  ``zephon-llama3-debug``); ``ZEPHON_RAY_DATASET_DIR``: the materialised directory of dataset mode;
* ``ZEPHON_RAY_AGGREGATE_DIR``: aggregate local-mode checkpoints in a directory instead of ``torch://``;
* ``ZEPHON_RAY_SERVICE`` / ``ZEPHON_RAY_NAMESPACE``: the data service's name and namespace.

On a CPU-only torch (tests, examples) use ``--module examples.torchtitan_cpu --config
zephon_llama3_debugmodel_cpu`` from the repository root (``PYTHONPATH=.``): it installs the CPU shims and uses DDP
over gloo, and is not part of the wheel.

Limits: the configs are TorchTitan 0.3.0's llama3 debug model with the loader swapped in; another model takes the
``--override.imports`` route (:mod:`zephon_ray.integrations.torchtitan.overrides`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

from zephon_ray.batch import padded_rows
from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader
from zephon_ray.recipe import Recipe
from zephon_ray.stream.geometry import check_global_batch_setting, check_seq_len

DEFAULT_RECIPE = "tiny"  # the packaged tiny recipe (zephon_ray/recipes/tiny.toml)
BYTES_ASSETS = Path(__file__).resolve().parent / "assets" / "bytes"
DEFAULT_RUN_ID = "zephon-llama3-debug"


@dataclass(kw_only=True, slots=True)
class ZephonTrainerConfig(Trainer.Config):
    """``Trainer.Config`` that checks, when built (so after CLI overrides), that the trainer's batch geometry is
    the recipe's: ``training.seq_len`` and ``training.global_batch_size`` (one optimizer step = one global batch).
    The loader re-checks both, with ``local_batch_size``, the dp degree and the tokenizer, when TorchTitan builds
    it (:mod:`zephon_ray.stream.geometry`, :mod:`zephon_ray.integrations.torchtitan.trainer_checks`)."""

    def __post_init__(self) -> None:
        Trainer.Config.__post_init__(self)
        loader = self.dataloader
        if not isinstance(loader, ZephonRayDataLoader.Config):
            return
        recipe = Recipe.from_toml(loader.recipe)
        check_seq_len(recipe, self.training.seq_len)
        check_global_batch_setting(recipe, self.training.global_batch_size)
        # -1 (TorchTitan's "local_batch_size x dp") is checked by the loader's build, which knows the dp degree.
        loader.global_batch_size = self.training.global_batch_size


class ZephonTrainer(Trainer):
    """TorchTitan's ``Trainer`` (what a :class:`ZephonTrainerConfig` builds), plus one check at load: the step of
    the restored ``train_state`` is handed to the data loader, which refuses, before its first batch, a ``next_step``
    that differs, naming both numbers (a checkpoint loaded with ``exclude_from_loading = ["dataloader"]``, or a
    loader state from elsewhere, would skip or repeat steps). TorchTitan loads ``train_state`` and ``dataloader`` as
    separate entries of one DCP load, and the loader holds no reference to the trainer: this override is the public
    way to join them."""

    Config = ZephonTrainerConfig

    def __init__(self, config: ZephonTrainerConfig) -> None:
        super().__init__(config)
        register = getattr(self.dataloader, "register_trainer_step_check", None)
        if register is not None:
            register(type(self).__name__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        Trainer.load_state_dict(self, state_dict)
        expect = getattr(self.dataloader, "expect_trainer_step", None)
        if expect is not None:
            expect(int(self.step))


def hf_assets_for(recipe: Recipe) -> str:
    """The directory TorchTitan builds its tokenizer from (the loader itself never uses that tokenizer)."""
    if recipe.tokenizer == "bytes":
        return str(BYTES_ASSETS)
    return str(Path(recipe.tokenizer).parent)


def zephon_loader_config(recipe_path: str | Path | None = None, **overrides: Any) -> ZephonRayDataLoader.Config:
    recipe_path = str(recipe_path or os.environ.get("ZEPHON_RAY_RECIPE") or DEFAULT_RECIPE)
    kwargs: dict[str, Any] = dict(
        recipe=recipe_path,
        mode=os.environ.get("ZEPHON_RAY_MODE", "local"),
        service_name=os.environ.get("ZEPHON_RAY_SERVICE", "zephon-ray"),
        service_namespace=os.environ.get("ZEPHON_RAY_NAMESPACE", "zephon-ray"),
        run_id=os.environ.get("ZEPHON_RAY_RUN_ID", DEFAULT_RUN_ID),
        dataset_dir=os.environ.get("ZEPHON_RAY_DATASET_DIR"),
        aggregate_store="torch://",
    )
    kwargs.update(overrides)
    return ZephonRayDataLoader.Config(**kwargs)


def zephon_llama3_debugmodel() -> Trainer.Config:
    """The llama3 debug model trained on a zephon-ray recipe (accelerators; FSDP as TorchTitan defaults)."""
    loader = zephon_loader_config()
    recipe = Recipe.from_toml(loader.recipe)
    # WORLD_SIZE only picks a default local_batch_size for these pure-data-parallel configs (dp = world); the
    # loader itself takes the dp degree from TorchTitan's parallel dims and checks the geometry when built.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    B = recipe.global_batch_rows
    # At a dp degree that does not divide B the loader pads every rank to ceil(B/dp) rows (labels ignored), and the
    # trainer's global batch counts the padding rows: one microbatch of one row each, ceil(B/dp) of them per rank.
    trainer_batch = B if B % world == 0 else world * padded_rows(B, world)
    loader.global_batch_size = trainer_batch
    model_spec = model_registry("debugmodel")
    return ZephonTrainerConfig(
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        ),
        hf_assets_path=hf_assets_for(recipe),
        model_spec=model_spec,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=B // world if B % world == 0 else 1,
            global_batch_size=trainer_batch,
            seq_len=recipe.seq_len,
            steps=10,
        ),
        dataloader=loader,
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=0),
    )
