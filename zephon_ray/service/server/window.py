"""``StepWindow``: the step-table policy of the data service, as pure logic (no Ray, no threads, no clock).

    replay_below          keep_from        slowest cursor           head        produce_until   head + max_ahead
        |  (Replayer)        |<-- retained -->|<------------- window ------------->|                  |
        ▼                    ▼                ▼                       ▼             ▼                  ▼
    ────────────────────────[====== table: steps the producers delivered ======]─────────────────────┤ rejected

The coordinator holds one, under its lock, and asks it where each read is served from (:meth:`StepWindow.read`).

- ``keep_from``: the oldest step the table keeps. Per live consumer it is the lower of its slowest rank's cursor
  and its newest commit, but never more than ``retain_behind`` steps behind that cursor; the window takes the
  lowest over live consumers. Steps below it are evicted. So a trainer that restarts from its newest commit
  finds those steps still in the table (hits, not replays).
- ``produce_until``: producers run up to (not including) ``slowest live cursor + window``.
- ``replay_below``: steps below it that are not in the table are never produced live again; the Replayer serves
  them. It only rises.
- ``head``: one past the highest step ever submitted to producers (only rises).
- ``submitted_until``: one past the highest step the live producer group was handed. Unlike ``head`` it falls back
  when a group is replaced (a kill, a phase) and starts again from a checkpoint: steps the old group was handed past
  the live window are not on their way any more.

Guarantees:
- The table never holds a step outside ``[keep_from, produce_until)``, so it holds at most
  ``window + retain_behind`` steps (``bound_steps``).
- A cursor never moves back (an out-of-order ``advance`` is ignored); a consumer reading at another world size
  drops its cursors of the old world size.
- Reads more than ``max_ahead`` steps past the head (or past ``reach``, where an earlier incarnation got to) are
  rejected (tracked or not), commits more than one past the highest step a consumer consumed are rejected,
  rank/world are checked, cursors silent for ``consumer_ttl_s`` are deleted.
- Cursor moves may arrive late and in batches (node readers report them with their leases, ``advance`` with a
  ``seen`` time in the past): a cursor is as live as the last time its rank was heard, and a move heard before the
  consumer's ``release`` is ignored, so a release sticks.

Limits: the clock is passed in (``now``), so the caller decides what "silent" means; it keeps no durable state
(commits are loaded into it by the coordinator from ``state_dir``). ``refresh`` is O(cursors + table).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from zephon_ray.checks import check_int
from zephon_ray.service.wire import check_batch_reader, check_consumer

__all__ = ["Cursor", "Entry", "Read", "StepWindow", "resume_step"]

MAX_CURSORS = 100_000
"""Cursors kept at once ((consumer, rank, world) keys); more is a misuse (e.g. a new consumer name per read)."""
MAX_STATUS_CURSORS = 1024
"""``status()`` lists at most this many cursors (the slowest first); ``cursor_summary`` covers all of them."""


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
    """One step in the table: opaque handles (in the service, one container ref per producer: wire.py) and
    the step's byte count."""

    containers: list[Any]
    nbytes: int
    served: int = 0
    generation: int = 0
    """The producer generation that made it (its shards die with that generation's actors)."""


def resume_step(commits: dict[str, int], max_ahead: int) -> int:
    """Where a (re)started service begins: the oldest newest-commit among consumers, ignoring consumers whose newest
    commit lies more than ``max_ahead`` behind the newest one (they are long gone; the Replayer serves them)."""
    if not commits:
        return 0
    newest = max(commits.values())
    return min(step for step in commits.values() if step >= newest - max_ahead)


