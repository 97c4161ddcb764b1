"""``LeaseCache``: the lane refs of leased steps that one node reader, or one client process, holds.

    lease reply (steps s, s+1, ... with their lane refs, keep_from) ──file()──► {step: HeldStep}
    read of step s, lanes [lo, hi) ──run(s, lo, hi, n)──► the held steps s, s+1, ... (at most n) that hold them

Shared by both sides: the node reader (server/node_reader.py) keeps one for the ranks of its node and the client's
node path (client/node_read_path.py) one for the ranks of its process; both follow the same rules, so a fix to
one is a fix to both. It also sizes how long the holders of refs above them keep theirs
(:func:`container_hold_steps`, :func:`producer_hold_steps`).

Guarantees:
- What is filed is served unchanged: ``run`` hands out the refs filed for a step, of the generation filed last.
  Refs of the same generation filed again are merged lane by lane (a second lease for other lanes adds to the
  first); a step filed by another generation (made again after a producer died, or replayed) replaces it.
- Bounded: it never holds a live step below the newest ``keep_from`` it was told (the oldest step the coordinator
  still holds; ``keep_from`` never goes back, except through :meth:`clear`), at most :data:`REPLAYS_KEPT` replayed
  steps, and at most ``cap`` steps in all (the oldest go first). Refs it drops no longer keep their shards alive.
Limits: not thread-safe by itself; its owner serialises the calls (the node reader's one event loop, the client's
lock). It holds refs, never shard bytes.
"""

from __future__ import annotations

from zephon_ray.checks import check_int
from zephon_ray.service.wire import REPLAYED, HeldStep, StepLanes, only_lanes

REPLAYS_KEPT = 8
"""Replayed steps kept (the ranks reading one past step share one reply)."""


def container_hold_steps(window: int, lease_steps: int) -> int:
    """Steps whose container refs a node reader keeps (server/node_reader.py): the cache's cap plus one reply's run
    of steps, so a container outlives the lane refs it held (the order that leaves nothing behind in Ray's memory
    store)."""
    return 2 * (window + lease_steps) + REPLAYS_KEPT + max(window, lease_steps)


def producer_hold_steps(window: int, lease_steps: int, retain_behind: int) -> int:
    """Steps whose refs a producer keeps (server/producer.py :class:`OwnedRefs`): longer than the node readers keep the
    containers, plus the steps produced ahead (window) and kept behind the cursors (retain_behind) by the
    coordinator, so that the owner drops its refs last."""
    return container_hold_steps(window, lease_steps) + 2 * window + retain_behind


class LeaseCache:
    """Held steps by step number; see the module docstring."""

    def __init__(self, lanes: int, cap: int) -> None:
        check_int("LeaseCache: cap", cap, low=1)
        self.lanes = lanes
        self.cap = cap
        self.keep_from = 0
        self._held: dict[int, HeldStep] = {}
        self._replayed: list[int] = []  # replayed steps held, oldest first

    @classmethod
    def for_window(cls, lanes: int, window: int, lease_steps: int) -> LeaseCache:
        """The cap a service's readers use: two windows and leases' worth of live steps, plus the replays."""
        return cls(lanes, 2 * (window + lease_steps) + REPLAYS_KEPT)

    def __len__(self) -> int:
        return len(self._held)

    def steps(self) -> list[int]:
        return sorted(self._held)

    def get(self, step: int, lo: int, hi: int) -> HeldStep | None:
        """The held refs of ``step`` if they cover lanes ``[lo, hi)``."""
        held = self._held.get(step)
        return held if held is not None and held.has(lo, hi) else None

    def run(self, first: int, lo: int, hi: int, limit: int) -> list[StepLanes]:
        """Held steps ``first, first + 1, ...`` (at most ``limit``, up to the first that does not cover lanes
        ``[lo, hi)``), with only those lanes' refs: every ref passed on costs its owner a borrower registration."""
        out: list[StepLanes] = []
        for step in range(first, first + limit):
            held = self.get(step, lo, hi)
            if held is None:
                break
            out.append(StepLanes(step, held.generation, only_lanes(held.lanes, lo, hi)))
        return out

    def file(self, steps: list[StepLanes], keep_from: int) -> int:
        """File the steps of a reply and evict (see the guarantees); returns how many steps were filed."""
        self.keep_from = max(self.keep_from, int(keep_from))
        filed = set()
        for step, generation, lanes in steps:
            filed.add(step)
            held = self._held.get(step)
            if held is not None and held.generation == generation:
                held.lanes = [new if new is not None else old for old, new in zip(held.lanes, lanes)]
            else:
                self._held[step] = HeldStep(generation, list(lanes))
            if step in self._replayed:
                self._replayed.remove(step)
            if generation == REPLAYED:
                self._replayed.append(step)
        while len(self._replayed) > REPLAYS_KEPT:
            self._held.pop(self._replayed.pop(0), None)
        keep = filed | set(self._replayed)
        for step in [s for s in self._held if s < self.keep_from and s not in keep]:
            del self._held[step]
        older = sorted(s for s in self._held if s not in filed)
        for step in older[: max(0, len(self._held) - self.cap)]:
            self._drop(step)
        return len(filed)

    def drop(self, step: int, generation: int) -> bool:
        """Forget ``step`` if it is held from ``generation`` (its shards were found lost)."""
        held = self._held.get(step)
        if held is None or held.generation != generation:
            return False
        self._drop(step)
        return True

    def _drop(self, step: int) -> None:
        del self._held[step]
        if step in self._replayed:
            self._replayed.remove(step)

    def clear(self) -> None:
        """Forget everything, ``keep_from`` included (a new coordinator incarnation may start lower)."""
        self._held.clear()
        self._replayed.clear()
        self.keep_from = 0

    def __repr__(self) -> str:
        return f"LeaseCache(steps={self.steps()}, keep_from={self.keep_from}, replayed={self._replayed})"
