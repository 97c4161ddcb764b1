"""What a trainer asks of the loader must agree with the recipe's batch geometry; framework-free checks.

Reader r of W holds rows ``[floor(r*B/W), floor((r+1)*B/W))`` of a B-row global batch (:func:`~zephon_ray.batch.
slice_bounds`), for any ``1 <= W <= B``: ``floor(B/W)`` or ``ceil(B/W)`` rows. A :class:`StepShape` says how those
rows are cut into trainer microbatches:

* **unpadded** (the default): the rank's own rows in microbatches of ``local_batch_size`` rows (0: one microbatch
  of all of them). When W does not divide B the ranks hold different row counts, so ``local_batch_size`` must
  divide both (only 1 does) and the ranks take different numbers of microbatches: fine for a loop that all-reduces
  once per step, not for a trainer with a fixed gradient accumulation.
* **padded** (``pad=True``): every rank's rows are padded to the same :func:`~zephon_ray.batch.padded_rows`
  (``ceil(B/W)`` rounded up to a multiple of ``local_batch_size``) with rows whose labels are all ignored, so every
  rank has equal shapes and microbatch counts (TorchTitan's fixed gradient accumulation, torch.compile, CUDA
  graphs). The padding never reaches the loss or a digest; :attr:`StepShape.padding_rows` is its cost.

Guarantee: when :func:`check_geometry` passes, one optimizer step consumes exactly one global batch (the recipe's B
real rows, plus padding rows when padded), with the recipe's seq_len. Each mismatch is one
:class:`TrainerMismatchError` line naming the setting to change, on every route (the TorchTitan
``--override.imports`` route checks at config time).

The trainer-facing names (``training.seq_len``, ``training.global_batch_size``) are TorchTitan's, which most
trainers share; -1 (:data:`TRAINER_DERIVES_GLOBAL_BATCH`) means "local_batch_size x W", as TorchTitan defaults. A
padded trainer's global batch is W x padded rows (B real rows plus the padding).
"""

from __future__ import annotations

from dataclasses import dataclass

from zephon_ray.batch import padded_rows, slice_bounds
from zephon_ray.recipe import Recipe

TRAINER_DERIVES_GLOBAL_BATCH = -1
"""``training.global_batch_size = -1``: global batch = local_batch_size x W (no gradient accumulation)."""


class TrainerMismatchError(ValueError):
    """The trainer's geometry (or tokenizer) differs from the recipe's; the message names the setting to change."""


@dataclass(frozen=True)
class StepShape:
    """How reader r of W cuts its rows of a step: ``local_batch_size`` rows per microbatch (0: one microbatch of
    the rank's rows), after padding them to ``padded_to`` rows (None: unpadded). Build it with
    :func:`check_geometry`."""

    global_rows: int
    world: int
    local_batch_size: int
    padded_to: int | None = None

    def rows(self, rank: int) -> int:
        """Real rows of reader ``rank`` (a pure function of B, W and the rank)."""
        lo, hi = slice_bounds(self.global_rows, rank, self.world)
        return hi - lo

    @property
    def padding_rows(self) -> int:
        """Padding rows per step over all W readers: the cost of equal shapes (0 when W divides B evenly)."""
        return 0 if self.padded_to is None else self.padded_to * self.world - self.global_rows

    def microbatch_rows(self, rank: int) -> int:
        return self.local_batch_size or self.padded_to or self.rows(rank)

    def microbatches(self, rank: int) -> int:
        """Microbatches reader ``rank`` takes per step."""
        return (self.padded_to or self.rows(rank)) // self.microbatch_rows(rank)

    @property
    def trainer_batch(self) -> int:
        """Rows one optimizer step holds over all readers: B, or W x padded rows when padded."""
        return self.global_rows if self.padded_to is None else self.padded_to * self.world


