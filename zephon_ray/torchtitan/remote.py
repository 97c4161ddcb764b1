"""Service mode: read this rank's slice of every step from a running zephon-ray DataService.

A background thread asks the service for steps ``s .. s+depth-1`` ahead of the trainer (the service's own
``prefetch`` keeps the requests in flight) and hands finished ``RankSlice`` objects to the loader through a bounded
queue, so ``next()`` only waits when the service itself is behind. The slice arrays are copied out of the Ray
object store in that thread (they are read-only, zero-copy views there).

Read-ahead does not move this consumer's cursor on the service (``track=False``); the cursor moves when the
trainer actually takes a step. The service's window therefore trails what the trainer consumed, not what was
prefetched, so a resume from the last checkpoint finds its steps still in the live window.

Limits: the service must run the same recipe (fingerprint checked at connect). Every rank of a job uses the same
consumer name (the run_id), so the service's window follows the slowest rank.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from zephon_ray.batch import RankSlice
from zephon_ray.recipe import Recipe

DEFAULT_CONSUMER = "zephon-ray-loader"


class ServiceSlices:
    def __init__(self, recipe: Recipe, *, rank: int, world: int, name: str, namespace: str, run_id: str | None,
                 depth: int) -> None:
        from zephon_ray.service.client import DataService

        self.recipe = recipe
        self.rank = rank
        self.world = world
        self.depth = depth
        self.service = DataService.connect(name, namespace=namespace, consumer=run_id or DEFAULT_CONSUMER)
        served = self.service.recipe.fingerprint
        if served != recipe.fingerprint:
            raise ValueError(
                f"service {name!r} (namespace {namespace!r}) serves recipe fingerprint {served[:12]}, but this "
                f"loader uses {recipe.describe()}; start the loader with the service's recipe"
            )
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the client is used by one thread at a time
        self._consumed: int | None = None
        self._touched: int | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, step: int) -> None:
        self.close(release=False)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._error = None
        self._consumed = self._touched = None
        self._thread = threading.Thread(target=self._run, args=(step, self._stop, self._queue),
                                        name=f"zephon-ray-service-r{self.rank}", daemon=True)
        self._thread.start()

    def get(self, step: int, timeout: float) -> RankSlice:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, item = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                if self._error is not None:
                    raise self._error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: step {step} not served within {timeout:.0f} s")
        if isinstance(item, BaseException):
            raise item
        if got != step:
            raise RuntimeError(f"service reader is at step {got}, the loader expected step {step}")
        self._consumed = step  # the reader thread moves the service cursor: an actor call costs ~1 ms here
        return item

    def _flush_cursor(self) -> None:
        step = self._consumed
        if step is None or step == self._touched:
            return
        self._touched = step
        self.service.touch(step, rank=self.rank, world=self.world)  # fire and forget

    def commit(self, step: int) -> None:
        with self._lock:
            self.service.commit(step)

    def _run(self, step: int, stop: threading.Event, out: queue.Queue) -> None:
        s = step
        try:
            while not stop.is_set():
                self._flush_cursor()
                with self._lock:
                    self.service.prefetch(range(s + 1, s + self.depth + 1), rank=self.rank, world=self.world)
                    # The first read is tracked: it registers this rank's cursor and makes the service drop the
                    # cursors this consumer left at another world size (a resized group never closed its loader).
                    part = self.service.refs(s, rank=self.rank, world=self.world, track=s == step).slice(
                        self.rank, self.world)
                item = RankSlice(s, self.rank, self.world, np.array(part.tokens), np.array(part.positions),
                                 part.pad_token_id)
                while not stop.is_set():
                    self._flush_cursor()
                    try:
                        out.put((s, item), timeout=0.05)
                        break
                    except queue.Full:
                        continue
                s += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._error = exc
            try:
                out.put_nowait((s, exc))
            except queue.Full:
                pass

    def close(self, timeout: float = 2.0, *, release: bool = True) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout)
        if release:
            try:
                with self._lock:
                    self.service.release()
            except Exception:  # noqa: BLE001 - the service may already be gone
                pass
