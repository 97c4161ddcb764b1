"""Dataset mode: this reader's slice of every step, read from a materialised directory with pyarrow.

The prefetch thread (:class:`~zephon_ray.stream.prefetch.PrefetchedSlices`) reads steps ``s, s+1, ...``
from a :class:`~zephon_ray.formats.materialized.MaterializedSource` (one Parquet row group each, checked against the
manifest's digest) ahead of the trainer. Guarantee: the rows are the recipe's, or an error. No Zephon and no Ray run in the trainer: the source state carries no
checkpoint (the loader state's ``zephon`` is ""), so a run may switch between dataset, service and local mode at
any resume, at any W.

Limits: only materialised steps can be read; the step after the last one fails with a
:class:`~zephon_ray.formats.materialized.MaterializedError` naming the range (extend the directory with
``zephon-ray materialize``). The directory must have been materialised from the loader's recipe, or from it with
phases decided at run time, which its manifest records and the loader then records too (checked when the source is
built).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from zephon_ray.batch import RankSlice
from zephon_ray.formats.materialized import MaterializedError, MaterializedSource
from zephon_ray.recipe import Recipe
from zephon_ray.stream.prefetch import PrefetchedSlices


class DatasetSlices(PrefetchedSlices):
    """This reader's slices of consecutive steps, read from a materialised directory."""

    reraise = (MaterializedError,)  # names the directory and the step range already

    def __init__(
        self, recipe: Recipe, directory: str, *, rank: int, world: int, depth: int, source_ids: bool = False
    ) -> None:
        super().__init__(rank=rank, world=world, depth=depth, name="dataset")
        self.source = MaterializedSource(directory, recipe=recipe)
        self.recipe = self.source.recipe
        """The run's schedule: ``recipe``'s, with the run-time phases the directory was made under."""
        self.source_ids = source_ids
        self.source.batch(self.source.first_step).slice(rank, world)  # W must divide B: fail when built

    def _produce(self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        s = step
        while not stop.is_set():
            piece = self.source.slice(s, self.rank, self.world)
            if self.source_ids:  # recomputed from the recipe, checked against the rows read
                ids = self.source.provenance(s, self.rank, self.world, rows=(piece.tokens, piece.positions))
                piece = replace(piece, source_ids=ids.source_ids())
            yield piece
            s += 1

    def close(self) -> None:
        self.close_thread()
        self.source.close()