def check_geometry(
    recipe: Recipe,
    *,
    global_batch_size: int | None,
    local_batch_size: int,
    dp_world_size: int,
    seq_len: int | None,
    pad: bool = False,
) -> StepShape:
    """The :class:`StepShape` of W = ``dp_world_size`` readers, or raise :class:`TrainerMismatchError`.

    ``global_batch_size``: the trainer's ``training.global_batch_size`` (``-1``: derived as ``local_batch_size *
    W``), or None when no trainer is involved (a step is then B rows by definition, and unpadded ranks may take
    different numbers of microbatches)."""
    B = recipe.global_batch_rows
    where = f"recipe {recipe.describe()}"
    lbs, world = int(local_batch_size), int(dp_world_size)
    if seq_len is not None:
        check_seq_len(recipe, seq_len)
    if world < 1 or world > B:
        raise TrainerMismatchError(
            f"a data-parallel degree of {world} does not fit the recipe's global batch of {B} "
            f"rows ({where}): each of at most {B} readers needs at least one row"
        )
    if lbs < 0:
        raise TrainerMismatchError(f"local_batch_size must be >= 0 (0: one microbatch per step), got {lbs}")
    shape = StepShape(B, world, lbs, padded_rows(B, world, lbs or 1) if pad else None)
    low, high = B // world, -(-B // world)
    if not pad and lbs and (low % lbs or high % lbs):
        sizes = f"{low} rows" if low == high else f"{low} or {high} rows"
        raise TrainerMismatchError(
            f"local_batch_size {lbs} does not divide every reader's share of the recipe's global batch of {B} rows "
            f"over {world} readers ({sizes}; {where}); use a local_batch_size dividing it, or pad slices to equal "
            f"shapes (pad_slices = true: {padded_rows(B, world, lbs)} rows per reader)"
        )
    if global_batch_size is None:
        return shape
    if shape.padded_to is None and low != high:
        raise TrainerMismatchError(
            f"{world} readers hold {low} or {high} rows of the recipe's global batch of {B} rows ({where}), but a "
            "trainer with a global batch size needs the same microbatch count on every reader: pad slices to equal "
            f"shapes (pad_slices = true)"
        )
    derived = global_batch_size == TRAINER_DERIVES_GLOBAL_BATCH
    trainer_batch = (lbs or shape.microbatch_rows(0)) * world if derived else int(global_batch_size)
    if trainer_batch != shape.trainer_batch:
        how = (
            f" (training.global_batch_size is -1, so the trainer uses local_batch_size {lbs} x dp {world})"
            if derived
            else ""
        )
        padding = (
            f" = {B} rows + {shape.padding_rows} padding rows ({shape.padded_to} per reader, labels ignored)"
            if shape.padding_rows
            else ""
        )
        raise TrainerMismatchError(
            f"the trainer's global batch {trainer_batch}{how} differs from the recipe's "
            f"global batch of {B} rows at dp {world} ({where}); set "
            f"training.global_batch_size = {shape.trainer_batch}{padding}"
        )
    return shape


def check_seq_len(recipe: Recipe, seq_len: int) -> None:
    if int(seq_len) != recipe.seq_len:
        raise TrainerMismatchError(
            f"training.seq_len {seq_len} differs from the recipe's seq_len {recipe.seq_len} "
            f"(recipe {recipe.describe()}); set training.seq_len = {recipe.seq_len}"
        )


def check_global_batch_setting(recipe: Recipe, global_batch_size: int) -> None:
    """Config-time part of :func:`check_geometry` (W is not known yet): an explicit global batch is the recipe's B,
    or more (B rows plus padding rows at a dp degree that does not divide B; checked exactly when W is known)."""
    B = recipe.global_batch_rows
    if global_batch_size != TRAINER_DERIVES_GLOBAL_BATCH and global_batch_size < B:
        raise TrainerMismatchError(
            f"training.global_batch_size {global_batch_size} is smaller than the recipe's global batch of {B} rows "
            f"(recipe {recipe.describe()}); one optimizer step must be one global batch: set "
            f"training.global_batch_size = {B} (or B plus padding rows at a dp degree that does not divide it)"
        )
