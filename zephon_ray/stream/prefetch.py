"""One narrow interface for the loader's slice sources, and one prefetch thread behind it.

Every delivery path (``local``: an in-process Zephon rank; ``service``: a DataService; ``dataset``: materialised
Parquet) is a :class:`SliceSource`, in the spirit of ``torchdata.nodes``::

    source.start(step, resume)     # (re)start at a step boundary; ``resume`` is what ``state()`` handed out
    source.get(step, timeout)      # this rank's RankSlice of ``step``; steps are asked for in order
    source.advance(next_step)      # the trainer consumed every step before ``next_step``
    source.state(step, timeout)    # JSON-safe resume state for boundary ``step`` (None: nothing to keep)
    source.close()                 # stop threads, release connections; idempotent

:class:`PrefetchedSlices` implements ``start``/``get``/``close`` once: a daemon thread runs the subclass's
``_produce`` generator and hands its slices to ``get`` through a bounded queue of ``depth`` steps, so ``get`` only
waits when production itself is behind. An exception in the thread reaches the trainer at its next ``get`` (with
the original as ``__cause__``), never as a silent hang. ``get`` checks that the slice is the step it asked for.

Limits: a source serves one rank and consecutive steps from where it was started; to jump, call ``start`` again
(the loader does on ``load_state_dict``). ``close`` waits at most ``timeout`` for the thread: a thread blocked in
a remote call exits when that call returns (it is a daemon, so it never holds the interpreter open).
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from zephon_ray.batch import RankSlice

# Keys of the loader's ``stats`` (see ZephonRayDataLoader.stats), named once.
STAT_MODE = "mode"
STAT_NEXT_STEP = "next_step"
STAT_REPLAYED_STEPS = "replayed_steps"
STAT_RESUME_REPLAY = "resume_replay"
STAT_RESUMED_FROM = "resumed_from_checkpoint"

_POLL_S = 0.2


class SourceError(RuntimeError):
    """The producing side of a slice source failed; ``__cause__`` holds the original exception."""


class SliceSource(abc.ABC):
    """The narrow protocol the loader drives. See the module docstring."""

    @abc.abstractmethod
    def start(self, step: int, resume: dict[str, Any] | None = None) -> None: ...

    @abc.abstractmethod
    def get(self, step: int, timeout: float) -> RankSlice: ...

    def advance(self, next_step: int) -> None:  # noqa: B027 - optional hook
        """The trainer finished every step before ``next_step``."""

    def state(self, step: int, timeout: float) -> dict[str, Any] | None:
        """Resume state at the step boundary ``step``; None when the source needs none (service, dataset)."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def running(self) -> bool: ...


class PrefetchedSlices(SliceSource):
    """A :class:`SliceSource` whose slices are made ahead by one background thread (see the module docstring).

    Subclasses implement :meth:`_produce` and may override :meth:`_idle` (called while the queue is full)."""

    reraise: tuple[type[BaseException], ...] = ()
    """Exception types handed to the trainer as they are (they already say what went wrong, e.g. a
    ``ServiceError``); any other failure is wrapped in a :class:`SourceError` naming the source, step and rank."""

    def __init__(self, *, rank: int, world: int, depth: int, name: str) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.rank = rank
        self.world = world
        self.depth = depth
        self._name = name
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _produce(self, step: int, resume: dict[str, Any] | None, stop: threading.Event) -> Iterator[RankSlice]:
        """Yield this rank's slices of ``step``, ``step + 1``, ... until ``stop`` is set. Runs in the thread."""

    def _idle(self) -> None:
        """Called in the thread every ~50 ms while the queue is full (e.g. to move a service cursor)."""

    def _on_start(self, step: int, resume: dict[str, Any] | None) -> None:
        """Called in the caller's thread before the producer thread starts."""

    # ------------------------------------------------------------------ SliceSource
    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, step: int, resume: dict[str, Any] | None = None) -> None:
        self.close_thread()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._error = None
        self._on_start(step, resume)
        self._thread = threading.Thread(target=self._loop, args=(step, resume, self._stop, self._queue),
                                        name=f"zephon-ray-{self._name}-r{self.rank}", daemon=True)
        self._thread.start()

    def get(self, step: int, timeout: float) -> RankSlice:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._error is not None:
                    if isinstance(self._error, self.reraise):
                        raise self._error
                    raise self._failure(step) from self._error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: step {step} not ready within {timeout:.0f} s "
                                       f"({self._name} source)") from None
        if isinstance(item, BaseException):
            if isinstance(item, self.reraise):
                raise item
            raise self._failure(got) from item
        if got != step:
            raise SourceError(f"the {self._name} source is at step {got}, the loader expected step {step}")
        return item

    def close(self) -> None:
        self.close_thread()

    def close_thread(self, timeout: float = 2.0) -> None:
        """Stop the producer thread (waiting at most ``timeout``); the source may be started again."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._wake()
        thread.join(timeout)

    def _wake(self) -> None:
        """Wake a producer thread waiting on a subclass condition (called by close)."""

    # ------------------------------------------------------------------ thread
    def _failure(self, step: int) -> SourceError:
        err = self._error
        return SourceError(f"zephon-ray {self._name} source failed at step {step} (rank {self.rank} of "
                           f"{self.world}): {type(err).__name__}: {err}")

    def _loop(self, step: int, resume: dict[str, Any] | None, stop: threading.Event, out: queue.Queue) -> None:
        s = step
        produced = self._produce(step, resume, stop)
        try:
            for item in produced:
                s = item.step
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
