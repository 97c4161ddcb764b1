"""``NodeReader``: one actor per node that leases step refs from the coordinator for every rank on that node.

    processes on node A ──read(s, lanes, moves)──► NodeReader(A) ── cache hit ──► refs of steps s.. (<= window)
                                                      │ miss: one lease call for steps [s, s + n), with the
                                                      │ cursor moves of every rank on A since the last call
                                                      ▼
                                                 Coordinator.lease ──► refs of up to n produced steps

The coordinator starts it (through the shell ``actor_shells.NodeReaderActor``) when a client of its node asks for
it; clients call it from client/node_read_path.py. Why a node reader, not one rank per node serving its peers
(docs/scaling.md, benchmarks/bench_geometry.py): it needs no rendezvous among trainer ranks (ranks of one node may
belong to different jobs, consumers and process groups), a rank that dies takes nothing with it (the reader lives
on), and it is placed by Ray (``NodeAffinitySchedulingStrategy``, 0 CPUs) next to the object store the ranks read
from. A rank's call to it is node-local; the coordinator sees one lease per node per n steps.

Guarantees:
- Rows: the reader opens the containers the coordinator leased (small objects holding lane refs; wire.py) and
  hands out those lane refs, unchanged; a rank fetches the bytes itself from the object store (zero-copy on the
  producer's node).
- Few calls: a read reply carries the run of cached steps from the one asked for (up to ``window``), so a rank's
  process calls about once per run, and its cursor moves ride on those calls. The cache is the one the client
  uses too (lease_cache.py). When a lease here has waited ``DEMAND_AFTER_S``, the processes of this node that hold
  unsent moves are asked for them (``demand``, a long poll each keeps open): a consumer reading from its own cache
  never holds another one's step back for longer.
- Cursors stay exact: a lease moves no cursor. A rank's cursor moves when it reads a step with ``track=True`` or
  calls ``DataService.advance``; the reader reports those moves with its next lease, or within
  ``REPORT_GATHER_S`` when a lease waits, when a rank is heard here for the first time (so the window never moves
  past a new consumer the coordinator has not heard of), or when this node's slowest rank of a consumer moved (that
  is what lets producers move on: one report carries the round's moves of every rank here), and every
  ``consumer_ttl_s / 4`` as a keep-alive carrying how long ago each rank was last heard. Cursors never run ahead of
  the ranks. One world per consumer, the newest wins, as on the coordinator.
- A rank that dies holds nothing back beyond ``consumer_ttl_s``: its last-heard age grows in every report and the
  coordinator expires it; the reader forgets it too. The reader's cache holds only steps >= the coordinator's
  ``keep_from`` (and a few replayed ones), so its refs keep no evicted step alive for long.
- One lease in flight per step range: W ranks of a node missing the same step cost one coordinator call. When a
  read gets within a run of the end of what the reader holds, it leases what is already produced beyond it
  without waiting (read-ahead), so ranks rarely wait for a lease round trip.
- A read that joined a lease of an earlier step looks its own step up, without waiting, every ``JOIN_PROBE_S``
  while that lease is out: so no read waits out another consumer's replay of a step behind the window
  (tests/test_node_reads.py).
- Its hot calls (``read``, ``advance``) record no Ray task events (actor_shells.py): measured per call in
  benchmarks/bench_service_load.py.
- It never touches rows, so its process loads neither torch nor Zephon: 129 MB of RSS instead of 309 MB, and about
  1 s less to start.

Limits: the reader is owned by the coordinator and dies with it (clients ask the new incarnation for a new one);
a reader that dies alone is restarted by Ray with an empty cache (its unreported cursor moves are lost until the
ranks move again). ``status()`` shows cursors up to a run plus a lease old.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, cast

from ray.exceptions import RayTaskError

from zephon_ray.service.errors import NoReply, reply_within
from zephon_ray.service.lease_cache import LeaseCache, container_hold_steps
from zephon_ray.service.wire import (
    CursorMove,
    Reply,
    StepContainers,
    StepLanes,
    check_batch_reader,
    check_consumer,
    expand,
    lease_reply,
)

READ_AHEAD_BACKOFF_S = 0.2
"""After a read-ahead lease found nothing produced yet, the next one waits this long."""
DEMAND_AFTER_S = 0.5
"""A lease that has waited this long raises demand: every process listening (``demand``) sends its unsent cursor
moves now, since the step may wait for exactly those (a consumer reading from its own cache makes no call)."""
DEMAND_POLL_S = 60.0
"""A ``demand`` call with nothing to say returns after this long (the client calls again)."""
REPLY_GRACE_S = 30.0
"""A lease waits for the coordinator's answer this much longer than the coordinator itself waits for the step; past
it the lease fails with one line (a coordinator that cannot answer), and the reads waiting for it learn so."""
CALL_TIMEOUT_S = 60.0
"""The bound of the node reader's other calls to the coordinator (reports, lost shards)."""
REPORT_GATHER_S = 0.1
"""A report woken by a move (a lease waits, or the node's slowest rank of a consumer moved) goes this much later,
with the moves of the other ranks of the node that read in the same round: one coordinator call per round, not
one per rank. It goes at once when the node's slowest rank of a consumer with unsent moves is past the last
report (the node's part of the round is complete), as in lock-step when the node's last process calls. At the
edge of the window the producers wait for this report, so the gather was most of a rank's data-wait p99 with
one handle per rank (benchmarks/bench_service_load.py, docs/scaling.md)."""

