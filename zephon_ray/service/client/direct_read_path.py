"""``DirectReads``: a client's direct read path, one coordinator call per read (``read_path="direct"``).

    refs(s, rank, world) ──lease(s, 1, lanes, moves)──► Coordinator ──► container refs ──ray.get──► lane refs

What it is for: it leases exactly the step it reads, never a run ahead, so what the coordinator counts as read is
what the consumer read. A phase added to a running service (``DataService.add_phase``) must start after every
step leased out; on this path that is right after the consumer's reads, on the node path a few steps later
(docs/recipes.md "Mixture schedules"). Ranks reading this way also reach the coordinator as ranks of other nodes
would, one call each.

Guarantees: the rows are the coordinator's, unchanged; a tracked read moves the cursor with the call itself,
``advance`` sends its move at once. ``prefetch`` keeps up to ``4 x window`` lease calls in flight, and is
thread-safe: its table is guarded by a lock, never held across a remote call.
Limits: one coordinator call per read and rank: O(ranks x steps) calls (docs/scaling.md); use the node path
(the default) for training at scale.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from zephon_ray.service.client.step_refs import StepRefs, call, open_containers
from zephon_ray.service.errors import ShardsLostError
from zephon_ray.service.wire import CursorMove, expand


class DirectReads:
    """The direct path of one :class:`~zephon_ray.service.client.DataService` handle (module docstring)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._prefetched: dict[tuple[int, int, int], Any] = {}  # (step, rank, world) -> lease call in flight

    def warm(self, timeout_s: float = 120.0) -> None:  # nothing to start: the coordinator answers every read
        return None

    def forget_prefetched(self) -> None:
        with self._lock:
            self._prefetched.clear()

    def reset(self) -> None:
        with self._lock:
            self._prefetched.clear()

    def prefetch(self, steps: list[int], rank: int, world: int, lo: int, hi: int) -> None:
        coordinator = self._owner._coordinator
        cap = 4 * self._owner.config.window
        for step in steps:
            key = (step, rank, world)
            with self._lock:
                if key in self._prefetched:
                    continue
            ref = coordinator.lease.remote(step, 1, (lo, hi), None, None, False)
            with self._lock:
                self._prefetched.setdefault(key, ref)
                while len(self._prefetched) > cap:  # forget the oldest unused prefetches
                    self._prefetched.pop(next(iter(self._prefetched)))

    def refs(
        self, step: int, rank: int, world: int, lo: int, hi: int, track: bool, timeout_s: float, deadline: float
    ) -> StepRefs:
        owner = self._owner
        with self._lock:
            pending = self._prefetched.pop((step, rank, world), None)
        what = f"the read of step {step}"
        if pending is not None:
            reply = call(pending, owner._where, timeout=max(0.0, deadline - time.monotonic()), what=what)
            if track:  # the prefetch did not move the cursor; this read does, once delivered
                self.advance(rank, world, step)
        else:
            moves = [CursorMove(owner.consumer, rank, world, step)] if track else None
            reply = call(
                owner._coordinator.lease.remote(step, 1, (lo, hi), timeout_s, moves, track),
                owner._where,
                timeout=max(0.0, deadline - time.monotonic()),
                what=what,
            )
        got, generation, groups, containers = reply.steps[0]
        try:
            opened = open_containers(
                [c for c in containers if c is not None], owner._where, max(1.0, deadline - time.monotonic())
            )
        except ShardsLostError:
            self.invalidate(got, generation)
            raise
        values = dict(zip((g for g, c in enumerate(containers) if c is not None), opened))
        return StepRefs(got, expand(groups, values, owner.recipe.lanes), owner.recipe, owner._pad, generation)

    def advance(self, rank: int, world: int, step: int) -> None:
        self._owner._coordinator.advance.remote([CursorMove(self._owner.consumer, rank, world, step)])

    def invalidate(self, step: int, generation: int) -> None:
        import ray

        ray.get(self._owner._coordinator.invalidate.remote(step, generation), timeout=30)

    def flush(self) -> None:
        return None

    def quiesce(self, stopping: bool = False) -> None:
        return None

    def release(self, consumer: str) -> None:
        return None
