"""Service mode: read this reader's slice of every step from a running zephon-ray DataService.

The prefetch thread asks the service for steps ``s .. s+depth-1`` ahead of the trainer (the service's own
``prefetch`` keeps the requests in flight) and hands finished ``RankSlice`` objects to ``next`` through the bounded
queue, so ``next`` only waits when the service itself is behind. The slice arrays are copied out of the Ray
object store in that thread (they are read-only, zero-copy views there).

Read-ahead does not move this consumer's cursor on the service (``track=False``); the cursor moves when the
trainer actually takes a step. The service's window therefore trails what the trainer consumed, not what was
prefetched, so a resume from the last checkpoint finds its steps still in the live window.

``state()`` commits its boundary on the service (reader 0 only) and carries no checkpoint: the service keeps its
own Zephon state.

Limits: the service must run the same recipe (fingerprint checked at connect). Every reader of a job uses the same
consumer name (the run_id, or without one the service client's default, one per Ray job), so the service's window
follows the slowest rank and two jobs never share cursors.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from zephon_ray.batch import RankSlice
from zephon_ray.recipe import Recipe
from zephon_ray.stream.prefetch import PrefetchedSlices

log = logging.getLogger("zephon_ray")


class ServiceSlices(PrefetchedSlices):
    """This reader's slices of consecutive steps, read from a DataService (see the module docstring)."""

    reraise = (Exception,)  # service errors already name the service, the step and the cause

    def __init__(self, recipe: Recipe, *, rank: int, world: int, name: str, namespace: str, run_id: str | None,
                 depth: int, source_ids: bool = False) -> None:
        from zephon_ray.service.client import DataService

        super().__init__(rank=rank, world=world, depth=depth, name="service")
        self.recipe = recipe
        self.service = DataService.connect(name, namespace=namespace, consumer=run_id)  # None: one per Ray job
        served = self.service.recipe.fingerprint
        if served != recipe.fingerprint:
            raise ValueError(
                f"service {name!r} (namespace {namespace!r}) serves recipe fingerprint {served[:12]}, but this "
                f"loader uses {recipe.describe()}; start the loader with the service's recipe"
            )
        self._lock = threading.Lock()  # the client is used by one thread at a time
        self.source_ids = source_ids
        self._consumed: int | None = None
        self._touched: int | None = None

    def _on_reset(self, step: int, checkpoint: dict[str, Any] | None) -> None:
        self._consumed = self._touched = None

    def _on_next(self, step: int) -> None:
        self._consumed = step  # the prefetch thread moves the service cursor: an actor call costs ~1 ms here

    def _checkpoint(self, step: int, timeout: float) -> None:
        """Commit ``step`` on the service (reader 0 only); the service keeps its own Zephon state.

        A restarted service starts its live window at the newest commit. Committing when the state is taken
        (rather than after the write) is safe: an older resume point is still served, by replay."""
        if self.rank == 0:
            with self._lock:
                self._flush_cursor()  # the steps handed out so far are this reader's reads: the commit follows them
                self.service.commit(step)
        return None

    def _idle(self) -> None:
        self._flush_cursor()

    def _flush_cursor(self) -> None:
        step = self._consumed
        if step is None or step == self._touched:
            return
        self._touched = step
        self.service.touch(step, rank=self.rank, world=self.world)  # fire and forget

    def _produce(self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        s = step
        while not stop.is_set():
            self._flush_cursor()
            with self._lock:
                self.service.prefetch(range(s + 1, s + self.depth + 1), rank=self.rank, world=self.world)
                # The first read is tracked: it registers this rank's cursor and makes the service drop the
                # cursors this consumer left at another world size (a resized group never closed its loader).
                part = self.service.refs(s, rank=self.rank, world=self.world, track=s == step).slice(
                    self.rank, self.world)
            tokens, positions = np.array(part.tokens), np.array(part.positions)
            ids = None
            if self.source_ids:  # this process replays the step's provenance, checked against the rows read
                ids = self.service.provenance(s, self.rank, self.world, rows=(tokens, positions)).source_ids()
            yield RankSlice(s, self.rank, self.world, tokens, positions, part.pad_token_id, part.global_valid_tokens,
                            ids)
            s += 1

    def close(self) -> None:
        """Stop the reader thread and release this consumer's cursors on the service."""
        self.close_thread()
        try:
            with self._lock:
                self.service.release()
        except Exception as exc:  # noqa: BLE001 - the service may already be gone
            log.debug("ignored (%s): %r", "the service may already be gone", exc)
