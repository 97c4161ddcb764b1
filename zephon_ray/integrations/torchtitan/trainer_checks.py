"""What the trainer hands the loader must agree with the recipe: batch geometry and tokenizer.

TorchTitan 0.3.0 builds the loader with ``dp_world_size``, ``dp_rank``, ``tokenizer``, ``seq_len``,
``local_batch_size`` and ``snapshot_every_n_steps``; its own global batch is not among them. These checks run in
the loader's build (every route) and, for the ``--override.imports`` route, again when the override is applied
(see :mod:`zephon_ray.integrations.torchtitan.overrides`), so a mismatch fails before any model is built.

Guarantee: when these pass, one optimizer step consumes exactly one global batch (B rows, the recipe's), cut into
``grad_accum = B / (local_batch_size * dp)`` whole microbatches per rank, and the trainer's tokenizer maps text to
the same ids as the recipe's (same vocab size, same BOS/EOS (and PAD where the trainer's tokenizer defines one),
and the same ids for a fixed probe text). Tests: ``tests/test_torchtitan_trainer_checks.py``.

Limits: the probe is one short text, so two tokenizers that differ only on rare strings pass it (the vocab size
and special ids still have to match). A tokenizer object with no ``get_vocab_size`` is refused.
"""

from __future__ import annotations

from typing import Any

from zephon_ray.recipe import Recipe
from zephon_ray.tokenizers import build_tokenizer

TRAINER_DERIVES_GLOBAL_BATCH = -1
"""TorchTitan's ``training.global_batch_size = -1``: global batch = local_batch_size x dp (grad_accum 1)."""

TOKENIZER_PROBE = "zephon-ray tokenizer probe: Hello, world! 0123456789 naive cafe, naïve café; 日本語\n\tend."


class TrainerMismatchError(ValueError):
    """The trainer's geometry or tokenizer differs from the recipe's; the message names the setting to change."""


def check_geometry(recipe: Recipe, *, global_batch_size: int | None, local_batch_size: int, dp_world_size: int,
                   seq_len: int | None) -> int:
    """Return grad_accum (this rank's microbatches per step) or raise :class:`TrainerMismatchError`.

    ``global_batch_size``: the trainer's ``training.global_batch_size`` (``-1``: TorchTitan derives it as
    ``local_batch_size * dp``), or None when no trainer is involved (the loader then defines a step as B rows)."""
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
        how = (f" (training.global_batch_size is -1, so TorchTitan uses local_batch_size {lbs} x dp {world})"
               if global_batch_size == TRAINER_DERIVES_GLOBAL_BATCH else "")
        raise TrainerMismatchError(f"the trainer's global batch {trainer_batch}{how} differs from the recipe's "
                                   f"global batch of {B} rows ({where}); set training.global_batch_size = {B}")
    return B // (world * lbs)


def check_seq_len(recipe: Recipe, seq_len: int) -> None:
    if int(seq_len) != recipe.seq_len:
        raise TrainerMismatchError(f"training.seq_len {seq_len} differs from the recipe's seq_len {recipe.seq_len} "
                                   f"(recipe {recipe.describe()}); set training.seq_len = {recipe.seq_len}")


def check_global_batch_setting(recipe: Recipe, global_batch_size: int) -> None:
    """Config-time part of :func:`check_geometry` (the dp degree is not known yet): an explicit global batch."""
    B = recipe.global_batch_rows
    if global_batch_size != TRAINER_DERIVES_GLOBAL_BATCH and global_batch_size != B:
        raise TrainerMismatchError(
            f"training.global_batch_size {global_batch_size} differs from the recipe's global batch of {B} rows "
            f"(recipe {recipe.describe()}); one optimizer step must be one global batch: set "
            f"training.global_batch_size = {B}")


def check_tokenizer(recipe: Recipe, tokenizer: Any) -> None:
    """Raise :class:`TrainerMismatchError` unless TorchTitan's ``tokenizer`` agrees with the recipe's."""
    if tokenizer is None:
        return
    ours = build_tokenizer(recipe.tokenizer)
    where = f"the trainer's tokenizer ({_describe(tokenizer)}) and the recipe's ({recipe.tokenizer!r}, " \
            f"{recipe.describe()})"
    vocab = getattr(tokenizer, "get_vocab_size", None)
    if vocab is None:
        raise TrainerMismatchError(f"{where}: the trainer's tokenizer has no get_vocab_size(); cannot check it")
    if int(vocab()) != int(ours.vocab_size):
        raise TrainerMismatchError(f"{where} differ: vocab size {vocab()} != {ours.vocab_size}; point "
                                   "hf_assets_path at the recipe's tokenizer")
    for role, theirs_attr in (("bos", "bos_id"), ("eos", "eos_id"), ("pad", "pad_id")):
        theirs = getattr(tokenizer, theirs_attr, None)
        mine = getattr(ours, f"{role}_token_id", None)
        if theirs is not None and mine is not None and int(theirs) != int(mine):
            raise TrainerMismatchError(f"{where} differ: {role} id {theirs} != {mine}; point hf_assets_path at "
                                       "the recipe's tokenizer")
    try:
        theirs_ids = [int(i) for i in tokenizer.encode(TOKENIZER_PROBE, add_bos=False, add_eos=False)]
    except TypeError:
        return  # an encode() without TorchTitan's add_bos/add_eos keywords: vocab and special ids were checked
    mine_ids = [int(i) for i in ours(TOKENIZER_PROBE)["input_ids"]]
    if theirs_ids != mine_ids:
        first = next((i for i, (a, b) in enumerate(zip(theirs_ids, mine_ids)) if a != b),
                     min(len(theirs_ids), len(mine_ids)))
        raise TrainerMismatchError(f"{where} differ: they encode the probe text differently (first at token "
                                   f"{first}); point hf_assets_path at the recipe's tokenizer")


def _describe(tokenizer: Any) -> str:
    path = getattr(tokenizer, "tokenizer_path", None) or getattr(tokenizer, "name_or_path", None)
    return f"{type(tokenizer).__name__} from {path}" if path else type(tokenizer).__name__
