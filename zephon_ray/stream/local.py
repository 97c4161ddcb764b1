"""Local mode: this rank runs Zephon for its own lanes and assembles its slice of every step in-process.

Guarantee: with W dividing L, rank r owns lanes [r*L/W, (r+1)*L/W) (Zephon's contiguous mapping) and its rows of
step s are those lanes' shards in lane order, which is exactly ``GlobalBatch.slice(r, W)``: the same rows that the
data service and ``zephon-ray digest`` give.

A background thread runs up to ``depth`` steps ahead. Every ``checkpoint_every`` steps (0: never) it takes a Zephon
checkpoint at the step boundary b, collective across the W ranks when W > 1 (Zephon merges the lanes through the
TCPStore or the directory, and every rank receives the same merged state: measured, for both). It waits at b until
this rank's trainer has consumed step b-1, so a collective only starts when every rank is there (and is asked
for: a checkpoint follows the step), never speculatively while a peer may be shutting down; that costs one step
of read-ahead every ``checkpoint_every`` steps. ``state_dict`` at step s hands out the newest checkpoint at or before
s; a resume restores it and replays the steps up to s, the same restore-and-replay rule as the service's.

Limits: a collective checkpoint blocks until every rank reaches it (Zephon's aggregate timeout, 120 s), so ranks must
consume in lock-step (they do: every optimizer step needs every rank). Resuming between checkpoints replays up to
``checkpoint_every - 1`` steps (or every step since the start, when checkpoints are off).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from zephon_ray.batch import RankSlice, lane_span
from zephon_ray.identity import verify_on_node
from zephon_ray.lanes import LaneStepper, StepStateError
from zephon_ray.pipeline import LaneGroup
from zephon_ray.recipe import Recipe
from zephon_ray.source import pad_token_id
from zephon_ray.stream.prefetch import PrefetchedSlices

_KEEP_SNAPSHOTS = 4


class LocalSlices(PrefetchedSlices):
    """Produce ``RankSlice`` objects for consecutive steps from an in-process Zephon rank."""

    def __init__(self, recipe: Recipe, *, rank: int, world: int, lane_group: LaneGroup, depth: int,
                 checkpoint_every: int) -> None:
        super().__init__(rank=rank, world=world, depth=depth, name="local")
        # Identity is proven where the data is read (issue 7): this rank's shards, tokenizer and libraries.
        verify_on_node(recipe, where=f"local-mode rank {rank} of {world}")
        self.recipe = recipe
        self.lane_group = lane_group
        self.checkpoint_every = checkpoint_every
        self._pad = pad_token_id(recipe)
        self._cond = threading.Condition()
        self._checkpoints: OrderedDict[int, dict[str, Any] | None] = OrderedDict()
        self._producing = -1
        self._start_step = 0
        self._consumer_next = 0

    # ------------------------------------------------------------------ SliceSource
    def _on_start(self, step: int, resume: dict[str, Any] | None) -> None:
        """``resume``: a merged Zephon checkpoint taken at or before ``step`` (None: replay from step 0)."""
        self._checkpoints = OrderedDict()
        self._start_step = step
        self._producing = step
        self._consumer_next = step
        if resume is not None:
            self._checkpoints[int(resume["next_step"])] = resume
        else:
            self._checkpoints[0] = None  # a fresh pipeline is the step-0 state

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def advance(self, next_step: int) -> None:
        """The trainer finished every step before ``next_step``: checkpoints up to it may be taken."""
        with self._cond:
            if next_step > self._consumer_next:
                self._consumer_next = next_step
                self._cond.notify_all()

    def _due(self, step: int) -> bool:
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0 and step != self._start_step

    def state(self, step: int, timeout: float) -> dict[str, Any] | None:
        """The newest merged Zephon checkpoint at or before ``step`` (None: the step-0 state).

        Waits until the producer has passed the boundary of ``step``, so every rank picks the same checkpoint."""
        due = self._due(step)
        self.advance(step)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or step in self._checkpoints or self._producing > step
                or (not due and self._producing >= step),
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
    def _produce(self, step: int, resume: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, self.rank, self.world)
        stepper = LaneStepper(self.recipe, self.lane_group)
        try:
            if resume is not None:
                stepper.restore(resume)
            while stepper.position < step and not stop.is_set():
                stepper.next_step()  # restore-and-replay: batch s is a pure function of s (see the loader's stats)
            while not stop.is_set():
                s = stepper.position
                self._set_producing(s)
                if self._due(s):
                    with self._cond:  # wait for this rank's trainer to reach the boundary
                        while not stop.is_set() and self._consumer_next < s:
                            self._cond.wait(0.2)
                    if stop.is_set():
                        return
                    checkpoint = stepper.checkpoint()  # collective when world > 1
                    with self._cond:
                        self._checkpoints[s] = checkpoint
                        while len(self._checkpoints) > _KEEP_SNAPSHOTS:
                            self._checkpoints.popitem(last=False)
                        self._cond.notify_all()
                shards = stepper.next_step()
                if sorted(shards) != list(span.lanes):  # Zephon's lane mapping must be the slicing's
                    raise StepStateError(f"step {s}: this Zephon rank produced lanes {sorted(shards)}, but rank "
                                         f"{self.rank} of {self.world} reads lanes {list(span.lanes)}")
                yield RankSlice.from_lanes(s, self.rank, self.world, span, [shards[l] for l in span.lanes],
                                           self._pad)
                self._set_producing(s + 1)
        finally:
            stepper.close(background=True)

    def _set_producing(self, step: int) -> None:
        with self._cond:
            self._producing = step
            self._cond.notify_all()
