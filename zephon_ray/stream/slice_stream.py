"""The one narrow protocol every slice stream implements, in the spirit of ``torchdata.nodes``.

A slice stream serves one reader (rank r of W) its :class:`~zephon_ray.batch.RankSlice` of consecutive global
steps::

    stream.reset(state)      # (re)start at a step boundary; None: step 0, or a state that ``state()`` handed out
    stream.next(timeout)     # this reader's RankSlice of the next step (steps come in order, from the reset point)
    stream.state(timeout)    # JSON-safe state at the boundary after the last slice ``next`` returned
    stream.close()           # stop threads, release connections; idempotent; ``reset`` may start it again

(A *slice stream* hands one reader its slices step after step; a recipe's *sources* are the datasets it mixes, and
:class:`~zephon_ray.source.GlobalBatchSource` / :class:`~zephon_ray.formats.materialized.MaterializedSource` give
whole global batches by step, in any order.)

A stream state is a plain dict with the keys named by :data:`STATE_NEXT_STEP` and :data:`STATE_CHECKPOINT`; build
one with :func:`stream_state` and read one with :func:`check_stream_state` (both validate early, naming the key).
``checkpoint`` is the merged Zephon checkpoint a local-mode stream restores from (at or before ``next_step``; it
replays the steps in between); the service and dataset streams keep none (None).

Implementations (all behind the one prefetch thread of :mod:`zephon_ray.stream.prefetch`):
:class:`~zephon_ray.stream.local.LocalSlices` (an in-process Zephon lane group),
:class:`~zephon_ray.stream.service.ServiceSlices` (a DataService) and
:class:`~zephon_ray.stream.dataset.DatasetSlices` (a materialised directory).

Limits: a stream serves one reader and consecutive steps from where it was reset; to jump, reset it again. The
state is only defined at a step boundary: the caller asks for it after the slices it took were used.
"""

from __future__ import annotations

import abc
from typing import Any

from zephon_ray.batch import RankSlice
from zephon_ray.checks import MAX_STEP, check_int

STATE_NEXT_STEP = "next_step"
"""Stream state key: the first step the stream has not handed out (the boundary the state describes)."""
STATE_CHECKPOINT = "checkpoint"
"""Stream state key: a merged Zephon checkpoint at or before ``next_step`` (local mode), or None."""
STREAM_STATE_KEYS = (STATE_NEXT_STEP, STATE_CHECKPOINT)


class SliceStreamError(RuntimeError):
    """The producing side of a slice stream failed; ``__cause__`` holds the original exception."""


def stream_state(next_step: int, checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    """A validated stream state (see the module docstring)."""
    return check_stream_state({STATE_NEXT_STEP: next_step, STATE_CHECKPOINT: checkpoint})


def check_stream_state(state: Any) -> dict[str, Any]:
    """Return ``state`` if it is a stream state, else raise ValueError naming the key that is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"stream state must be a dict with keys {STREAM_STATE_KEYS}, got {type(state).__name__}")
    missing = [k for k in STREAM_STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"stream state lacks key {missing[0]!r} (keys present: {sorted(state)})")
    extra = sorted(set(state) - set(STREAM_STATE_KEYS))
    if extra:
        raise ValueError(f"stream state has unknown key {extra[0]!r} (expected {STREAM_STATE_KEYS})")
    check_int(f"stream state key {STATE_NEXT_STEP!r}", state[STATE_NEXT_STEP], low=0, high=MAX_STEP)
    checkpoint = state[STATE_CHECKPOINT]
    if checkpoint is not None and not isinstance(checkpoint, dict):
        raise ValueError(
            f"stream state key {STATE_CHECKPOINT!r} must be a dict or None, got {type(checkpoint).__name__}"
        )
    return state


class SliceStream(abc.ABC):
    """The narrow protocol the loader core drives. See the module docstring."""

    rank: int
    world: int

    @abc.abstractmethod
    def reset(self, state: dict[str, Any] | None = None) -> None:
        """(Re)start at ``state[STATE_NEXT_STEP]`` (None: step 0), restoring ``state[STATE_CHECKPOINT]`` if any."""

    @abc.abstractmethod
    def next(self, timeout: float) -> RankSlice:
        """This reader's slice of the next step; raises TimeoutError after ``timeout`` seconds."""

    @abc.abstractmethod
    def state(self, timeout: float) -> dict[str, Any]:
        """The stream state at the boundary after the last slice :meth:`next` returned."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background work and release connections. Idempotent."""
