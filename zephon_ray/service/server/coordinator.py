"""The coordinator: a named, detached, async Ray actor; the glue between the parts of one service.

    NodeReader (one per node) ──lease(s, n) + cursor moves──► Coordinator ── "reads" event loop: lease
    client ──commit / status / advance / release / rescale──►   │        ── "control" event loop: the rest
                                                                 ├─ StepWindow      (window.py: refs table,
                                                                 │                   cursors, commits, bounds)
                                                                 ├─ ProducerPool    (pool.py, run by the pump thread)
                                                                 ├─ ReplayScheduler (replay_scheduler.py: Replayers)
                                                                 ├─ ServiceState    (formats/service_state.py)
                                                                 └─ status.py       (the status() report)

``DataService.start`` creates it (launch.py, through the shell ``actor_shells.CoordinatorActor``); clients talk to
it through that shell. It holds refs and cursors, nothing else: producers and replayers put and own the shards,
node readers serve the ranks of their node (node_reader.py), the pump thread files produced steps and persists
checkpoints, and waiting leases are coroutines (no thread each). Reads and control calls run on two event loops
(Ray concurrency groups), so ``status()`` and ``commit()`` never queue behind reads (benchmarks/
bench_service_load.py measures it).

Guarantees:
- Every step it serves has the rows of the reference, and it owns no shard's bytes (Ray's owner and location
  tables show the producers and replayers as owners).
- It restarts itself (``coordinator_max_restarts``): a new incarnation reopens ``state_dir``, kills the old one's
  producers and replayers (its node readers died with it) and starts at the consumers' newest commits; clients
  retry, also reads in flight at the kill.
- A configuration error found while starting is reported once by ``ready()``, naming what is wrong.
- An object-store outage or throttling is waited out (``storage_retry_s``, zephon_ray/storage/retries.py): the steps it
  holds are served on, reads of other steps wait, production resumes when the store answers again, with no
  restart. Only a spent budget or a permanent fault is fatal, as one line naming the object and the cause; no
  message carries a traceback (the log does).
- A commit is durable when it returns: it is refused beyond what the consumer was delivered, and one that cannot
  be written within the storage budget raises instead of returning.
- ``add_phase`` changes the mixture of a running service from a step no consumer has read (or was leased),
  durably in ``state_dir``; the steps made ahead under the old weights are made again by a new producer group
  (docs/recipes.md "Mixture schedules").

Limits: cursors and the refs table live in memory; a restart costs a restore plus up to K steps of replay, and
the steps the old producers held are made again. See window.py for the window's bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar, cast

import ray

from zephon_ray import storage
from zephon_ray.checks import check_int
from zephon_ray.errors import best_effort, one_line
from zephon_ray.formats.service_state import ServiceState
from zephon_ray.recipe import Recipe
from zephon_ray.service.config import ServiceConfig
from zephon_ray.service.errors import ServiceError, describe
from zephon_ray.service.server import status as status_report
from zephon_ray.service.server.metrics import GAUGE_REFRESH_S, ServiceMetrics
from zephon_ray.service.server.pool import ProducerPool
from zephon_ray.service.server.replay_scheduler import ReplayScheduler, read_materialized_prefix
from zephon_ray.service.server.window import Entry, Read, StepWindow, resume_step
from zephon_ray.service.wire import (
    PRODUCER_INFIX,
    READER_INFIX,
    REPLAYED,
    REPLAYER_INFIX,
    CursorMove,
    Reply,
    StepContainers,
    kill_named,
    lease_reply,
    only_groups,
)

log = logging.getLogger("zephon_ray.service")
T = TypeVar("T")


def _name_os_thread(name: bytes) -> None:
    """Name this OS thread (Linux ``prctl(PR_SET_NAME)``; elsewhere nothing), so that ``top -H``, profilers and the
    per-thread CPU of /proc tell the pump apart from the event loops' threads. It must run in the thread itself,
    inside the actor: Python 3.11 gives a ``threading.Thread`` name to Python only."""
    with best_effort(log, "not Linux: the name is only for measurements"):
        import ctypes

        ctypes.CDLL(None).prctl(15, name[:15], 0, 0, 0)


MAX_LEASE_STEPS = 1024
_BUSY_POLL_S = 0.25
"""How long the pump waits for a producer call to finish (the first finished call ends the wait at once, pool.collect;
nothing else does, so a step that a cursor move made wanted is submitted at most this late while the producers are
busy). A shorter wait cut a rank's data-wait p99 with one handle per rank by about 4x in a W = 256 run, but a long
step then pays 20 wake-ups a second."""
_IDLE_WAIT_S = 2.0
"""How long an idle pump sleeps unless woken (a cursor move, a commit, a release, a rescale wakes it). Every change
that gives producers work wakes it at once, so this only paces cursor expiry and the idle pings
(pool.PING_EVERY_S): at 0.5 s an idle coordinator spent a few CPU-ms per second waking up."""
_STOP_WAIT_S = 40.0
"""How long ``stop()`` waits for the pump and the writes in progress to end (launch.stop waits 60 s for it): a write
still running when the caller then kills this actor would change ``state_dir`` after ``DataService.stop`` returned."""


class Coordinator:
    """The implementation behind :class:`~zephon_ray.service.actor_shells.CoordinatorActor` (the actor
    :meth:`zephon_ray.DataService.start` creates through launch.py); talk to it through
    :class:`~zephon_ray.DataService`."""

    def __init__(self, recipe: Recipe, config: ServiceConfig, *, reader_class: Any) -> None:
        self.recipe = recipe
        self.config = config
        self._reader_class = reader_class  # actor_shells.NodeReaderActor (passed in: no import cycle)
        self._t0 = time.monotonic()
        self._fatal: str | None = None
        self._stopping = False
        self._reads_loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._set_up = False
        if config.storage_retry_s is not None:
            storage.set_retry_budget(config.storage_retry_s)
        try:
            self._setup()
            self._set_up = True
        except Exception as exc:
            log.exception("service %r failed to start", config.name)
            self._fatal = f"service {config.name!r} failed to start: {describe(exc)}"

    def _setup(self) -> None:
        recipe, config = self.recipe, self.config
        if config.state_dir is None:
            raise ValueError("Coordinator: config.state_dir is required")
        with warnings.catch_warnings():
            # Ray 2.60's own property reads its deprecated `actor_id` and warns, three lines on the driver's terminal
            # at every service start; nothing of ours is deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        # A first start's storage has not answered yet: a misconfiguration is one line within the start budget. A
        # restarted incarnation rides out an outage of storage that answered before, for the full budget.
        anchor_every = config.anchor_every
        assert anchor_every is not None  # ServiceConfig.__post_init__ resolves None (its default) to an int
        with contextlib.nullcontext() if self._restarted else storage.first_contact():
            self.state = ServiceState.open(
                recipe, config.state_dir, keep_checkpoints=config.keep_checkpoints, anchor_every=anchor_every
            )
        # The state_dir may record phases an earlier incarnation accepted (add_phase): run under them.
        recipe = self.recipe = self.state.recipe
        self._instance = uuid.uuid4().hex[:6]  # actor names and Zephon run ids never collide with an earlier one
        # A restarted incarnation: the previous one's producers and replayers are orphans now.
        kill_named(config.name, config.namespace, (PRODUCER_INFIX, REPLAYER_INFIX))
        commits = self.state.consumer_commits()
        start = config.start_step if config.start_step is not None else resume_step(commits, config.max_ahead)
        # A materialised prefix [A, N): its steps are read from the directory, producers start at N from the
        # directory's checkpoint (imported into state_dir, pinned, so past steps >= N replay from it).
        prefix = range(0)
        if config.materialized_dir is not None:
            prefix, prefix_end_state = read_materialized_prefix(recipe, config.materialized_dir)
            self.state.write_checkpoint(prefix_end_state, pin=True)
            if start in prefix:
                start = prefix.stop
        self._lock = threading.Lock()  # guards the window and counters (pump thread vs the two event loops)
        self.window = StepWindow(
            window=config.window,
            start=start,
            max_ahead=config.max_ahead,
            retain_behind=config.retain_behind,
            consumer_ttl_s=config.consumer_ttl_s,
            rows=recipe.global_batch_rows,
            reach=max(self.state.checkpoint_steps(), default=0),
        )
        self.window.commits = dict(commits)
        ckpt = self.state.nearest_checkpoint(start) or 0
        self.start_info: dict[str, Any]
        self.counters: dict[str, Any]
        self.start_info = {
            "start_step": start,
            "checkpoint_step": ckpt,
            "replay_steps": start - ckpt,
            "latest_commit": max(commits.values()) if commits else None,
            "first_batch_s": None,
            "restarted": bool(self._restarted),
        }
        self.counters = {
            "produced_steps": 0,
            "produced_tokens": 0,
            "first_produced": None,
            "last_produced": None,
            "leases": 0,
            "leased_steps": 0,
            "lease_waits": 0,
            "lease_seconds": 0.0,
            "moves": 0,
            "bad_moves": 0,
            "reports": 0,
        }
        self.lease_nodes: dict[str, int] = {}
        self.recent_commits: list[dict[str, Any]] = []
        self._rescale_to: int | None = None
        self._rescale_error: str | None = None
        self._prefix = prefix
        self._leased_until = -1  # the highest step any lease handed out (node readers and clients may cache it)
        self._hold_from: int | None = None  # while a phase is applied: steps >= it are neither leased nor replayed
        self._phase_request: tuple[Recipe, str] | None = None
        self._phase_result: dict[str, Any] | str | None = None
        self._pump_wake = threading.Event()
        self._commit_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-ray-commit")
        self.metrics = ServiceMetrics.for_config(config)  # Ray metrics: metrics.py
        self.pool = ProducerPool(recipe, config, self.state, self._instance)
        self.pool.metrics = self.metrics
        self.pool.on_lost = self._drop_generation
        self.pool.on_launch = self._launched
        self.pool.launch(config.producers, ckpt, self.state.read_checkpoint(ckpt) if ckpt else None)
        self.replay = ReplayScheduler(recipe, config, self.state, self._instance, prefix=prefix, metrics=self.metrics)
        self.readers: dict[str, Any] = {}
        self._pump_thread = threading.Thread(target=self._pump, name="zephon-ray-pump", daemon=True)
        self._pump_thread.start()

    # ================================================================== plumbing
    def _bind_loop(self) -> None:  # on the reads loop
        if self._reads_loop is None:
            self._reads_loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()

    def _wake_waiters(self) -> None:  # on the reads loop
        event, self._changed = self._changed, asyncio.Event()
        assert event is not None  # scheduled by _notify only once _bind_loop set both
        event.set()

    def _on_reads_loop(self, call: Callable[[], T]) -> Future[T]:
        """Run ``call`` on the reads loop, the one thread that uses the ReplayScheduler (the pump and the control
        calls run on others); its future. Callers wait for it at most ``_STOP_WAIT_S``."""
        loop = self._reads_loop
        if loop is None:  # no lease has run: nothing else uses the scheduler yet
            done: Future[T] = Future()
            done.set_result(call())
            return done

        async def run() -> T:
            return call()

        return asyncio.run_coroutine_threadsafe(run(), loop)

    def _notify(self) -> None:
        """From any thread: waiting leases re-check the window."""
        loop = self._reads_loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake_waiters)

    def _check_running(self) -> None:
        if self._fatal:
            raise ServiceError(self._fatal)
        if self._stopping:
            raise ServiceError(f"service {self.config.name!r} is stopping")

    def _advance(self, moves: list[CursorMove] | None) -> None:
        """Apply cursor moves (consumer, rank, world, step, idle_s). A move that fails validation is counted and
        skipped: the read it came with is refused on its own."""
        if not moves:
            return
        now = time.monotonic()
        moved = bad = 0
        with self._lock:
            for consumer, rank, world, step, idle_s in moves:
                try:
                    moved += self.window.advance(step, consumer, rank, world, now=now, seen=now - max(0.0, idle_s))
                except (ValueError, TypeError):
                    bad += 1
            self.counters["moves"] += len(moves)
            self.counters["bad_moves"] += bad
        if moved:
            self._pump_wake.set()

    # ================================================================== reads
    async def lease(
        self,
        first: int,
        count: int = 1,
        lanes: tuple[int, int] | None = None,
        timeout_s: float | None = None,
        moves: list[CursorMove] | None = None,
        track: bool = False,
        node: str | None = None,
        wait: bool = True,
    ) -> Reply:
        """The container refs of steps ``first, first + 1, ...`` (at most ``count``, consecutive, all produced)
        holding lanes ``[lo, hi)``: a lease reply (wire.py). Waits for ``first`` to be produced, or has it replayed
        when it lies behind the live window (or ahead of it and ``track`` is False: no cursor moves producers there).
        ``moves`` are applied first. Moves no cursor itself. ``wait=False`` (a node reader's read-ahead) answers at
        once with the produced steps from ``first`` on, possibly none, and never replays."""
        t0 = time.monotonic()
        self._bind_loop()
        self._advance(moves)
        timeout_s = self.config.request_timeout_s if timeout_s is None else float(timeout_s)
        count = max(1, min(int(count), MAX_LEASE_STEPS))
        lo, hi = (
            (0, self.recipe.lanes) if lanes is None else (max(0, int(lanes[0])), min(self.recipe.lanes, int(lanes[1])))
        )
        deadline = t0 + timeout_s
        waited = False
        while True:
            with self._lock:
                self._check_running()
                now = time.monotonic()
                kind = self.window.where(self.window.check_step(first), waits=track)
                hold = self._hold_from
                if hold is not None and first >= hold:
                    kind = Read.WAIT  # a phase is being applied from `hold` on: wait for its steps
                if kind is Read.HIT:
                    run = [(s, e) for s, e in self.window.run(first, count) if hold is None or s < hold]
                    self._leased_until = max(self._leased_until, run[-1][0])
                    for _, entry in run:
                        entry.served += 1
                    self._count_lease(node, len(run), waited, now - t0)
                    total = self.recipe.lanes
                    return lease_reply(
                        [
                            StepContainers(s, e.generation, len(e.containers), only_groups(e.containers, total, lo, hi))
                            for s, e in run
                        ],
                        self.window.keep_from,
                    )
                low, high = self.window.keep_from, self.window.produce_until
                if not wait:
                    return lease_reply([], self.window.keep_from)
            if kind is Read.REPLAY:
                with self._lock:
                    self._leased_until = max(self._leased_until, first)
                container = await self._replayed(first, track or count > 1, deadline, timeout_s)
                if container is None:
                    continue  # produced while its replay was on its way: served from the table
                self._count_lease(node, 1, waited, time.monotonic() - t0)
                return lease_reply([StepContainers(first, REPLAYED, 1, [container])], self.window.keep_from)
            if now >= deadline:
                raise TimeoutError(
                    f"step {first} was not produced within {timeout_s:.0f}s: the live window is [{low}, {high}) "
                    f"(slowest live cursor {high - self.config.window}, window {self.config.window}); a consumer "
                    f"more than `window` steps ahead waits for the slowest one (cursors expire after "
                    f"consumer_ttl_s={self.config.consumer_ttl_s:.0f}s)"
                )
            waited = True
            if track and moves and node is None:
                # a direct read waiting for its step is alive: its cursor (its one move) must not expire while it
                # waits. A node reader's lease carries the moves of every rank of its node, other consumers' too:
                # refreshing those would keep a silent consumer alive for as long as any lease waits, and so hold
                # the window back forever (tests/test_service_fuzz.py); node readers keep their waiting ranks alive
                # with their own reports.
                self._advance([CursorMove(c, r, w, s, 0.0) for c, r, w, s, _ in moves])
            self._pump_wake.set()
            event = self._changed
            assert event is not None  # _bind_loop() above
            try:
                await asyncio.wait_for(event.wait(), min(deadline - now, 1.0))
            except TimeoutError:
                pass

    async def _replayed(self, step: int, read_ahead: bool, deadline: float, timeout_s: float) -> Any:
        """The container of ``step`` replayed, or None once producers filed it in the table first. Why: an untracked
        read ahead of the live window is replayed (no cursor moves producers there), but the slowest rank may move
        the window past it before the replayer answers; every read of the step, and every lease of a node reader
        that covers it, waits for this one, so none may wait on a replay of a step that is produced (it hung a
        rank's reads for as long as a replayer took to start: tests/test_service.py)."""
        # shared by every read of the step: one that stops waiting must not cancel it for the others
        replay = asyncio.ensure_future(self.replay.container(step, read_ahead=read_ahead))
        replay.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody waits for is no error
        while not replay.done():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"step {step} was not replayed within {timeout_s:.0f}s (its replayer is restoring or stuck; "
                    f"replayers={self.config.replayers})"
                )
            changed = self._changed
            assert changed is not None  # _bind_loop() ran in lease()
            with self._lock:
                if step in self.window.table:
                    return None
            waiter = asyncio.ensure_future(changed.wait())  # bounded: the wait below ends within 1 s
            await asyncio.wait({replay, waiter}, timeout=min(deadline - now, 1.0), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return replay.result()  # done: the loop above ended on it

    def _count_lease(self, node: str | None, steps: int, waited: bool, wait_s: float) -> None:
        c = self.counters
        c["leases"] += 1
        c["leased_steps"] += steps
        c["lease_waits"] += waited
        c["lease_seconds"] += wait_s  # from the handler's start: what a lease's latency spends outside it is Ray's
        if node is not None:
            self.lease_nodes[node] = self.lease_nodes.get(node, 0) + 1
        self.metrics.consumer_wait(wait_s)
        if self.start_info["first_batch_s"] is None:
            self.start_info["first_batch_s"] = round(time.monotonic() - self._t0, 3)

    # ================================================================== control
    async def ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Return once every producer and replayer has started (or raise the configuration error found)."""
        deadline = time.monotonic() + timeout_s
        while not self._fatal and not self.pool.started:
            if time.monotonic() > deadline:
                raise ServiceError(f"service {self.config.name!r}: producers did not start within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        if not self._fatal and self.pool.fatal:
            # the pump files a producer's start-up error in the pool a moment before it fails the service with it
            self._fail(self.pool.fatal)
        if self._fatal:
            raise ServiceError(self._fatal)
        error = await self.replay.check_started()
        if error:
            raise ServiceError(f"service {self.config.name!r}: configuration error: {error}")
        return {"fingerprint": self.recipe.fingerprint, "pid": os.getpid()}

    async def node_reader(self, node_id: str) -> Any:
        """The NodeReader of node ``node_id``, started on first use (owned by this actor: it dies with it)."""
        self._check_running()
        reader = self.readers.get(node_id)
        if reader is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            cfg = self.config
            reader = (
                ray.remote(self._reader_class)
                .options(
                    name=f"{cfg.name}{READER_INFIX}{self._instance}.{node_id[:16]}",
                    namespace=cfg.namespace,
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    max_concurrency=cfg.resources.coordinator_max_concurrency,
                    max_restarts=-1,
                    max_task_retries=-1,
                )
                .remote(
                    ray.get_runtime_context().current_actor,
                    lanes=self.recipe.lanes,
                    rows_per_lane=self.recipe.rows_per_lane,
                    lease_steps=cfg.lease_steps,
                    window=cfg.window,
                    consumer_ttl_s=cfg.consumer_ttl_s,
                    request_timeout_s=cfg.request_timeout_s,
                    node_id=node_id,
                )
            )
            self.readers[node_id] = reader
        return reader

    async def advance(self, moves: list[CursorMove]) -> None:
        """Cursor moves reported by a node reader (or by a direct client's ``DataService.advance``)."""
        self.counters["reports"] += 1
        self._advance(moves)

    async def commit(self, step: int, consumer: str, moves: list[CursorMove] | None = None) -> dict[str, Any]:
        """Record durably that ``consumer`` checkpointed and resumes at ``step`` (at most one past what it read,
        counting the cursor ``moves`` sent with the commit)."""
        self._advance(moves)
        own = [m[3] for m in moves or () if m[0] == consumer and isinstance(m[3], int) and not isinstance(m[3], bool)]
        with self._lock:
            self._check_running()
            self.window.commit(step, consumer, read=max(own, default=None), apply=False)
        # The writes run on one writer thread, in call order: reads and status() never wait for a disk flush or an
        # object-store outage (the write retries transient faults for the storage budget).
        try:
            entry = await asyncio.get_running_loop().run_in_executor(
                self._commit_writer, self.state.add_commit, step, consumer
            )
        except Exception as exc:
            log.exception("commit of step %d for %r not durable", step, consumer)
            raise ServiceError(
                f"service {self.config.name!r}: commit of step {step} for consumer {consumer!r} "
                f"is not durable: {describe(exc)}"
            ) from None
        with self._lock:
            self.window.commit(step, consumer, read=max(own, default=None))
        self.recent_commits = (self.recent_commits + [entry])[-8:]
        return entry

    async def release(self, consumer: str) -> int:
        """Forget every cursor of ``consumer`` (it stops holding the window back); moves heard before are ignored."""
        with self._lock:
            n = self.window.release(consumer, now=time.monotonic())
        self._pump_wake.set()
        return n

    async def invalidate(self, step: int, generation: int) -> bool:
        """A client found the shards of ``step`` (made by ``generation``) lost: make or replay it again."""
        step = int(step)
        if generation == REPLAYED:
            forgotten = asyncio.wrap_future(self._on_reads_loop(lambda: self.replay.drop(step)))
            return await asyncio.wait_for(forgotten, _STOP_WAIT_S)
        with self._lock:
            dropped = self.window.invalidate(step, generation) is not None
            if dropped:
                self.window.replay_below = max(self.window.replay_below, step + 1)
        self._notify()
        return dropped

    def _in_progress(self, request: Literal["rescale", "add_phase"]) -> bool:
        """Whether the pump has yet to finish the rescale or add_phase it was asked for. A call, not an attribute read
        in the waiting loop: the pump's thread clears the request while the caller awaits, and a type checker would
        keep the attribute's narrowed type across the await."""
        return (self._rescale_to if request == "rescale" else self._phase_request) is not None

    async def rescale(self, producers: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """Replace the producer group by ``producers`` actors at the current step boundary; no batch changes."""
        check_int("producers", producers, low=1)
        self.config.check_lanes(self.recipe, producers)
        if self._rescale_to is not None or self._phase_request is not None:
            raise ServiceError("a rescale or an add_phase is already in progress")
        deadline = time.monotonic() + timeout_s
        self._rescale_error = None
        self._rescale_to = producers
        self._pump_wake.set()
        while self._in_progress("rescale"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rescale to {producers} producers did not finish within {timeout_s:.0f}s")
            await asyncio.sleep(0.1)
        if self._rescale_error or self._fatal:
            raise ServiceError(self._rescale_error or self._fatal)
        gen = self.pool.live_generation()
        return {"producers": len(gen.actors), "generation": gen.number, "at_step": self.pool.next_step}

    async def add_phase(
        self, name: str, start_step: int, weights: dict[str, float], timeout_s: float = 300.0
    ) -> dict[str, Any]:
        """Add mixture phase ``name`` from ``start_step`` on, without a restart. Refused (ValueError, one line)
        when ``start_step`` is at or before a step some consumer has read (naming that consumer and step) or that
        a lease already handed out (a node reader or client may serve it from its cache), inside a materialised
        prefix, or when the phase itself is invalid (naming the key). Otherwise durable before it returns: the
        phase is recorded in ``state_dir`` (a restarted service, from the recipe it started with or from that
        recipe with the phase added, runs under it), checkpoints after ``start_step`` are deleted, the steps
        produced ahead from ``start_step`` on under the old weights are dropped and the producers (and any
        replayer) restart under the new schedule from the newest checkpoint at or before the first step they
        must make again (tests/test_phases.py::test_a_phase_added_to_a_running_service)."""
        t0 = time.monotonic()
        self._check_running()
        check_int("add_phase: start_step", start_step, low=1)
        if not isinstance(name, str) or not name:
            raise ValueError(f"add_phase: name must be a non-empty string, got {name!r}")
        new = self.recipe.with_phase(name, start_step, weights)  # RecipeError (a ValueError) naming the key
        if self._prefix and start_step < self._prefix.stop:
            raise ValueError(
                f"add_phase: phase {name!r} starts at step {start_step}, inside the materialised "
                f"prefix [{self._prefix.start}, {self._prefix.stop}), which is fixed"
            )
        if self._phase_request is not None or self._rescale_to is not None:
            raise ServiceError("a rescale or another add_phase is in progress")
        self._phase_result = None
        self._phase_request = (new, name)
        self._pump_wake.set()
        deadline = time.monotonic() + timeout_s
        while self._in_progress("add_phase"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"add_phase {name!r} did not finish within {timeout_s:.0f}s")
            await asyncio.sleep(0.02)
        # the pump's thread set it while we waited (a type checker still sees the None assigned above)
        result = cast("dict[str, Any] | str | None", self._phase_result)
        if isinstance(result, str):
            raise ValueError(result)
        if self._fatal:
            raise ServiceError(self._fatal)
        assert isinstance(result, dict)
        result["applied_s"] = round(time.monotonic() - t0, 4)
        return result

    def _refuse_phase(self, name: str, start: int) -> str | None:
        """(Under the lock) why a phase starting at ``start`` would rewrite a step already handed out, or None."""
        read = dict(self.window.consumed)
        for consumer, commit in self.window.commits.items():
            read[consumer] = max(read.get(consumer, -1), commit - 1)
        late = {c: s for c, s in read.items() if s >= start}
        if late:
            consumer, step = max(late.items(), key=lambda kv: kv[1])
            return (
                f"add_phase: phase {name!r} starts at step {start}, but consumer {consumer!r} has read step "
                f"{step}; a phase must start after every step a consumer has read"
            )
        if self._leased_until >= start:
            return (
                f"add_phase: phase {name!r} starts at step {start}, but step {self._leased_until} was already "
                f"leased (a node reader or client may serve it from its cache); start it after step "
                f"{self._leased_until}"
            )
        return None

    def _do_add_phase(self) -> None:
        """(Pump thread) Apply the requested phase: see :meth:`add_phase`."""
        request = self._phase_request
        assert request is not None  # the pump calls this only when one is set
        new, name = request
        start = next(p.start_step for p in new.phases if p.name == name)
        durable = False
        try:
            with self._lock:
                refused = self._refuse_phase(name, start)
                if refused is None:
                    self._hold_from = start
            if refused is not None:
                self._phase_result = refused
                return
            pool = self.pool
            finished = [f for f in pool.collect(0) if f.step < start]  # what is done; the rest is made again
            if finished:
                self._file(finished)
            if pool.fatal:
                self._fail(pool.fatal)
                return
            with self._lock:
                dropped = [s for s in sorted(self.window.table) if s >= start]
                for step in dropped:
                    self.window.invalidate(step)
            removed = self.state.add_phase(new, name)  # durable from here on
            self.recipe = pool.recipe = new
            durable = True
            self._on_reads_loop(lambda: self.replay.set_recipe(new)).result(timeout=_STOP_WAIT_S)
            restart_from = pool.adopt(start)
            self._phase_result = {
                "phase": name,
                "start_step": start,
                "fingerprint": new.fingerprint,
                "dropped_steps": dropped,
                "dropped_checkpoints": removed,
                "restart_from": restart_from,
            }
        except Exception as exc:
            log.exception("add_phase %r failed", name)
            if durable:  # recorded: the service runs under it from now on, whatever failed after that
                self._phase_result = {
                    "phase": name,
                    "start_step": start,
                    "fingerprint": new.fingerprint,
                    "warning": f"recorded, then: {describe(exc)}",
                }
                self.pool.restart(f"add_phase: {describe(exc)}")
            else:
                self._phase_result = f"add_phase: phase {name!r} failed: {describe(exc)}"
        finally:
            self._hold_from = None
            self._phase_request = None
            self._notify()

    async def status(self, moves: list[CursorMove] | None = None) -> dict[str, Any]:
        """The report of status.py; ``moves`` (the caller's own cursor moves) are applied first."""
        if not self._set_up:
            return {"name": self.config.name, "namespace": self.config.namespace, "fatal": self._fatal}
        self._advance(moves)
        return status_report.build(self)

    async def stop(self) -> None:
        """Stop producing; kill producers, replayers and node readers. The caller then kills this actor."""
        self._stopping = True
        self._notify()
        if not self._set_up:
            kill_named(self.config.name, self.config.namespace)  # whatever it launched before failing
            return
        self._pump_wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._quiesce, time.monotonic() + _STOP_WAIT_S)
        self.replay.close()
        for reader in self.readers.values():
            with best_effort(log, "already dead"):
                ray.kill(reader, no_restart=True)

    def _quiesce(self, deadline: float) -> None:
        """Stop the pump, then let the commit and checkpoint writes in progress end, each within ``deadline``."""
        self._pump_thread.join(max(0.0, deadline - time.monotonic()))
        if self._pump_thread.is_alive():
            log.warning("stop: the pump is still busy after %.0fs", _STOP_WAIT_S)
        # Commits already accepted reach the disk: the writer runs its calls in order, so a no-op ends after them.
        try:
            self._commit_writer.submit(lambda: None).result(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("stop: a commit write is still running after %.0fs", _STOP_WAIT_S)
        self._commit_writer.shutdown(wait=False)
        self.pool.close(timeout_s=max(0.0, deadline - time.monotonic()))  # after this no restart launches producers

    # ================================================================== pump (one thread)
    def _pump(self) -> None:
        _name_os_thread(b"zr-pump")  # its CPU shows apart from the event loops' (benchmarks/bench_service_load.py)
        pool = self.pool
        gauges_set = 0.0
        while not self._stopping and not self._fatal:
            try:
                now = time.monotonic()
                with self._lock:
                    self.window.refresh(now)
                    target = self.window.produce_until
                    skip_below = self.window.replay_below
                    if now - gauges_set >= GAUGE_REFRESH_S:
                        self.metrics.window_gauges(self.window)
                        gauges_set = now
                if self._rescale_to is not None:
                    self._do_rescale()
                    continue
                if self._phase_request is not None:
                    self._do_add_phase()
                    continue
                fatal = pool.resolve_infos()
                if fatal:
                    self._fail(fatal)
                    break
                if pool.recycle_due():
                    self._file_rescale(len(pool.live_generation().actors), recycle=True)
                    if pool.fatal:
                        self._fail(pool.fatal)
                    else:  # the replayers' memory grows with the run too
                        self._on_reads_loop(self.replay.retire).result(timeout=_STOP_WAIT_S)
                    continue
                if self.replay.retiring and self._reads_loop is not None:
                    self._reads_loop.call_soon_threadsafe(self.replay.reap)
                if pool.retired:
                    pool.reap(self._generation_in_use)
                pool.catch_up(skip_below)
                pool.submit(target, self._wanted, self._submitted)
                if not pool.busy:
                    pool.collect(0)  # idle ping
                    self._pump_wake.wait(_IDLE_WAIT_S)
                    self._pump_wake.clear()
                    continue
                # A long step (seconds at training-sized batches) must not cost the coordinator a wake-up every
                # 50 ms (measured: 10 CPU-ms/s at seq_len 8,192, benchmarks/bench_geometry.py).
                finished = pool.collect(_BUSY_POLL_S)
                if finished:
                    self._file(finished)
                if pool.fatal:
                    self._fail(pool.fatal)
            except Exception as exc:
                log.exception("pump: replacing the producer group")
                try:
                    # A storage fault that got here has spent its budget (or is permanent): fatal in restart().
                    fatal = pool.restart(f"pump: {describe(exc)}", transient=storage.is_transient(exc))
                    if fatal:
                        self._fail(fatal)
                except Exception as again:
                    log.exception("pump: the replacement failed too")
                    self._fail(f"service {self.config.name!r}: pump failed: {describe(again)}")

    def _fail(self, reason: str) -> None:
        # One line, always: a traceback goes to the log, never into the ServiceError every read raises.
        lines = [ln for ln in str(reason).splitlines() if ln.strip()]
        if any("Traceback (most recent call last)" in ln for ln in lines):
            log.error("%s", reason)
            lines = lines[-1:]
        self._fatal = one_line(" ".join(lines), 1000)
        log.error("%s", self._fatal)
        self._notify()

    def _wanted(self, step: int) -> bool:
        with self._lock:
            return self.window.wanted(step)

    def _submitted(self, step: int) -> None:
        with self._lock:
            self.window.submitted(step)

    def _generation_in_use(self, generation: int) -> bool:
        with self._lock:
            return any(e.generation == generation for e in self.window.table.values())

    def _drop_generation(self, generation: int) -> int | None:
        """Producer generation ``generation`` was killed and its shards with it: drop its steps. Those at or past
        the slowest cursor are made again by the next group (the step returned is the first of them); any behind
        it become the Replayer's."""
        with self._lock:
            dropped = self.window.drop_generation(generation)
            slowest = self.window.slowest
            if any(s < slowest for s in dropped):
                self.window.replay_below = max(self.window.replay_below, slowest)
            ahead = [s for s in dropped if s >= self.window.replay_below]
        self._notify()
        return min(ahead) if ahead else None

    def _launched(self, step: int) -> None:
        with self._lock:
            self.window.launched(step)
        self._notify()  # an untracked read waiting for a step the old group was handed is replayed now

    def _file(self, finished: list) -> None:
        now = time.monotonic()
        tokens = self.recipe.tokens_per_step
        with self._lock:
            c = self.counters
            for item in finished:
                c["produced_steps"] += 1
                c["produced_tokens"] += tokens
                self.window.file(
                    item.step, Entry(containers=item.containers, nbytes=item.meta["nbytes"], generation=item.generation)
                )
            c["first_produced"] = c["first_produced"] or now
            c["last_produced"] = now
            self.metrics.produced(len(finished), len(finished) * tokens)  # the gauges: the pump, once a second
        self._notify()

    def _file_rescale(self, target: int, recycle: bool = False) -> None:
        finished = self.pool.rescale(target, recycle=recycle)
        if finished:
            self._file(finished)

    def _do_rescale(self) -> None:
        target = self._rescale_to
        assert target is not None  # the pump calls this only when one is set
        try:
            self._file_rescale(target)
            if self.pool.fatal:
                self._rescale_error = self.pool.fatal
        except Exception as exc:  # noqa: BLE001
            self._rescale_error = f"rescale failed: {describe(exc)}"
        finally:
            self._rescale_to = None
            self._notify()
