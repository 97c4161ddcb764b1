"""Local mode: this rank runs Zephon for its own lanes and assembles its slice of every step in-process.

Guarantee: with W dividing L, rank r owns lanes [r*L/W, (r+1)*L/W) (Zephon's contiguous mapping) and its rows of
step s are those lanes' shards in lane order, which is exactly ``GlobalBatch.slice(r, W)``: the same rows that the
data service and ``zephon-ray digest`` give.

A background thread runs up to ``depth`` steps ahead. Every ``snapshot_every`` steps (0: never) it takes a Zephon
checkpoint at the step boundary b, collective across the W ranks when W > 1 (Zephon merges the lanes through the
TCPStore or the directory, and every rank receives the same merged state: measured, for both). It waits at b until
this rank's trainer has consumed step b-1, so a collective only starts when every rank is there (and is asked
for: a checkpoint follows the step), never speculatively while a peer may be shutting down; that costs one step
of read-ahead every ``snapshot_every`` steps. ``state_dict`` at step s hands out the newest snapshot at or before
s; a resume restores it and replays the steps up to s, the same restore-and-replay rule as the service's.

Limits: a collective snapshot blocks until every rank reaches it (Zephon's aggregate timeout, 120 s), so ranks must
consume in lock-step (they do: every optimizer step needs every rank). Resuming between snapshots replays up to
``snapshot_every - 1`` steps (or every step since the start, when snapshots are off).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from zephon_ray.batch import RankSlice
from zephon_ray.lanes import LaneStepper, StepStateError
from zephon_ray.pipeline import ZephonRank
from zephon_ray.recipe import Recipe
from zephon_ray.source import pad_token_id

_KEEP_SNAPSHOTS = 4


class LocalSlices:
    """Produce ``RankSlice`` objects for consecutive steps from an in-process Zephon rank."""

    def __init__(self, recipe: Recipe, *, rank: int, world: int, zephon_rank: ZephonRank, depth: int,
                 snapshot_every: int) -> None:
        self.recipe = recipe
        self.rank = rank
        self.world = world
        self.zephon_rank = zephon_rank
        self.depth = depth
        self.snapshot_every = snapshot_every
        self._pad = pad_token_id(recipe)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._cond = threading.Condition()
        self._snapshots: OrderedDict[int, dict[str, Any] | None] = OrderedDict()
        self._producing = -1
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_step = 0
        self._consumer_next = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, step: int, zephon_state: dict[str, Any] | None) -> None:
        """Start producing at ``step`` from a merged Zephon checkpoint taken at ``step`` (None: replay from 0)."""
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._snapshots = OrderedDict()
        self._error = None
        self._start_step = step
        self._producing = step
        self._consumer_next = step
        if zephon_state is not None:
            self._snapshots[int(zephon_state["next_step"])] = zephon_state
        else:
            self._snapshots[0] = None  # a fresh pipeline is the step-0 state
        self._thread = threading.Thread(
            target=self._run, args=(step, zephon_state, self._stop, self._queue),
            name=f"zephon-ray-local-r{self.rank}", daemon=True,
        )
        self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None

    # ------------------------------------------------------------------ consumer side
    def get(self, step: int, timeout: float) -> RankSlice:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got_step, item = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                if self._error is not None:
                    raise RuntimeError(f"zephon-ray local producer failed: {self._error!r}") from self._error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: step {step} not produced within {timeout:.0f} s")
        if isinstance(item, BaseException):
            raise RuntimeError(f"zephon-ray local producer failed at step {got_step}: {item!r}") from item
        if got_step != step:
            raise RuntimeError(f"local producer is at step {got_step}, the loader expected step {step}")
        return item

    def advance(self, next_step: int) -> None:
        """The trainer finished every step before ``next_step``: snapshots up to it may be taken."""
        with self._cond:
            if next_step > self._consumer_next:
                self._consumer_next = next_step
                self._cond.notify_all()

    def _due(self, step: int) -> bool:
        return bool(self.snapshot_every) and step % self.snapshot_every == 0 and step != self._start_step

    def snapshot(self, step: int, timeout: float) -> dict[str, Any] | None:
        """The newest merged Zephon checkpoint at or before ``step`` (None: the step-0 state).

        Waits until the producer has passed the boundary of ``step``, so every rank picks the same snapshot."""
        due = self._due(step)
        self.advance(step)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or step in self._snapshots or self._producing > step
                or (not due and self._producing >= step),
                timeout,
            )
            kept = [s for s in self._snapshots if s <= step]
            if ok and self._error is None and kept:
                return self._snapshots[max(kept)]
        if self._error is not None:
            raise RuntimeError(f"zephon-ray local producer failed: {self._error!r}") from self._error
        if not ok:
            raise TimeoutError(f"rank {self.rank}: the producer did not reach step {step} within {timeout:.0f} s")
        raise StepStateError(
            f"no Zephon snapshot at or before step {step} is kept any more (kept: {sorted(self._snapshots)}); "
            f"(prefetch {self.depth}, snapshot every {self.snapshot_every} steps)"
        )

    # ------------------------------------------------------------------ producer thread
    def _run(self, step: int, zephon_state: dict[str, Any] | None, stop: threading.Event, out: queue.Queue) -> None:
        stepper = None
        try:
            stepper = LaneStepper(self.recipe, self.zephon_rank)
            if zephon_state is not None:
                stepper.restore(zephon_state)
            while stepper.position < step and not stop.is_set():
                stepper.next_step()  # no merged checkpoint to start from: replay (batch s is a pure function of s)
            while not stop.is_set():
                s = stepper.position
                with self._cond:
                    self._producing = s
                    self._cond.notify_all()
                if self._due(s):
                    with self._cond:  # wait for this rank's trainer to reach the boundary
                        while not stop.is_set() and self._consumer_next < s:
                            self._cond.wait(0.2)
                    if stop.is_set():
                        break
                    state = stepper.checkpoint()  # collective when W > 1
                    with self._cond:
                        self._snapshots[s] = state
                        while len(self._snapshots) > _KEEP_SNAPSHOTS:
                            self._snapshots.popitem(last=False)
                        self._cond.notify_all()
                shards = stepper.next_step()
                lanes = sorted(shards)
                tokens = np.concatenate([shards[lane].tokens for lane in lanes])
                positions = np.concatenate([shards[lane].positions for lane in lanes])
                item = RankSlice(s, self.rank, self.world, tokens, positions, self._pad)
                while not stop.is_set():
                    try:
                        out.put((s, item), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                with self._cond:
                    self._producing = s + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            if stepper is not None:
                stepper.close(background=True)
