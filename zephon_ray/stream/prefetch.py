"""The one prefetch implementation behind every slice stream: a daemon thread and a bounded queue.

Usage: a slice stream subclasses :class:`PrefetchedSlices` and writes ``_produce`` (a generator of slices from a step).
Guarantee: :class:`PrefetchedSlices` implements the protocol of :mod:`zephon_ray.stream.slice_stream` (reset / next / state /
close) once. A daemon thread runs the subclass's ``_produce`` generator and hands its slices to :meth:`next`
through a queue of ``depth`` steps, so ``next`` only waits when production itself is behind. An exception in the
thread reaches the caller at its next ``next`` (with the original as ``__cause__``), never as a silent hang;
``next`` checks that the slice is the step it expects.

Limits: ``close`` waits at most ``timeout`` for the thread; a thread blocked in a remote call exits when that call
returns (it is a daemon, so it never holds the interpreter open). Production runs at most ``depth`` steps (plus the
one being put) ahead of what ``next`` returned.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any, cast

from zephon_ray.batch import RankSlice
from zephon_ray.checks import check_int, check_reader
from zephon_ray.errors import one_line
from zephon_ray.stream.slice_stream import (
    STATE_CHECKPOINT,
    STATE_NEXT_STEP,
    SliceStream,
    SliceStreamError,
    check_stream_state,
    stream_state,
)

_POLL_S = 0.2
MAX_DEPTH = 1024
"""Upper bound on ``depth`` (steps held in memory ahead of the reader)."""


class PrefetchedSlices(SliceStream):
    """A :class:`~zephon_ray.stream.slice_stream.SliceStream` whose slices are made ahead by one background thread.

    Subclasses implement :meth:`_produce` and may override the hooks ``_on_reset``, ``_on_next``, ``_idle``,
    ``_wake`` and ``_checkpoint``."""

    reraise: tuple[type[BaseException], ...] = ()
    """Exception types handed to the caller as they are (they already say what went wrong, e.g. a
    ``ServiceError``); any other failure is wrapped in a :class:`SliceStreamError` naming the stream, step and rank."""

    def __init__(self, *, rank: int, world: int, depth: int, name: str) -> None:
        self.rank, self.world = check_reader(rank, world)
        self.depth = check_int("prefetch depth", depth, low=1, high=MAX_DEPTH)
        self._name = name
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._next = 0

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _produce(self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        """Yield this reader's slices of ``step``, ``step + 1``, ... until ``stop`` is set. Runs in the thread."""

    def _on_reset(self, step: int, checkpoint: dict[str, Any] | None) -> None:
        """Called in the caller's thread before the producer thread starts."""

    def _on_next(self, step: int) -> None:
        """Called in the caller's thread when :meth:`next` hands out ``step``."""

    def _idle(self) -> None:
        """Called in the thread every ~50 ms while the queue is full (e.g. to move a service cursor)."""

    def _wake(self) -> None:
        """Wake a producer thread waiting on a subclass condition (called by close)."""

    def _checkpoint(self, step: int, timeout: float) -> dict[str, Any] | None:
        """The checkpoint a state at boundary ``step`` carries (None: the source keeps none)."""
        return None

    # ------------------------------------------------------------------ the protocol
    @property
    def position(self) -> int:
        """The step :meth:`next` returns next."""
        return self._next

    def reset(self, state: dict[str, Any] | None = None) -> None:
        state = stream_state(0) if state is None else check_stream_state(state)
        step, checkpoint = state[STATE_NEXT_STEP], state[STATE_CHECKPOINT]
        self.close_thread()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._error = None
        self._next = step
        self._on_reset(step, checkpoint)
        self._thread = threading.Thread(
            target=self._loop,
            args=(step, checkpoint, self._stop, self._queue),
            name=f"zephon-ray-{self._name}-r{self.rank}",
            daemon=True,
        )
        self._thread.start()

    def next(self, timeout: float) -> RankSlice:
        if self._thread is None:
            raise SliceStreamError(
                f"the {self._name} slice stream (rank {self.rank} of {self.world}) is not running: call reset() first"
            )
        step = self._next
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._error is not None:
                    if isinstance(self._error, self.reraise):
                        raise self._error  # noqa: B904 - the producer thread's own error, cause chain intact
                    raise self._failure(step) from self._error
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {self.rank}: step {step} not ready within {timeout:.0f} s ({self._name} source)"
                    ) from None
        if isinstance(item, BaseException):
            if isinstance(item, self.reraise):
                raise item
            raise self._failure(got) from item
        if got != step:
            raise SliceStreamError(f"the {self._name} slice stream is at step {got}, the caller expected step {step}")
        self._next = step + 1
        self._on_next(step)
        return item

    def state(self, timeout: float) -> dict[str, Any]:
        step = self._next
        return stream_state(step, self._checkpoint(step, timeout) if step > 0 else None)

    def close(self) -> None:
        self.close_thread()

    def close_thread(self, timeout: float = 2.0) -> None:
        """Stop the producer thread (waiting at most ``timeout``); the source may be reset again."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._wake()
        thread.join(timeout)

    # ------------------------------------------------------------------ thread
    def _failure(self, step: int) -> SliceStreamError:
        err = self._error
        return SliceStreamError(
            f"zephon-ray {self._name} slice stream failed at step {step} (rank {self.rank} of "
            f"{self.world}): {type(err).__name__}: {one_line(err, 600)}"
        )

    def _loop(self, step: int, checkpoint: dict[str, Any] | None, stop: threading.Event, out: queue.Queue) -> None:
        s = step
        produced = cast(Generator[RankSlice, None, None], self._produce(step, checkpoint, stop))  # subclasses yield
        try:
            for item in produced:
                s = item.step
                _ = item.ledger_digest  # the ledger's hash, here rather than on the trainer's path
                while not stop.is_set():
                    try:
                        out.put((s, item), timeout=0.05)
                        break
                    except queue.Full:
                        self._idle()
                if stop.is_set():
                    return
                s += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._error = exc
            self._wake()
            try:
                out.put_nowait((s, exc))
            except queue.Full:
                pass
        finally:
            produced.close()  # runs the generator's cleanup (e.g. closing a Zephon pipeline) in this thread
