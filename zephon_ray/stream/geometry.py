"""What a trainer asks of the loader must agree with the recipe's batch geometry; framework-free checks.

Guarantee: when :func:`check_geometry` passes, one optimizer step consumes exactly one global batch (B rows, the
recipe's), cut into ``grad_accum = B / (local_batch_size * W)`` whole trainer microbatches per reader, with the
recipe's seq_len. Each mismatch is one :class:`TrainerMismatchError` line naming the setting to change. Tests:
``tests/test_torchtitan_loader.py`` (seq_len, W, global batch, -1), ``tests/test_torchtitan_overrides.py`` (the
config-time checks on TorchTitan's ``--override.imports`` route), ``tests/test_stream_loader.py`` (bad numbers).

The trainer-facing names (``training.seq_len``, ``training.global_batch_size``) are TorchTitan's, which most
trainers share; -1 (:data:`TRAINER_DERIVES_GLOBAL_BATCH`) means "local_batch_size x W", as TorchTitan defaults.
"""

from __future__ import annotations

from typing import Any

from zephon_ray.recipe import Recipe

TRAINER_DERIVES_GLOBAL_BATCH = -1
"""``training.global_batch_size = -1``: global batch = local_batch_size x W (no gradient accumulation)."""


class TrainerMismatchError(ValueError):
    """The trainer's geometry (or tokenizer) differs from the recipe's; the message names the setting to change."""


def check_int(name: str, value: Any, *, low: int, high: int = 10**12) -> int:
    """``value`` as an int in [low, high], or one ValueError naming ``name`` and the value (None, bool, 2.5, ...)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def check_geometry(recipe: Recipe, *, global_batch_size: int | None, local_batch_size: int, dp_world_size: int,
                   seq_len: int | None) -> int:
    """Return grad_accum (this reader's microbatches per step) or raise :class:`TrainerMismatchError`.

    ``global_batch_size``: the trainer's ``training.global_batch_size`` (``-1``: derived as ``local_batch_size *
    W``), or None when no trainer is involved (a step is then B rows by definition)."""
    B = recipe.global_batch_rows
    where = f"recipe {recipe.describe()}"
    lbs, world = int(local_batch_size), int(dp_world_size)
    if seq_len is not None:
        check_seq_len(recipe, seq_len)
    if lbs < 1 or world < 1 or B % (world * lbs):
        raise TrainerMismatchError(
            f"local_batch_size {lbs} x data-parallel degree {world} = {lbs * world} does not divide the recipe's "
            f"global batch of {B} rows ({where}); grad_accum = B / (local_batch_size * dp) must be whole")
    if global_batch_size is None:
        return B // (world * lbs)
    trainer_batch = lbs * world if global_batch_size == TRAINER_DERIVES_GLOBAL_BATCH else int(global_batch_size)
    if trainer_batch != B:
        how = (f" (training.global_batch_size is -1, so the trainer uses local_batch_size {lbs} x dp {world})"
               if global_batch_size == TRAINER_DERIVES_GLOBAL_BATCH else "")
        raise TrainerMismatchError(f"the trainer's global batch {trainer_batch}{how} differs from the recipe's "
                                   f"global batch of {B} rows ({where}); set training.global_batch_size = {B}")
    return B // (world * lbs)


def check_seq_len(recipe: Recipe, seq_len: int) -> None:
    if int(seq_len) != recipe.seq_len:
        raise TrainerMismatchError(f"training.seq_len {seq_len} differs from the recipe's seq_len {recipe.seq_len} "
                                   f"(recipe {recipe.describe()}); set training.seq_len = {recipe.seq_len}")


def check_global_batch_setting(recipe: Recipe, global_batch_size: int) -> None:
    """Config-time part of :func:`check_geometry` (W is not known yet): an explicit global batch."""
    B = recipe.global_batch_rows
    if global_batch_size != TRAINER_DERIVES_GLOBAL_BATCH and global_batch_size != B:
        raise TrainerMismatchError(
            f"training.global_batch_size {global_batch_size} differs from the recipe's global batch of {B} rows "
            f"(recipe {recipe.describe()}); one optimizer step must be one global batch: set "
            f"training.global_batch_size = {B}")
