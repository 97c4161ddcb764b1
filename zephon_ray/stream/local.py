"""Local mode: this reader runs Zephon for its own lanes (one lane group) and assembles its slice in-process.

Guarantee: with W dividing L, reader r is lane group r of W, owning lanes [r*L/W, (r+1)*L/W) (Zephon's contiguous
mapping), and its rows of step s are those lanes' shards in lane order, which is exactly ``GlobalBatch.slice(r, W)``:
the same rows that the data service and ``zephon-ray digest`` give.

The prefetch thread runs up to ``depth`` steps ahead. Every ``checkpoint_every`` steps (0: never) it takes a Zephon
checkpoint at the step boundary b, collective across the W readers when W > 1 (Zephon merges the lanes through the
TCPStore or the directory, and every reader receives the same merged state: measured, for both). It waits at b
until ``next`` has handed out step b-1, so a collective only starts when every reader is there, never
speculatively while a peer may be shutting down; that costs one step of read-ahead every ``checkpoint_every``
steps. ``state()`` at boundary s carries the newest checkpoint at or before s (key ``checkpoint``); a reset with it
restores that checkpoint and replays the steps up to s, the same restore-and-replay rule as the service's.

Storage faults: a pipeline's first step (where Zephon opens its storage) waits an outage out within the storage
budget. A later read that fails past Zephon's own retries is made again from the newest kept checkpoint, within the
same budget, by a reader that is the run's only lane group (W = 1); with W > 1 it fails the read, since Zephon's
collective checkpoints need every reader to restore the same checkpoint together (the trainer resumes from its own).

Limits: a collective checkpoint blocks until every rank reaches it (Zephon's aggregate timeout, 120 s), so ranks must
consume in lock-step (they do: every optimizer step needs every rank). Resuming between checkpoints replays up to
``checkpoint_every - 1`` steps (or every step since the start, when checkpoints are off).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

from zephon_ray import storage
from zephon_ray.batch import RankSlice, lane_span, valid_tokens
from zephon_ray.checks import check_int
from zephon_ray.errors import one_line
from zephon_ray.identity import verify_on_node
from zephon_ray.lanes import LaneShard, LaneStepper, StepStateError, check_step_state, first_step
from zephon_ray.pipeline import LaneGroup
from zephon_ray.provenance import ProvenanceStepper, rows_source_ids
from zephon_ray.recipe import Recipe
from zephon_ray.source import fixed_valid_tokens, pad_token_id
from zephon_ray.stream.prefetch import PrefetchedSlices

_KEEP_CHECKPOINTS = 4

log = logging.getLogger(__name__)


class LocalSlices(PrefetchedSlices):
    """This reader's slices of consecutive steps from an in-process Zephon lane group (see the module docstring)."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        rank: int,
        world: int,
        lane_group: LaneGroup,
        depth: int,
        checkpoint_every: int,
        source_ids: bool = False,
    ) -> None:
        super().__init__(rank=rank, world=world, depth=depth, name="local")
        # Identity is proven where the data is read, since each rank reads its own shards with its own tokenizer and
        # libraries: a node that differs from the driver's must fail here, not train on other rows.
        verify_on_node(recipe, where=f"local-mode rank {rank} of {world}")
        if recipe.lanes % self.world:
            raise ValueError(
                f"local mode needs the reader count to divide the recipe's {recipe.lanes} lanes, got "
                f"{self.world} ({recipe.describe()})"
            )
        if (lane_group.index, lane_group.count) not in ((self.rank, self.world), (0, 1) if self.world == 1 else None):
            raise ValueError(
                f"reader {self.rank} of {self.world} must be lane group {self.rank} of {self.world}, "
                f"got lane group {lane_group.index} of {lane_group.count}"
            )
        check_int("checkpoint_every", checkpoint_every, low=0)
        self.recipe = recipe
        self.lane_group = lane_group
        self.checkpoint_every = checkpoint_every
        self.source_ids = source_ids
        self._pad = pad_token_id(recipe)
        self._valid = fixed_valid_tokens(recipe)
        self._cond = threading.Condition()
        self._checkpoints: OrderedDict[int, dict[str, Any] | None] = OrderedDict()
        self._producing = -1
        self._start_step = 0
        self._consumer_next = 0
        self._stepper: LaneStepper | None = None

    # ------------------------------------------------------------------ hooks of the prefetch thread
    def _on_reset(self, step: int, checkpoint: dict[str, Any] | None) -> None:
        """``checkpoint``: a merged Zephon checkpoint taken at or before ``step`` (None: replay from step 0)."""
        if checkpoint is not None:
            check_step_state(checkpoint, self.recipe)  # early: another recipe or a mid-step state fails here
            if int(checkpoint["next_step"]) > step:
                raise StepStateError(
                    f"the Zephon checkpoint is at step {checkpoint['next_step']}, after the reset step {step}"
                )
        self._checkpoints = OrderedDict()
        self._start_step = step
        self._producing = step
        self._consumer_next = step
        if checkpoint is not None:
            self._checkpoints[int(checkpoint["next_step"])] = checkpoint
        else:
            self._checkpoints[0] = None  # a fresh pipeline is the step-0 state

    def _on_next(self, step: int) -> None:
        """``next`` handed out ``step``: a checkpoint at the boundary ``step + 1`` may be taken."""
        with self._cond:
            if step + 1 > self._consumer_next:
                self._consumer_next = step + 1
                self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _due(self, step: int) -> bool:
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0 and step != self._start_step

    def _checkpoint(self, step: int, timeout: float) -> dict[str, Any] | None:
        """The newest merged Zephon checkpoint at or before ``step`` (None: the step-0 state).

        Waits until the producer has passed the boundary of ``step``, so every reader picks the same checkpoint."""
        due = self._due(step)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._error is not None
                    or step in self._checkpoints
                    or self._producing > step
                    or (not due and self._producing >= step)
                ),
                timeout,
            )
            kept = [s for s in self._checkpoints if s <= step]
            if ok and self._error is None and kept:
                return self._checkpoints[max(kept)]
        if self._error is not None:
            raise self._failure(step) from self._error
        if not ok:
            raise TimeoutError(f"rank {self.rank}: the producer did not reach step {step} within {timeout:.0f} s")
        raise StepStateError(
            f"no Zephon checkpoint at or before step {step} is kept any more (kept: {sorted(self._checkpoints)}); "
            f"(prefetch {self.depth}, checkpoint every {self.checkpoint_every} steps)"
        )

    # ------------------------------------------------------------------ producer thread
    def _produce(self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        stepper, shards = self._open(step, checkpoint, stop)
        try:
            while True:
                yield self._slice(stepper, step, shards)
                step += 1
                self._set_producing(step)
                if stop.is_set():
                    return
                if self._due(step) and step not in self._checkpoints:  # (taken already when step was rebuilt)
                    with self._cond:  # wait until this reader's trainer took step - 1
                        while not stop.is_set() and self._consumer_next < step:
                            self._cond.wait(0.2)  # this reader's own trainer; close() sets stop
                    if stop.is_set():
                        return
                    checkpoint = stepper.checkpoint()  # collective when world > 1
                    with self._cond:
                        self._checkpoints[step] = checkpoint
                        while len(self._checkpoints) > _KEEP_CHECKPOINTS:
                            self._checkpoints.popitem(last=False)
                        self._cond.notify_all()
                try:
                    shards = stepper.next_step()
                except Exception as exc:
                    # Only a reader that is the one lane group makes a step again on its own: Zephon's collective
                    # checkpoints need every group of a run to restore the same checkpoint together (a group
                    # restored alone would take its next round in another namespace than its peers).
                    if self.world > 1 or not (storage.is_transient(exc) or storage.misreported_missing(exc)):
                        raise
                    # Zephon's own retries gave up (an outage longer than they last, while a shard is fetched): the
                    # step is made again from the newest kept checkpoint, the storage budget waited out (_open).
                    at, checkpoint = self._newest_kept(step)
                    log.warning(
                        "local-mode rank %d of %d at step %d: %s; making it again from the checkpoint at step %d",
                        *(self.rank, self.world, step, one_line(exc, 300), at),
                    )
                    stepper.close(background=True)
                    stepper, shards = self._open(step, checkpoint, stop)
        finally:
            stepper.close(background=True)

    def _open(
        self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event
    ) -> tuple[LaneStepper, dict[int, LaneShard]]:
        """A stepper restored from ``checkpoint`` (None: a fresh pipeline) that has made ``step`` (the steps between
        replayed: batch s is a pure function of s), and that step's shards. Zephon opens its storage at a pipeline's
        first step, so an outage is waited out there and during the replay (``first_step``)."""

        def build() -> LaneStepper:
            # With source ids this reader's lane group runs the provenance-mode pipeline: the same rows, with each
            # token's document (zephon_ray.provenance).
            stepper = (
                ProvenanceStepper(self.recipe, self.lane_group)
                if self.source_ids
                else LaneStepper(self.recipe, self.lane_group)
            )
            if isinstance(stepper, ProvenanceStepper):
                stepper.collect_from = step  # documents for the steps handed out, not those replayed
            # Every reader's checkpoints record every lane's position (so a phase added while running can start
            # from them), and their exchange checks that the readers agree on the whole schedule (zephon_ray.lanes).
            stepper.keep_positions = True
            try:
                if checkpoint is not None:
                    stepper.restore(checkpoint)
            except BaseException:
                stepper.close()
                raise
            return stepper

        what = f"local-mode rank {self.rank} of {self.world} at step {step}"
        stepper, shards = first_step(build, what, stop=stop, through=step)
        self._stepper = stepper
        return stepper, shards

    def _newest_kept(self, step: int) -> tuple[int, dict[str, Any] | None]:
        """The newest kept checkpoint at or before ``step``, and its step. One always exists: the reset's own is
        dropped only for a newer one, and every kept one is at or before the step being made."""
        with self._cond:
            at = max(s for s in self._checkpoints if s <= step)
            return at, self._checkpoints[at]

    def _slice(self, stepper: LaneStepper, step: int, shards: dict[int, LaneShard]) -> RankSlice:
        """This reader's slice of ``step`` from its lane group's ``shards``."""
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, self.rank, self.world)
        if sorted(shards) != list(span.lanes):  # Zephon's lane mapping must be the slicing's
            raise StepStateError(
                f"step {step}: this Zephon lane group produced lanes {sorted(shards)}, but "
                f"reader {self.rank} of {self.world} reads lanes {list(span.lanes)}"
            )
        piece = RankSlice.from_lanes(
            step, self.rank, self.world, span, [shards[l] for l in span.lanes], self._pad, self._valid
        )
        if self._valid is None and self.world == 1:  # a padding packer: this reader holds every row
            piece = replace(piece, global_valid_tokens=valid_tokens(piece.tokens, self._pad))
        if self.source_ids:
            pieces = cast(ProvenanceStepper, stepper).pieces  # source_ids: a ProvenanceStepper
            ids = rows_source_ids(
                [row for lane in span.lanes for row in pieces[lane]],
                self.recipe.source_names,
                self.recipe.row_length,
            )
            piece = replace(piece, source_ids=ids[span.lo : span.hi])
        return piece

    def adopt(self, recipe: Recipe, start_step: int) -> None:
        """Run under ``recipe`` from now on: this one's schedule with a phase added from ``start_step``, which the
        producer must not have begun (``Loader.add_phase`` asks for a step past what it can have made). The producer
        looks the schedule up at each step, so the swap takes effect at the phase's start."""
        with self._cond:
            if self._producing >= start_step:
                raise ValueError(
                    f"a phase from step {start_step}: this reader's producer has begun step {self._producing} already"
                )
            self.recipe = recipe
            if self._stepper is not None:
                self._stepper.recipe = recipe

    def _set_producing(self, step: int) -> None:
        with self._cond:
            self._producing = step
            self._cond.notify_all()