JOIN_PROBE_S = 2.0
"""How long a read waits on a lease of an earlier step (which covers its own) before it looks its step up with a
lease that does not wait, and again every ``JOIN_PROBE_S``. Why: that lease may be another consumer's replay of a
step behind the window; the coordinator answers it with that step alone, when the replayer has made it (its start,
a restore and up to K steps; a stuck one, ``request_timeout_s``), while the step read here may be produced."""


@dataclass
class _Lease:
    first: int
    stop: int
    lo: int
    hi: int
    future: asyncio.Future = field(repr=False)
    wait: bool = True

    def covers(self, step: int, lo: int, hi: int) -> bool:
        return self.first <= step < self.stop and self.lo <= lo and hi <= self.hi


class NodeReader:
    """Plain class; the coordinator wraps it with ``ray.remote`` (0 CPUs, pinned to its node)."""

    def __init__(
        self,
        coordinator: Any,
        *,
        lanes: int,
        rows_per_lane: int,
        lease_steps: int,
        window: int,
        consumer_ttl_s: float,
        request_timeout_s: float,
        node_id: str,
    ) -> None:
        self._coordinator = coordinator
        self.lanes = lanes
        self.rows_per_lane = rows_per_lane
        self.lease_steps = lease_steps
        self.window = window
        self.ttl = consumer_ttl_s
        self.request_timeout_s = request_timeout_s
        self.node_id = node_id
        self._cache = LeaseCache.for_window(lanes, window, lease_steps)
        # The container refs of the steps last opened, kept at least as long as the cache can keep their lanes:
        # Ray 2.60 leaves one memory-store entry here per container whose ref is dropped while the lane refs it
        # held live on (1.2 entries per step of `tiny` before: tests/test_service_memory.py).
        self._containers: collections.deque[list[Any]] = collections.deque(
            maxlen=container_hold_steps(window, lease_steps)
        )
        self.run_steps = max(lease_steps, window)
        """Steps one read reply may carry: a rank's process calls about once per run it is handed."""
        self._leases: list[_Lease] = []
        self._heard: dict[tuple[str, int, int], list] = {}  # (consumer, rank, world) -> [step, monotonic time]
        self._moved: set[tuple[str, int, int]] = set()  # keys with a move not reported yet
        self._worlds: dict[str, int] = {}  # consumer -> the world its ranks here read at
        self._reported_slowest: dict[str, int] = {}  # consumer -> its slowest rank here, as last reported
        self._lo, self._hi = lanes, 0  # union of the lanes ranks here asked for
        # Created on the event loop by _start(), which every call of the ranks runs first: the code that uses them
        # runs after it (asserted there).
        self._wake: asyncio.Event | None = None
        self._round_complete: asyncio.Event | None = None
        self._reporter: asyncio.Task | None = None
        self._ahead_after = 0.0
        self._demand_epoch = 0
        self._demanded: asyncio.Event | None = None
        self.stats = {
            "reads": 0,
            "hits": 0,
            "advances": 0,
            "leases": 0,
            "read_aheads": 0,
            "join_probes": 0,
            "leased_steps": 0,
            "reports": 0,
            "moves_reported": 0,
            "demands": 0,
        }

    # ------------------------------------------------------------------ ranks' calls
    async def read(
        self,
        step: int,
        consumer: str,
        lanes: tuple[int, int] | None = None,
        track: bool = False,
        timeout_s: float | None = None,
        moves: list[CursorMove] | None = None,
    ) -> Reply:
        """A read reply (wire.py) for one process: step ``step`` and the cached steps after it (at most
        ``run_steps``), with the refs of lanes ``[lo, hi)`` (the union of the process's ranks' lanes; all lanes
        for None). ``moves`` are the process's cursor moves ``(consumer, rank, world, step, idle_s)`` since its
        last call, applied first; ``track``: the caller's cursor is at ``step`` (it may wait for it to be
        produced), or a step behind it (a process's read-ahead, client/node_read_path.py)."""
        self._start()
        check_consumer(consumer)
        if moves:
            self._apply(moves)
        lo, hi = (0, self.lanes) if lanes is None else (int(lanes[0]), int(lanes[1]))
        if not 0 <= lo < hi <= self.lanes:
            raise ValueError(f"lanes [{lo}, {hi}) are not a lane range of a recipe with {self.lanes} lanes")
        self.stats["reads"] += 1
        self._lo, self._hi = min(self._lo, lo), max(self._hi, hi)
        timeout_s = self.request_timeout_s if timeout_s is None else float(timeout_s)
        first_look = True
        while True:
            if self._cache.get(step, lo, hi) is not None:
                if first_look:
                    self.stats["hits"] += 1
                run = self._cache.run(step, lo, hi, self.run_steps)
                self._read_ahead(step + len(run), step, timeout_s)
                return lease_reply(run, self._cache.keep_from)
            first_look = False
            # the covering lease nearest the step: a probe of it, or the step's own lease, before an earlier step's
            lease = max((x for x in self._leases if x.covers(step, lo, hi)), key=lambda x: x.first, default=None)
            if lease is None:
                lease = self._lease(step, track, timeout_s)
            try:
                if lease.first < step and lease.wait:
                    try:
                        await asyncio.wait_for(asyncio.shield(lease.future), JOIN_PROBE_S)
                    except TimeoutError:
                        self.stats["join_probes"] += 1
                        lease = self._lease(step, False, timeout_s, wait=False)  # answered at once, never replayed
                await asyncio.shield(lease.future)
            except Exception:
                if lease.first == step:
                    raise  # the coordinator's answer about this step (ValueError, TimeoutError, ServiceError)
                # a lease for an earlier step failed: ask for this one ourselves

    async def advance(self, moves: list[CursorMove]) -> None:
        """Cursor moves of ranks on this node (tracked reads or ``DataService.advance`` calls a process has not
        sent with a read call yet: it sends them alone only as a keep-alive)."""
        self._start()
        self.stats["advances"] += 1
        self._apply(moves)

    def _apply(self, moves: list[CursorMove]) -> None:
        rows = self.lanes * self.rows_per_lane
        now = time.monotonic()
        for consumer, rank, world, step, idle_s in moves:
            check_consumer(consumer)
            rank, world = check_batch_reader(rank, world, rows)
            self._move(consumer, rank, world, int(step), now - max(0.0, float(idle_s)))
        assert self._wake is not None and self._round_complete is not None  # _start() ran
        if self._wake.is_set() and self._slowest_moved():
            self._round_complete.set()

    def _slowest_moved(self) -> bool:
        """The node's slowest rank of a consumer with unsent moves is past the last report."""
        return any(self._slowest(c) > self._reported_slowest.get(c, -1) for c in {key[0] for key in self._moved})

    async def demand(self, epoch: int, timeout_s: float = DEMAND_POLL_S) -> int:
        """A long poll for processes on this node: returns the demand epoch once it is past ``epoch`` (a lease here
        has waited ``DEMAND_AFTER_S``: send your unsent moves), or after ``timeout_s`` with nothing new. Costs no CPU
        while it waits; one call per process per demand."""
        self._start()
        if self._demand_epoch <= int(epoch):
            demanded = self._demanded
            assert demanded is not None  # _start() ran
            try:
                await asyncio.wait_for(demanded.wait(), timeout=min(float(timeout_s), DEMAND_POLL_S))
            except TimeoutError:
                pass
        return self._demand_epoch

    def _raise_demand(self, lease: _Lease) -> None:
        if lease in self._leases and not lease.future.done():
            self._demand_epoch += 1
            self.stats["demands"] += 1
            event, self._demanded = self._demanded, asyncio.Event()
            assert event is not None  # a lease is made by a read, after its _start()
            event.set()

    async def invalidate(self, step: int, generation: int) -> bool:
        """A rank found the shards of ``step`` lost: forget them here and tell the coordinator."""
        self._cache.drop(step, generation)
        return await reply_within(self._coordinator.invalidate.remote(step, generation), CALL_TIMEOUT_S)

    async def release(self, consumer: str) -> int:
        """Forget this consumer's cursors here (the client released it on the coordinator)."""
        keys = [k for k in self._heard if k[0] == consumer]
        for key in keys:
            del self._heard[key]
            self._moved.discard(key)
        self._worlds.pop(consumer, None)
        self._reported_slowest.pop(consumer, None)
        return len(keys)

    async def memory(self) -> dict[str, Any]:
        """This process's pid and core-worker memory store (entries, bytes), and the container refs it holds."""
        from zephon_ray.service.ray_internals import memory_store

        return {"pid": os.getpid(), "held_containers": len(self._containers), **memory_store()}

    async def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node_id": self.node_id,
            "cached_steps": self._cache.steps(),
            "keep_from": self._cache.keep_from,
            "cursors": len(self._heard),
            "lanes": [self._lo, self._hi],
            **self.stats,
        }

    # ------------------------------------------------------------------ leases
    def _read_ahead(self, first: int, step: int, timeout_s: float) -> None:
        """The cache runs out at ``first``, less than ``run_steps`` past the step just read: lease what is produced
        from there now, without waiting, so that the ranks find their next run here (one call of theirs per run)
        and do not wait for a lease round trip. At most one read-ahead in flight; after one that found nothing,
        none for ``READ_AHEAD_BACKOFF_S``."""
        if first >= step + self.run_steps or time.monotonic() < self._ahead_after:
            return
        if any(x.first <= first < x.stop for x in self._leases):
            return
        self.stats["read_aheads"] += 1
        self._lease(first, False, timeout_s, wait=False)

    def _lease(self, first: int, track: bool, timeout_s: float, wait: bool = True) -> _Lease:
        lease = _Lease(
            first, first + self.lease_steps, self._lo, self._hi, asyncio.get_running_loop().create_future(), wait
        )
        # joiners may all have moved on: mark a failure as seen so asyncio does not log it as never retrieved
        lease.future.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        self._leases.append(lease)
        asyncio.ensure_future(self._run_lease(lease, track, timeout_s, wait))
        if wait:
            asyncio.get_running_loop().call_later(DEMAND_AFTER_S, self._raise_demand, lease)
        return lease

    async def _run_lease(self, lease: _Lease, track: bool, timeout_s: float, wait: bool = True) -> None:
        self.stats["leases"] += 1
        try:
            call = self._coordinator.lease.remote(
                lease.first,
                lease.stop - lease.first,
                (lease.lo, lease.hi),
                timeout_s,
                self._moves(),
                track,
                self.node_id,
                wait,
            )
            try:
                reply = await reply_within(call, timeout_s + REPLY_GRACE_S)
            except NoReply:
                raise TimeoutError(
                    f"step {lease.first}: the coordinator did not answer a lease within "
                    f"{timeout_s + REPLY_GRACE_S:.0f}s"
                ) from None
            steps = await self._open(reply.steps)
            if not wait and not steps:
                self._ahead_after = time.monotonic() + READ_AHEAD_BACKOFF_S
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            lease.future.set_exception(cause if isinstance(cause, Exception) else exc)
        except Exception as exc:  # noqa: BLE001 - the coordinator died: the client reconnects
            lease.future.set_exception(exc)
        else:
            self.stats["leased_steps"] += self._cache.file(steps, reply.keep_from)
            lease.future.set_result(None)
        finally:
            self._leases.remove(lease)

    async def _open(self, steps: list[StepContainers]) -> list[StepLanes]:
        """Containers -> lane refs (fetching each container: a small object on its producer's node). A step whose
        container was lost with its producer is reported to the coordinator and not filed; the read asking for it
        leases it again (made again, or replayed)."""
        refs = [c for _, _, _, containers in steps for c in containers if c is not None]
        values = await asyncio.gather(*refs, return_exceptions=True)
        opened = dict(zip(map(id, refs), values))
        out: list[StepLanes] = []
        for step, generation, groups, containers in steps:
            got = {g: opened[id(c)] for g, c in enumerate(containers) if c is not None}
            if any(isinstance(v, BaseException) for v in got.values()):
                with contextlib.suppress(NoReply):  # the read that asks for the step leases it again either way
                    await reply_within(self._coordinator.invalidate.remote(step, generation), CALL_TIMEOUT_S)
                break
            lane_refs = cast(dict[int, list[Any]], got)  # no exception among them: checked above
            out.append(StepLanes(step, generation, expand(groups, lane_refs, self.lanes)))
            self._containers.append([c for c in containers if c is not None])
        return out

    # ------------------------------------------------------------------ cursor reports
    def _start(self) -> None:
        if self._reporter is None:
            self._demanded = asyncio.Event()
            self._wake = asyncio.Event()
            self._round_complete = asyncio.Event()
            self._reporter = asyncio.ensure_future(self._report_loop())

    def _move(self, consumer: str, rank: int, world: int, step: int, seen: float) -> None:
        key = (consumer, rank, world)
        heard = self._heard.get(key)
        if heard is None:
            if self._worlds.get(consumer, world) != world:
                # one world per consumer, the newest wins (as on the coordinator): a resized job's old ranks are
                # neither reported again nor kept alive, or their keep-alives would undo the new world's cursors
                for old in [k for k in self._heard if k[0] == consumer]:
                    del self._heard[old]
                    self._moved.discard(old)
            self._worlds[consumer] = world
            self._heard[key] = [step, seen]
            was = None
        elif seen >= heard[1]:
            # the newest move wins, even with a lower step: only the coordinator keeps cursors monotonic, and a
            # move it refused (a read past max_ahead) must never shadow the rank's later ones
            was = heard[0]
            heard[0], heard[1] = step, seen
        else:
            return  # older than what this reader heard of the rank (it came through a slower call)
        self._moved.add(key)
        assert self._wake is not None  # _start() ran (moves come through _apply)
        if any(x.wait for x in self._leases):
            self._wake.set()  # a lease may be waiting for exactly this move: report it now, not with the next lease
        elif was is None:
            # a rank heard here for the first time: until the coordinator knows it, the window may move past steps
            # this rank has yet to read (another consumer's moves reach it first), so report it with this round
            self._wake.set()
        elif (
            step > was
            and was <= self._reported_slowest.get(consumer, -1)
            and self._slowest(consumer) > self._reported_slowest[consumer]
        ):
            # this node's slowest rank of the consumer moved: producers may move on once the coordinator knows,
            # so report it (gathered with the round's other moves) rather than with the next lease
            self._wake.set()

    def _slowest(self, consumer: str) -> int:
        return min((h[0] for k, h in self._heard.items() if k[0] == consumer), default=-1)

    def _moves(self, everyone: bool = False) -> list[CursorMove]:
        """The moves not reported yet (``everyone``: every rank heard within the TTL, as a keep-alive)."""
        now = time.monotonic()
        for key in [k for k, (_, heard) in self._heard.items() if now - heard > self.ttl]:
            del self._heard[key]  # silent longer than the TTL: the coordinator expires it too
            self._moved.discard(key)
        keys = list(self._heard) if everyone else [k for k in self._moved if k in self._heard]
        self._moved.clear()
        for consumer in {k[0] for k in keys}:
            self._reported_slowest[consumer] = self._slowest(consumer)
        out = [
            CursorMove(c, r, w, self._heard[(c, r, w)][0], round(now - self._heard[(c, r, w)][1], 3))
            for c, r, w in keys
        ]
        self.stats["moves_reported"] += len(out)
        return out

    async def _report_loop(self) -> None:
        wake, round_complete = self._wake, self._round_complete  # never replaced once _start() made them
        assert wake is not None and round_complete is not None  # _start() made them before starting this loop
        keepalive = max(0.5, min(self.ttl / 4, 30.0))
        last_keepalive = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(wake.wait(), timeout=keepalive)
            except TimeoutError:
                pass
            else:
                try:
                    await asyncio.wait_for(round_complete.wait(), timeout=REPORT_GATHER_S)
                except TimeoutError:
                    pass
            wake.clear()
            round_complete.clear()
            everyone = time.monotonic() - last_keepalive >= keepalive
            if everyone:
                last_keepalive = time.monotonic()
            moves = self._moves(everyone=everyone)
            if not moves:
                continue
            self.stats["reports"] += 1
            try:
                await reply_within(self._coordinator.advance.remote(moves), CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the coordinator is gone or restarting; the next report retries
                await asyncio.sleep(0.5)
