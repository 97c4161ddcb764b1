"""Service mode: read this reader's slice of every step from a running zephon-ray DataService.

The prefetch thread asks the service for steps ``s .. s+depth-1`` ahead of the trainer (the service's own
``prefetch`` keeps the requests in flight) and hands finished ``RankSlice`` objects to ``next`` through the bounded
queue, so ``next`` only waits when the service itself is behind. The slice arrays are copied out of the Ray
object store in that thread (they are read-only, zero-copy views there).

Guarantee: the rows are the service's global batch s, the same as every other mode's. Read-ahead does not move this
consumer's cursor on the service (``track=False``); the cursor moves when the trainer actually takes a step. The
service's window therefore trails what the trainer consumed, not what was prefetched, so a resume from the last
checkpoint finds its steps still in the live window. Each step is read as ``DataService.slice`` reads it: lost
shards (a producer killed after the refs of steps ahead reached this process) are made again, and a coordinator
restart is waited out, within the service's ``reconnect_timeout_s`` and ``read_timeout_s``.

``state()`` commits its boundary on the service (reader 0 only) and carries no checkpoint: the service keeps its
own Zephon state.

The schedule travels with the run: the service may run phases it accepted while running (``add_phase``), and the
loader may carry phases its state recorded. At connect the two are joined: the reader takes the service's, and
phases the run recorded that the service lacks (a service started afresh) are added to it, durably; a phase it
can no longer take (it produced past its start) or one that contradicts the service's is one line. :meth:`sync_recipe`
picks up phases the service accepted since, for the state saved next.

Limits: the service must run the loader's recipe file, plus run-time phases (checked at connect). Every reader of a
job uses the same consumer name (the run_id, or without one the service client's default, one per Ray job), so the
service's window follows the slowest rank and two jobs never share cursors. Readers saving at the moment a phase is
added may record it or not (their states then differ in ``run_schedule``); a phase starts past every step served, so
both states resume the same batches up to it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from zephon_ray.batch import RankSlice
from zephon_ray.errors import best_effort
from zephon_ray.recipe import Recipe
from zephon_ray.stream.prefetch import PrefetchedSlices

log = logging.getLogger("zephon_ray")

JOIN_TIMEOUT_S = 120.0
"""How long a reader retries adding a recorded phase while other readers of the job add theirs."""


class ServiceSlices(PrefetchedSlices):
    """This reader's slices of consecutive steps, read from a DataService (see the module docstring)."""

    reraise = (Exception,)  # service errors already name the service, the step and the cause

    def __init__(
        self,
        recipe: Recipe,
        *,
        rank: int,
        world: int,
        name: str,
        namespace: str,
        run_id: str | None,
        depth: int,
        base: Recipe | None = None,
        source_ids: bool = False,
    ) -> None:
        """``recipe``: the run's schedule as this reader knows it (``base``, its recipe file, plus the phases its
        state recorded). ``source_ids``: give every slice its tokens' source ids (``LoaderConfig.source_ids``)."""
        from zephon_ray.service.client import DataService

        super().__init__(rank=rank, world=world, depth=depth, name="service")
        self.service = DataService.connect(name, namespace=namespace, consumer=run_id)  # None: one per Ray job
        self._where = f"service {name!r} (namespace {namespace!r})"
        self.base = recipe if base is None else base
        self._skips = recipe.skips  # the reader's own: a service serves data steps, whatever a run skips
        self._lock = threading.Lock()  # one cursor report at a time (_flush_cursor)
        self.source_ids = source_ids
        self.recipe = self._join(recipe)
        self._consumed: int | None = None
        self._touched: int | None = None

    def _join(self, recipe: Recipe) -> Recipe:
        """The run's schedule: the service's, which must be the recipe file's plus run-time phases, with the phases
        ``recipe`` recorded that the service lacks added to it (see the module docstring). Every reader of a job
        does this at once: a phase another reader is adding, or has added, is waited for, not added twice."""
        from zephon_ray.recipe import ScheduleError
        from zephon_ray.service.errors import ServiceError

        served = self._ours(self.service.recipe)
        if served.fingerprint == recipe.fingerprint:
            return recipe
        recorded = recipe.run_phases(self.base)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            try:
                if self.base.with_run_phases(served.run_phases(self.base)).fingerprint != served.fingerprint:
                    raise ScheduleError(
                        f"it serves recipe fingerprint {served.fingerprint[:12]}, not "
                        f"{self.base.describe()} plus phases added while running"
                    )
                joined = served.with_run_phases(recorded, what="this loader's run")
            except ScheduleError as exc:
                raise ValueError(f"{self._where}: {exc}; start the loader with the service's recipe") from None
            missing = joined.run_phases(served)
            if not missing:
                return joined
            phase = missing[0]  # recorded by the run, unknown to this service: its schedule too
            try:
                self.service.add_phase(phase["name"], phase["start_step"], phase["weights"])
                log.info(
                    "%s: added phase %r (from step %d) that the run recorded",
                    self._where,
                    phase["name"],
                    phase["start_step"],
                )
            except (ServiceError, ValueError) as exc:  # another reader's add_phase is in progress, or won
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"{self._where}: cannot add the run's phase {phase['name']!r} (from step "
                        f"{phase['start_step']}): {exc}"
                    ) from None
                time.sleep(0.2)
            served = self._ours(self.service.refresh_recipe())

    def sync_recipe(self, expect: Recipe | None = None) -> Recipe:
        """The service's schedule now (one control call), which keeps every phase this reader knew of."""
        served = self._ours(self.service.refresh_recipe())
        known = expect or self.recipe
        if known.run_phases(served):
            missing = ", ".join(f"'{p['name']}' from step {p['start_step']}" for p in known.run_phases(served))
            raise ValueError(f"{self._where} no longer runs phase(s) {missing} of this run's schedule")
        self.recipe = served
        return served

    def _ours(self, served: Recipe) -> Recipe:
        """The service's schedule with this reader's skips (a skip maps training steps to data steps: the reader's
        business, not the service's)."""
        from dataclasses import replace

        return replace(served, skips=self._skips)

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
        with self._lock:
            self._flush_cursor()

    def _flush_cursor(self) -> None:
        """(lock held) Report the step the trainer took last. Under the lock because a save must not find the
        report half made: marked as sent but not yet recorded by the client, its commit would count one step
        too few and be refused as ahead of what this reader was delivered."""
        step = self._consumed
        if step is None or step == self._touched:
            return
        self._touched = step
        self.service.advance(step, rank=self.rank, world=self.world)  # fire and forget

    def _produce(self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        s = step
        while not stop.is_set():
            with self._lock:
                self._flush_cursor()
            # The reads go outside the lock (the handle is thread-safe): a save's commit or close() must not wait
            # for a read-ahead, which may wait on the slowest rank's cursor (tests/test_stream_service.py).
            self.service.prefetch(range(s + 1, s + self.depth + 1), rank=self.rank, world=self.world)
            # The first read is tracked: it registers this rank's cursor and makes the service drop the cursors
            # this consumer left at another world size (a resized group never closed its loader).
            # slice(), not refs().slice(): it rides through lost shards and a coordinator restart
            part = self.service.slice(s, self.rank, self.world, track=s == step)
            tokens, positions = np.array(part.tokens), np.array(part.positions)
            ids = None
            if self.source_ids:  # this process replays the step's provenance, checked against the rows read
                ids = self.service.provenance(s, self.rank, self.world, rows=(tokens, positions)).source_ids()
            yield RankSlice(
                s, self.rank, self.world, tokens, positions, part.pad_token_id, part.global_valid_tokens, ids
            )
            s += 1

    def close(self) -> None:
        """Stop the reader thread and release this consumer's cursors on the service."""
        self.close_thread()
        with best_effort(log, "the service may already be gone"):
            self.service.release()
