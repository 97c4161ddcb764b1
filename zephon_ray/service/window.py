"""``StepWindow``: the step-table policy of the data service, as pure logic (no Ray, no threads, no clock).

    replay_below          keep_from        slowest cursor           head        produce_until   head + max_ahead
        |  (Replayer)        |<-- retained -->|<------------- window ------------->|                  |
        ▼                    ▼                ▼                       ▼             ▼                  ▼
    ────────────────────────[====== table: steps the producers delivered ======]─────────────────────┤ rejected

- ``keep_from``: the oldest step the table keeps. Per live consumer it is the lower of its slowest rank's cursor
  and its newest commit, but never more than ``retain_behind`` steps behind that cursor; the window takes the
  lowest over live consumers. Steps below it are evicted. So a trainer that restarts from its newest commit
  finds those steps still in the table (hits, not replays).
- ``produce_until``: producers run up to (not including) ``slowest live cursor + window``.
- ``replay_below``: steps below it that are not in the table are never produced live again; the Replayer serves
  them. It only rises.
- ``head``: one past the highest step ever submitted to producers (only rises).

Guarantees (tests/test_window.py):
- The table never holds a step outside ``[keep_from, produce_until)``, so it holds at most
  ``window + retain_behind`` steps (``bound_steps``).
- A cursor never moves back (an out-of-order ``touch`` is ignored); a consumer reading at another world size
  drops its cursors of the old world size.
- Reads more than ``max_ahead`` steps past the head are rejected (tracked or not), commits more than one past the
  highest step a consumer consumed are rejected, rank/world are checked, cursors silent for ``consumer_ttl_s``
  are deleted.

Limits: the clock is passed in (``now``), so the caller decides what "silent" means; it keeps no durable state
(commits are loaded into it by the coordinator from ``state_dir``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

MAX_CONSUMER_NAME = 200
MAX_CURSORS = 10_000
"""Cursors kept at once ((consumer, rank, world) keys); more is a misuse (e.g. a new consumer name per read)."""


class Read(Enum):
    """Where a read of one step is served from."""

    HIT = "hit"  # in the table now
    WAIT = "wait"  # producers will deliver it to the table
    REPLAY = "replay"  # behind the live window, or too far ahead of it for an untracked read: the Replayer


@dataclass
class Cursor:
    step: int
    seen: float


@dataclass
class Entry:
    """One step in the table: opaque lane handles (Ray refs in the service) and their byte count."""

    lanes: list[Any]
    nbytes: int
    served: int = 0


def check_consumer(consumer: Any) -> str:
    if not isinstance(consumer, str) or not consumer or len(consumer) > MAX_CONSUMER_NAME:
        raise ValueError(f"consumer must be a non-empty string of at most {MAX_CONSUMER_NAME} characters, "
                         f"got {consumer!r}")
    return consumer


def check_reader(rank: Any, world: Any, rows: int) -> tuple[int, int]:
    """(rank, world) of a reader; ``world=None`` means one reader of the whole batch (0, 1)."""
    if world is None and rank is None:
        return 0, 1
    for key, value in (("rank", rank), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
    if not 1 <= world <= rows or rows % world:
        raise ValueError(f"world={world} must divide the global batch of {rows} rows")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, {world})")
    return rank, world


def resume_step(commits: dict[str, int], max_ahead: int) -> int:
    """Where a (re)started service begins: the oldest newest-commit among consumers, ignoring consumers whose newest
    commit lies more than ``max_ahead`` behind the newest one (they are long gone; the Replayer serves them)."""
    if not commits:
        return 0
    newest = max(commits.values())
    return min(step for step in commits.values() if step >= newest - max_ahead)


class StepWindow:
    """The table, cursors, commits and the bounds. Every method is O(cursors + table)."""

    def __init__(self, *, window: int, start: int = 0, max_ahead: int = 512, retain_behind: int = 32,
                 consumer_ttl_s: float = 120.0, rows: int = 1 << 30) -> None:
        for key, value in (("window", window), ("max_ahead", max_ahead)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepWindow: {key} must be an integer >= 1, got {value!r}")
        if isinstance(retain_behind, bool) or not isinstance(retain_behind, int) or retain_behind < 0:
            raise ValueError(f"StepWindow: retain_behind must be an integer >= 0, got {retain_behind!r}")
        self.window = window
        self.max_ahead = max_ahead
        self.retain_behind = retain_behind
        self.consumer_ttl_s = consumer_ttl_s
        self.rows = rows
        self.table: dict[int, Entry] = {}
        self.cursors: dict[tuple[str, int, int], Cursor] = {}
        self.commits: dict[str, int] = {}
        self.consumed: dict[str, int] = {}  # consumer -> highest step it read (tracked) or touched
        self.replay_below = start
        self.keep_from = start
        self.slowest = start
        self.head = start
        self.held_bytes = 0
        self.peak_bytes = 0

    # ------------------------------------------------------------------ derived bounds
    @property
    def produce_until(self) -> int:
        return self.slowest + self.window

    @property
    def bound_steps(self) -> int:
        return self.window + self.retain_behind

    def wanted(self, step: int) -> bool:
        """Should the producers file ``step`` into the table (else they only skip past it)?"""
        return step >= self.keep_from and step not in self.table

    # ------------------------------------------------------------------ requests
    def check_step(self, step: Any, what: str = "step") -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{what} must be a non-negative integer, got {step!r}")
        limit = max(self.head, self.produce_until) + self.max_ahead
        if step > limit:
            raise ValueError(
                f"{what} {step} is more than max_ahead={self.max_ahead} steps past the service's head "
                f"({max(self.head, self.produce_until)}): no read may make the producers grind that far (to begin "
                f"there, start the service with start_step=)")
        return step

    def read(self, step: int, consumer: str, rank: int | None, world: int | None, *, track: bool,
             now: float) -> Read:
        """Validate a read, move the cursor if ``track``, and say where it is served from."""
        self.check_step(step)
        if track:
            self.touch(step, consumer, rank, world, now=now)
        if step in self.table:
            return Read.HIT
        if step < self.replay_below:
            return Read.REPLAY
        if not track and step >= max(self.head, self.produce_until):
            return Read.REPLAY  # no cursor moves the producers there: waiting could last forever
        return Read.WAIT

    def touch(self, step: int, consumer: str, rank: int | None, world: int | None, *, now: float) -> None:
        """Move a cursor forward (never back) and record what this consumer consumed."""
        self.check_step(step)
        check_consumer(consumer)
        rank, world = check_reader(rank, world, self.rows)
        for other in [k for k in self.cursors if k[0] == consumer and k[2] != world]:
            del self.cursors[other]  # one world per consumer: a resized job's old ranks stop holding the window
        key = (consumer, rank, world)
        cursor = self.cursors.get(key)
        if cursor is None:
            if len(self.cursors) >= MAX_CURSORS:
                raise ValueError(f"too many cursors ({MAX_CURSORS}); reuse consumer names or release() them")
            self.cursors[key] = Cursor(step, now)
        else:
            cursor.step = max(cursor.step, step)
            cursor.seen = now
        self.consumed[consumer] = max(self.consumed.get(consumer, -1), step)

    def commit(self, step: int, consumer: str) -> int:
        """Check a commit: at most one past the highest step this consumer consumed (or its previous commit)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"commit step must be a non-negative integer, got {step!r}")
        check_consumer(consumer)
        allowed = max(self.consumed.get(consumer, -1) + 1, self.commits.get(consumer, 0))
        if step > allowed:
            read = self.consumed.get(consumer)
            why = "it has read nothing yet" if read is None else f"one past its highest read step {read}"
            raise ValueError(
                f"commit step {step} of consumer {consumer!r} is ahead of what it consumed: at most {allowed} ({why})")
        self.commits[consumer] = step
        return step

    def release(self, consumer: str) -> int:
        keys = [k for k in self.cursors if k[0] == consumer]
        for k in keys:
            del self.cursors[k]
        self.consumed.pop(consumer, None)
        return len(keys)

    # ------------------------------------------------------------------ producers' side
    def file(self, step: int, entry: Entry) -> bool:
        """Put a produced step in the table if it is still wanted."""
        if not self.wanted(step):
            return False
        self.table[step] = entry
        self.held_bytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return True

    def submitted(self, step: int) -> None:
        self.head = max(self.head, step + 1)

    def invalidate(self, step: int) -> Entry | None:
        """Drop a step whose shards were lost (node loss): from now on the Replayer serves it."""
        entry = self.table.pop(step, None)
        if entry is not None:
            self.held_bytes -= entry.nbytes
        return entry

    def refresh(self, now: float) -> list[tuple[int, Entry]]:
        """Delete expired cursors, recompute the bounds and evict; returns the evicted steps."""
        ttl = self.consumer_ttl_s
        for key in [k for k, c in self.cursors.items() if now - c.seen > ttl]:
            del self.cursors[key]
        live = {k[0] for k in self.cursors}
        for consumer in [c for c in self.consumed if c not in live]:
            del self.consumed[consumer]
        if self.cursors:
            self.slowest = min(c.step for c in self.cursors.values())
            keep = []
            for consumer in live:
                lowest = min(c.step for k, c in self.cursors.items() if k[0] == consumer)
                commit = self.commits.get(consumer)
                own = lowest if commit is None else min(lowest, commit)
                keep.append(max(own, lowest - self.retain_behind))
            self.keep_from = min(keep)
        # With no live cursor the bounds stay where they were. A step below keep_from that is not in the table
        # now (evicted, or skipped by producers) is never produced live again, even if keep_from drops later.
        self.replay_below = max(self.replay_below, self.keep_from)
        evicted = [(s, self.table.pop(s)) for s in sorted(self.table) if s < self.keep_from]
        for _, entry in evicted:
            self.held_bytes -= entry.nbytes
        return evicted

    def status(self, now: float) -> dict[str, Any]:
        return {
            "size": self.window, "keep_from": self.keep_from, "replay_below": self.replay_below,
            "produce_until": self.produce_until, "head": self.head, "max_ahead": self.max_ahead,
            "retain_behind": self.retain_behind, "bound_steps": self.bound_steps,
            "low": self.keep_from,  # old name, kept for status readers
            "held_steps": sorted(self.table), "held_bytes": self.held_bytes, "peak_held_bytes": self.peak_bytes,
            "cursors": [
                {"consumer": k[0], "rank": k[1], "world": k[2], "step": c.step, "idle_s": round(now - c.seen, 3),
                 "live": now - c.seen <= self.consumer_ttl_s}
                for k, c in sorted(self.cursors.items())
            ],
            "commits": dict(self.commits),
        }
