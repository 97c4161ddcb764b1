"""TorchTitan's tokenizer must agree with the recipe's (the batch-geometry checks are framework-free:
:mod:`zephon_ray.stream.geometry`).

TorchTitan 0.3.0 builds the loader with ``dp_world_size``, ``dp_rank``, ``tokenizer``, ``seq_len``,
``local_batch_size`` and ``snapshot_every_n_steps``. :func:`check_tokenizer` runs in the loader's build (every
route) and, for the ``--override.imports`` route, again when the override is applied (see
:mod:`zephon_ray.integrations.torchtitan.overrides`), so a mismatch fails before any model is built.

Guarantee: when it passes, the trainer's tokenizer maps text to the same ids as the recipe's (same vocab size, same
BOS/EOS (and PAD where the trainer's tokenizer defines one), and the same ids for a fixed probe text).

Limits: the probe is one short text, so two tokenizers that differ only on rare strings pass it (the vocab size
and special ids still have to match). A tokenizer object with no ``get_vocab_size`` is refused.
"""

from __future__ import annotations

from typing import Any

from zephon_ray.recipe import Recipe
from zephon_ray.stream.geometry import TrainerMismatchError
from zephon_ray.tokenizers import build_tokenizer

TOKENIZER_PROBE = "zephon-ray tokenizer probe: Hello, world! 0123456789 naive cafe, naïve café; 日本語\n\tend."


def check_tokenizer(recipe: Recipe, tokenizer: Any) -> None:
    """Raise :class:`TrainerMismatchError` unless TorchTitan's ``tokenizer`` agrees with the recipe's."""
    if tokenizer is None:
        return
    ours = build_tokenizer(recipe.tokenizer)
    where = (
        f"the trainer's tokenizer ({_describe(tokenizer)}) and the recipe's ({recipe.tokenizer!r}, {recipe.describe()})"
    )
    vocab = getattr(tokenizer, "get_vocab_size", None)
    if vocab is None:
        raise TrainerMismatchError(f"{where}: the trainer's tokenizer has no get_vocab_size(); cannot check it")
    if int(vocab()) != int(ours.vocab_size):
        raise TrainerMismatchError(
            f"{where} differ: vocab size {vocab()} != {ours.vocab_size}; point hf_assets_path at the recipe's tokenizer"
        )
    for role, theirs_attr in (("bos", "bos_id"), ("eos", "eos_id"), ("pad", "pad_id")):
        theirs = getattr(tokenizer, theirs_attr, None)
        mine = getattr(ours, f"{role}_token_id", None)
        if theirs is not None and mine is not None and int(theirs) != int(mine):
            raise TrainerMismatchError(
                f"{where} differ: {role} id {theirs} != {mine}; point hf_assets_path at the recipe's tokenizer"
            )
    try:
        theirs_ids = [int(i) for i in tokenizer.encode(TOKENIZER_PROBE, add_bos=False, add_eos=False)]
    except TypeError:
        return  # an encode() without TorchTitan's add_bos/add_eos keywords: vocab and special ids were checked
    mine_ids = [int(i) for i in ours(TOKENIZER_PROBE)["input_ids"]]
    if theirs_ids != mine_ids:
        first = next(
            (i for i, (a, b) in enumerate(zip(theirs_ids, mine_ids)) if a != b), min(len(theirs_ids), len(mine_ids))
        )
        raise TrainerMismatchError(
            f"{where} differ: they encode the probe text differently (first at token "
            f"{first}); point hf_assets_path at the recipe's tokenizer"
        )


def _describe(tokenizer: Any) -> str:
    path = getattr(tokenizer, "tokenizer_path", None) or getattr(tokenizer, "name_or_path", None)
    return f"{type(tokenizer).__name__} from {path}" if path else type(tokenizer).__name__