class StepWindow:
    """The table, cursors, commits and the bounds. Every method is O(cursors + table)."""

    def __init__(
        self,
        *,
        window: int,
        start: int = 0,
        max_ahead: int = 512,
        retain_behind: int = 32,
        consumer_ttl_s: float = 120.0,
        rows: int = 1 << 30,
        reach: int = 0,
    ) -> None:
        for key, value in (("window", window), ("max_ahead", max_ahead)):
            check_int(f"StepWindow: {key}", value, low=1)
        check_int("StepWindow: retain_behind", retain_behind, low=0)
        self.window = window
        self.max_ahead = max_ahead
        self.retain_behind = retain_behind
        self.consumer_ttl_s = consumer_ttl_s
        self.rows = rows
        self.table: dict[int, Entry] = {}
        self.cursors: dict[tuple[str, int, int], Cursor] = {}
        self.commits: dict[str, int] = {}
        self.consumed: dict[str, int] = {}  # consumer -> highest step it read (tracked) or advanced to
        self.worlds: dict[str, int] = {}  # consumer -> the world size its cursors have
        self.released: dict[str, float] = {}  # consumer -> when release() dropped its cursors
        self.replay_below = start
        self.keep_from = start
        self.slowest = start
        self.head = start
        self.submitted_until = start
        self.reach = max(start, reach)
        """How far an earlier incarnation of the service got (its newest durable checkpoint): after a restart at
        the consumers' commits, their ranks may be that far ahead, and their reads must not be refused."""
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
        """Should the producers file ``step`` into the table (else they only skip past it)? Steps below
        ``replay_below`` (>= ``keep_from``) are the Replayer's."""
        return step >= self.replay_below and step not in self.table

    def run(self, first: int, count: int) -> list[tuple[int, Entry]]:
        """The table's entries of steps ``first, first + 1, ...`` (at most ``count``), up to the first gap."""
        out = []
        for step in range(first, first + count):
            entry = self.table.get(step)
            if entry is None:
                break
            out.append((step, entry))
        return out

    # ------------------------------------------------------------------ requests
    def check_step(self, step: Any, what: str = "step") -> int:
        check_int(what, step, low=0)
        head = max(self.head, self.produce_until, self.reach)
        if step > head + self.max_ahead:
            raise ValueError(
                f"{what} {step} is more than max_ahead={self.max_ahead} steps past the service's head "
                f"({head}): no read may make the producers grind that far (to begin there, start the service with "
                f"start_step=)"
            )
        return step

    def read(self, step: int, consumer: str, rank: int | None, world: int | None, *, track: bool, now: float) -> Read:
        """Validate a read, move the cursor if ``track``, and say where it is served from."""
        self.check_step(step)
        if track:
            self.advance(step, consumer, rank, world, now=now)
        return self.where(step, waits=track)

    def where(self, step: int, *, waits: bool) -> Read:
        """Where a read of ``step`` is served from. ``waits``: the reader's cursor is at ``step`` (a tracked read),
        so producers will get there; an untracked read beyond the live window is replayed instead of waiting (the
        coordinator still serves it from the table if producers file it before the replay is done)."""
        if step in self.table:
            return Read.HIT
        if step < self.replay_below:
            return Read.REPLAY
        if not waits and step >= max(self.submitted_until, self.produce_until):
            return Read.REPLAY  # neither on its way nor will a cursor move the producers there: it could wait forever
        return Read.WAIT

    def advance(
        self, step: int, consumer: str, rank: int | None, world: int | None, *, now: float, seen: float | None = None
    ) -> bool:
        """Move a cursor forward (never back) and record what this consumer consumed. ``seen`` (default ``now``)
        is when its rank was last heard; a move heard before the consumer's ``release`` is ignored (False)."""
        self.check_step(step)
        check_consumer(consumer)
        rank, world = check_batch_reader(rank, world, self.rows)
        seen = now if seen is None else min(seen, now)
        released = self.released.get(consumer)
        if released is not None and seen <= released:
            return False
        if self.worlds.get(consumer, world) != world:
            # one world per consumer: a resized job's old ranks stop holding the window
            for other in [k for k in self.cursors if k[0] == consumer]:
                del self.cursors[other]
        self.worlds[consumer] = world
        key = (consumer, rank, world)
        cursor = self.cursors.get(key)
        if cursor is None:
            if len(self.cursors) >= MAX_CURSORS:
                raise ValueError(f"too many cursors ({MAX_CURSORS}); reuse consumer names or release() them")
            self.cursors[key] = Cursor(step, seen)
        else:
            cursor.step = max(cursor.step, step)
            cursor.seen = max(cursor.seen, seen)
        self.consumed[consumer] = max(self.consumed.get(consumer, -1), step)
        return True

    def commit(self, step: int, consumer: str, read: int | None = None, *, apply: bool = True) -> int:
        """Check a commit: at most one past the highest step this consumer was delivered (or its previous commit).

        ``read`` is the highest step the committing client itself was *delivered* (the client records a read only
        once it returned, and sends it with the commit): a read that was asked for but failed or still waits does
        not count, so a commit beyond what was delivered is refused
        (tests/test_window.py::test_commits_are_per_consumer_and_checked,
        tests/test_storage_faults.py::test_service_rides_through_a_15s_outage). It counts even where those moves were
        not applied as cursors: when another rank of the same consumer released it (closed its loader) in the
        meantime, its cursors are gone, but what this client read is still read
        (tests/test_window.py::test_a_commit_counts_its_own_reads_after_a_release). Limit: a commit from a handle
        that read nothing itself (``read=None``) is checked against the consumer's cursors, i.e. what its ranks
        asked for. ``apply=False`` only checks (the coordinator applies it once the commit is durable)."""
        check_int("commit step", step, low=0)
        check_consumer(consumer)
        read = self.consumed.get(consumer, -1) if read is None else self.check_step(read, "read step")
        allowed = max(read + 1, self.commits.get(consumer, 0))
        if step > allowed:
            read = None if read < 0 else read
            why = "it was delivered nothing yet" if read is None else f"one past its highest delivered step {read}"
            raise ValueError(
                f"commit step {step} of consumer {consumer!r} is ahead of what it was delivered: at most {allowed} "
                f"({why})"
            )
        if apply:
            self.commits[consumer] = step
        return step

    def release(self, consumer: str, now: float | None = None) -> int:
        """Drop the consumer's cursors; with ``now``, moves heard before it are ignored from then on."""
        keys = [k for k in self.cursors if k[0] == consumer]
        for k in keys:
            del self.cursors[k]
        self.consumed.pop(consumer, None)
        self.worlds.pop(consumer, None)
        if now is not None:
            self.released[consumer] = now
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
        self.submitted_until = max(self.submitted_until, step + 1)

    def launched(self, step: int) -> None:
        """A producer group was (re)launched at ``step``: what earlier groups were handed from there on is lost."""
        self.submitted_until = step

    def invalidate(self, step: int, generation: int | None = None) -> Entry | None:
        """Drop a step whose shards were lost (node loss); with ``generation``, only if the entry is of that
        generation (a lost copy reported late must not drop the step made again)."""
        entry = self.table.get(step)
        if entry is None or (generation is not None and entry.generation != generation):
            return None
        del self.table[step]
        self.held_bytes -= entry.nbytes
        return entry

    def drop_generation(self, generation: int) -> list[int]:
        """Drop every step made by producer generation ``generation`` (its actors died): returns those steps."""
        steps = sorted(s for s, e in self.table.items() if e.generation == generation)
        for step in steps:
            self.held_bytes -= self.table.pop(step).nbytes
        return steps

    def refresh(self, now: float) -> list[tuple[int, Entry]]:
        """Delete expired cursors, recompute the bounds and evict; returns the evicted steps. One pass over the
        cursors and one over the table."""
        ttl = self.consumer_ttl_s
        lowest: dict[str, int] = {}
        expired = []
        for key, cursor in self.cursors.items():
            if now - cursor.seen > ttl:
                expired.append(key)
                continue
            consumer = key[0]
            if consumer not in lowest or cursor.step < lowest[consumer]:
                lowest[consumer] = cursor.step
        for key in expired:
            del self.cursors[key]
        for consumer in [c for c in self.consumed if c not in lowest]:
            del self.consumed[consumer]
            self.worlds.pop(consumer, None)
        if lowest:
            self.slowest = min(lowest.values())
            keep = []
            for consumer, low in lowest.items():
                commit = self.commits.get(consumer)
                own = low if commit is None else min(low, commit)
                keep.append(max(own, low - self.retain_behind))
            self.keep_from = min(keep)
        # With no live cursor the bounds stay where they were. A step below keep_from that is not in the table
        # now (evicted, or skipped by producers) is never produced live again, even if keep_from drops later.
        self.replay_below = max(self.replay_below, self.keep_from)
        evicted = [(s, self.table.pop(s)) for s in sorted(self.table) if s < self.keep_from]
        for _, entry in evicted:
            self.held_bytes -= entry.nbytes
        return evicted

    def cursor_summary(self, now: float) -> dict[str, dict[str, Any]]:
        """Per consumer: cursor count, world, slowest and fastest step, live count."""
        out: dict[str, dict[str, Any]] = {}
        for (consumer, _, world), c in self.cursors.items():
            s = out.setdefault(
                consumer, {"cursors": 0, "live": 0, "world": world, "slowest": c.step, "fastest": c.step}
            )
            s["cursors"] += 1
            s["live"] += now - c.seen <= self.consumer_ttl_s
            s["slowest"] = min(s["slowest"], c.step)
            s["fastest"] = max(s["fastest"], c.step)
        return out

    def status(self, now: float) -> dict[str, Any]:
        return {
            "size": self.window,
            "keep_from": self.keep_from,
            "replay_below": self.replay_below,
            "produce_until": self.produce_until,
            "head": self.head,
            "submitted_until": self.submitted_until,
            "max_ahead": self.max_ahead,
            "retain_behind": self.retain_behind,
            "bound_steps": self.bound_steps,
            "low": self.keep_from,  # old name, kept for status readers
            "held_steps": sorted(self.table),
            "held_bytes": self.held_bytes,
            "peak_held_bytes": self.peak_bytes,
            "cursors": [
                {
                    "consumer": k[0],
                    "rank": k[1],
                    "world": k[2],
                    "step": c.step,
                    "idle_s": round(now - c.seen, 3),
                    "live": now - c.seen <= self.consumer_ttl_s,
                }
                for k, c in sorted(self.cursors.items(), key=lambda kc: (kc[1].step, kc[0]))[:MAX_STATUS_CURSORS]
            ],
            "cursor_summary": self.cursor_summary(now),
            "commits": dict(self.commits),
        }
