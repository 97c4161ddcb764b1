"""``ProducerPool``: launch, run, watch, restart and rescale the M producer actors of one service.

Only the coordinator's pump thread drives it. Each call of :meth:`submit` sends produce/skip/checkpoint calls for
the next steps up to a target; :meth:`collect` returns the steps whose produce calls finished, as lane refs plus
the small metadata value (``ray.get`` only ever touches that value, which carries the refs of shards the producers
put and own, and collective checkpoint states; never shard bytes). Any failure replaces the whole group from the
newest durable checkpoint <= the first step it must make again: the first unfinished one, or the first step of the
killed group still in the table (its shards died with it; ``on_lost`` tells the coordinator to drop them).

Guarantees:
- A dead producer (kill -9, OOM, node loss; inside a collective checkpoint too) or one that makes no progress for
  ``progress_timeout_s`` while calls are in flight (hung: alive but stuck) is replaced with its whole group.
- A producer that fails in ``__init__`` is reported once as a configuration error naming its node and reason
  (``fatal``), not restarted again and again.
- After :meth:`close` no new producer is launched, so ``stop()`` cannot race a restart into orphans.
- A group replaced on purpose (a rescale, a phase added, a catch-up, a recycle) is retired instead of killed when
  the cluster has room for both groups: its actors stay alive (their pipelines closed) while the table still holds
  steps they own, and are killed by :meth:`reap` once it does not. Without that room it is killed, as after a
  failure, and the steps of it the table held are made again (:meth:`_replace`): retired, it would hold its
  resources until consumers passed its steps, which they cannot before the new group starts.
- A group that has made ``producer_recycle_steps`` steps is replaced by a fresh one of the same size, as a rescale
  replaces it: the memory a producer process gains over a long run is dropped with it.
- Each generation gets its own Zephon run id ``<run_id>-<instance>-g<N>``; aggregate dirs of older generations
  are removed when a new one starts.
- Storage faults are waited out, not fatal: checkpoint writes and reads retry transient object-store faults for the
  storage budget (``storage_retry_s``, zephon_ray/storage/retries.py), so a 15 s outage only pauses the pump; a
  producer call that failed on a transient fault (its Zephon read of a source) replaces the group with backoff for
  as long as that budget, without counting towards ``MAX_CONSECUTIVE_FAILURES``. Only a spent budget or a permanent
  fault (a missing bucket, refused credentials, a corrupt checkpoint) is fatal, as one line naming the object and
  the cause.
Limits: the whole group is replaced, not only the failed producer (Zephon requires every member of a collective
checkpoint group to restore the same checkpoint); the watchdog cannot tell a very slow producer from a hung one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from zephon_ray import storage
from zephon_ray.errors import best_effort, one_line
from zephon_ray.formats.service_state import ServiceState, ServiceStateError
from zephon_ray.identity import check_checkpoint_agreement
from zephon_ray.pipeline import LaneGroup
from zephon_ray.recipe import Recipe
from zephon_ray.service import ray_internals
from zephon_ray.service.config import HOSTED_STORE, ServiceConfig
from zephon_ray.service.errors import describe
from zephon_ray.service.lease_cache import producer_hold_steps
from zephon_ray.service.server.metrics import NO_METRICS
from zephon_ray.service.server.producer import KEY_CONTAINER, Producer
from zephon_ray.service.wire import PRODUCER_INFIX

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger("zephon_ray.service")

MAX_CONSECUTIVE_FAILURES = 4
"""Producer *errors* (an exception in producer code) without one finished step in between before giving up."""
MAX_CONSECUTIVE_DEATHS = 50
"""Producer *deaths* (kill -9, OOM, node loss) in a row before giving up; each restart backs off a little."""
PING_EVERY_S = 2.0
MAX_UNWRITTEN_CHECKPOINTS = 16
"""Merged checkpoints (25-350 KiB each) held unwritten while storage is out; past it the oldest one a newer one
supersedes is dropped (:meth:`ProducerPool.persist`)."""


ROOM_CHECK_S = 10.0
"""How long a group's replacement waits for the cluster's free resources (a GCS request); unanswered, it kills the
old group (:meth:`ProducerPool._replace`)."""

REPLY_READ_S = 60.0
"""Reading the reply of a call ``ray.wait`` found done (small metadata, or a merged checkpoint state)."""


def get_off_loop(refs: Any, timeout: float = REPLY_READ_S) -> Any:
    """The values of ``refs`` (one ref or a list), for the pump thread, where every one of the pool's reads runs;
    errors as ``ray.get`` raises them. On an event loop it raises instead: there a wait would stall every call the
    coordinator serves. Through ``ObjectRef.future()``, not ``ray.get``: Ray 2.60 logs "Using blocking ray.get
    inside async actor" for a ``ray.get`` on any thread of an async actor's process (``ray/_private/worker.py``
    ``get`` looks only at whether the actor is async), so the coordinator's log keeps that warning for a real one
    (tests/test_node.py reads the coordinator's log for it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("a wait for producer replies on an event loop would stall every call the coordinator serves")
    many = isinstance(refs, list)
    futures = [r.future() for r in (refs if many else [refs])]
    _, late = concurrent.futures.wait(futures, timeout=timeout)  # one deadline for all, as ray.get has
    if late:
        raise GetTimeoutError(f"no reply within {timeout} s")
    values = [f.result() for f in futures]  # all done: the wait above returned none late
    return values if many else values[0]


def fits(free_by_node: list[dict[str, float]], count: int, demand: dict[str, float]) -> bool:
    """Whether ``count`` actors that each need ``demand`` fit in the nodes' free resources, placed first-fit."""
    free = [dict(node) for node in free_by_node]
    for _ in range(count):
        node = next((n for n in free if all(n.get(k, 0.0) >= v - 1e-9 for k, v in demand.items())), None)
        if node is None:
            return False
        for k, v in demand.items():
            node[k] -= v
    return True


@dataclass
class Finished:
    step: int
    containers: list[Any]
    """One container ref per producer, in lane-group order (wire.py)."""
    meta: dict[str, int]
    generation: int


@dataclass
class _Generation:
    number: int
    actors: list[Any]
    lanes: list[tuple[int, ...]]
    run_id: str | None
    info_refs: list[Any]
    infos: list[dict[str, Any] | None] = field(default_factory=list)


class ProducerPool:
    def __init__(self, recipe: Recipe, config: ServiceConfig, state: ServiceState, instance: str) -> None:
        self.recipe = recipe
        self.config = config
        self.state = state
        self.instance = instance
        self.gen: _Generation | None = None
        self.next_step = 0
        self.fatal: str | None = None
        self.failures = self.deaths = self.restarts = 0
        self.transient_since: float | None = None  # start of a run of restarts caused by transient storage faults
        self.hung_replacements = 0
        self.recycles = self.replaced_without_room = 0
        """Groups replaced because they had made ``producer_recycle_steps`` steps, and groups replaced on purpose that
        were killed for want of room for both (:meth:`_replace`)."""
        self._recycle_at = 0
        self.last_restart: dict[str, Any] | None = None
        """Why the group was last replaced (one line), and when: what an operator asks after a restart count rose."""
        self.metrics = NO_METRICS  # the coordinator sets its ServiceMetrics (metrics.py)
        self.on_lost: Callable[[int], int | None] = lambda generation: None
        """Set by the coordinator: generation G was killed, drop its steps; returns the first one to make again."""
        self.on_launch: Callable[[int], None] = lambda step: None
        """Set by the coordinator: a group was launched at this step (calls to earlier groups are abandoned)."""
        self.retired: list[_Generation] = []  # rescaled away, alive while the table holds their shards
        self._inflight: dict[int, list[Any]] = {}  # step -> one reply ref per producer
        self._skips: dict[int, list[Any]] = {}
        self._ckpts: dict[int, list[Any]] = {}
        self._ckpt_checked: set = set()  # checkpoint calls already read once (their error, if any, surfaced)
        self._seen_done: set = set()  # calls found done whose step still waits on another producer's call
        self._last_progress = time.monotonic()
        self._last_ping = time.monotonic()
        self._store: TCPStore | None = None
        self._store_address: str | None = None
        self._closed = False
        self._launch_lock = threading.Lock()
        # Checkpoints are written by one thread of their own, in order: production goes on while storage is out
        # (a write retries transient faults for the storage budget), and only durable ones are ever restored.
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-ray-ckpt")
        self._writing: dict[int, concurrent.futures.Future] = {}

    # ------------------------------------------------------------------ lifecycle
    def live_generation(self) -> _Generation:
        """The current generation: None only before the first :meth:`launch`, which the coordinator runs while it
        sets up, before its pump starts and before ``status()`` reports (the callers of what uses this); never None
        again."""
        gen = self.gen
        assert gen is not None, "no producer group launched yet"
        return gen

    @property
    def store_address(self) -> str | None:
        return self._store_address or self.config.aggregate_store

    def _aggregation(self, number: int) -> tuple[str | None, str | None, str | None]:
        """(run_id, store, dir): each generation of each coordinator instance gets its own Zephon run id, so a
        replaced group never meets half-finished rounds of the one it replaces."""
        if not self.config.run_id:
            return None, None, None
        run_id = f"{self.config.run_id}-{self.instance}-g{number}"
        store = self.config.aggregate_store
        if store == HOSTED_STORE:
            if self._store is None:
                from torch.distributed import TCPStore

                host = ray.util.get_node_ip_address()
                self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
                self._store_address = f"torch://{host}:{self._store.port}"
            store = self._store_address
        return run_id, store, self.config.aggregate_dir

    def _remove_old_aggregate_dirs(self, keep_run_id: str) -> None:
        if not self.config.aggregate_dir or not self.config.run_id:
            return
        pattern = re.compile(rf"^{re.escape(self.config.run_id)}-[0-9a-f]{{6}}-g\d+(-\d+)?$")
        root = storage.location(self.config.aggregate_dir)  # a shared directory or an object-store prefix
        for name in storage.entries(root):
            if pattern.match(name) and not name.startswith(keep_run_id + "-") and name != keep_run_id:
                storage.delete_tree(root.join(name))

    def launch(self, producers: int, step: int, state: dict[str, Any] | None) -> None:
        with self._launch_lock:
            if self._closed:
                return
            number = 0 if self.gen is None else self.gen.number + 1
            run_id, store, agg_dir = self._aggregation(number) if producers > 1 else (None, None, None)
            actor_cls = ray.remote(Producer)
            res = self.config.resources
            actors, lanes = [], []
            for i in range(producers):
                group = LaneGroup(
                    count=producers,
                    index=i,
                    run_id=run_id,
                    aggregate_store=store,
                    aggregate_dir=agg_dir,
                    aggregate_timeout_s=self.config.aggregate_timeout_s,
                )
                actors.append(
                    actor_cls.options(
                        name=f"{self.config.name}{PRODUCER_INFIX}{self.instance}.g{number}.{i}",
                        namespace=self.config.namespace,
                        # Detached: producers must outlive the job that started the service; the group kills them.
                        lifetime="detached",
                        num_cpus=res.producer_num_cpus,
                        resources=dict(res.producer_resources),
                        max_restarts=0,
                    ).remote(
                        self.recipe,
                        group,
                        state,
                        storage_retry_s=self.config.storage_retry_s,
                        hold_steps=producer_hold_steps(
                            self.config.window, self.config.lease_steps, self.config.retain_behind
                        ),
                        pack_bytes=self.config.pack_bytes,
                    )
                )
                lanes.append(group.owned_lanes(self.recipe.lanes))
            self.gen = _Generation(
                number=number,
                actors=actors,
                lanes=lanes,
                run_id=run_id,
                # Ray types a handle's methods as the plain methods: no `.remote` (an actor method's call)
                info_refs=[a.info.remote() for a in actors],  # type: ignore[attr-defined]
                infos=[None] * producers,
            )
            self.next_step = step
            self._recycle_at = step + self.config.producer_recycle_steps
            self.on_launch(step)
            self._last_progress = time.monotonic()
            if run_id:
                self._remove_old_aggregate_dirs(run_id)

    def close(self, timeout_s: float = 0.0) -> None:
        """No launch after this; kills the current generation and the retired ones. Checkpoints not yet being
        written are dropped (the durable ones are what a restart uses); one being written is waited for up to
        ``timeout_s``, so that it does not land after the service was stopped."""
        self._writer.shutdown(wait=False, cancel_futures=True)
        # A future cancelled by shutdown() never counts as done for wait(): only the executor's worker notifies it.
        writing = [f for f in list(self._writing.values()) if not f.cancelled()]
        _, running = concurrent.futures.wait(writing, timeout=timeout_s)
        if running:
            log.warning("stop: a checkpoint write is still running after %.0fs", timeout_s)
        with self._launch_lock:
            self._closed = True
            if self.gen is not None:
                self._kill(self.gen)
            for gen in self.retired:
                self._kill(gen)
            self.retired = []
        self._store = None

    def reap(self, in_use: Callable[[int], bool]) -> int:
        """Kill retired generations whose shards the table no longer holds; returns how many were killed."""
        keep, killed = [], 0
        for gen in self.retired:
            if in_use(gen.number):
                keep.append(gen)
            else:
                self._kill(gen)
                killed += 1
        self.retired = keep
        return killed

    def _retire(self, gen: _Generation) -> None:
        for actor in gen.actors:
            with best_effort(log, "already dead: reap() finds nothing to kill"):
                actor.close.remote()  # frees the Zephon pipeline; the shards it owns stay readable
        self.retired.append(gen)

    @staticmethod
    def _kill(gen: _Generation) -> None:
        for actor in gen.actors:
            with best_effort(log, "already dead"):
                ray.kill(actor, no_restart=True)

    def resolve_infos(self) -> str | None:
        """Non-blocking: collect producer infos that arrived; a start-up error becomes ``fatal``. Returns ``fatal``."""
        gen = self.live_generation()
        pending = [r for r, info in zip(gen.info_refs, gen.infos) if info is None]
        if not pending:
            return self.fatal
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for i, ref in enumerate(gen.info_refs):
            if gen.infos[i] is None and ref in ready:
                try:
                    info = get_off_loop(ref)
                except RayError:
                    continue  # died while starting: the pump's restart path handles it
                # fatal first: ready() reads started (every info in) from the event loop while this runs on the pump
                if info.get("error") and not self.fatal:
                    self.fatal = f"service {self.config.name!r}: configuration error: {info['error']}"
                gen.infos[i] = info
        return self.fatal

    @property
    def started(self) -> bool:
        return self.gen is not None and all(i is not None for i in self.gen.infos)

    def restart(
        self, reason: str, producers: int | None = None, death: bool = False, transient: bool = False
    ) -> str | None:
        """Replace the whole group from the newest durable checkpoint <= the first unfinished step. ``transient``:
        the cause may pass (a storage outage): retried with backoff for the storage budget, not counted as a
        failure. Returns :attr:`fatal`: None, or why the group is not replaced and will not be."""
        gen = self.live_generation()
        producers = producers or len(gen.actors)
        reason = one_line(reason, 600)  # one line, always (the log has the traceback)
        self.resolve_infos()  # a producer that could not start answered info() before failing its first call
        if self.fatal:
            return self.fatal
        now = time.monotonic()
        since = now  # start of the run of transient restarts (read only when `transient`)
        if transient:
            since = self.transient_since = self.transient_since or now
        elif death:
            self.deaths += 1
        else:
            self.failures += 1
        self.restarts += 1
        self.last_restart = {"reason": reason, "generation": gen.number, "at_step": self.next_step, "time": time.time()}
        self.metrics.producer_restart(death=death)
        budget = storage.retry_budget_s()
        if self.failures > MAX_CONSECUTIVE_FAILURES or self.deaths > MAX_CONSECUTIVE_DEATHS:
            self.fatal = (
                f"service {self.config.name!r}: producers failed {self.failures + self.deaths} times in a "
                f"row without finishing a step; last error: {reason}"
            )
            return self.fatal
        if transient and now - since > budget:
            waited = now - since
            self.fatal = (
                f"service {self.config.name!r}: producers still failing after {waited:.0f}s of retries "
                f"(storage budget {budget:g}s): {reason}"
            )
            return self.fatal
        log.warning("replacing producer group g%d (%s)", gen.number, reason[:300])
        self._kill(gen)
        streak = self.deaths + self.failures + (self.restarts if transient else 0)
        if transient:  # a storage fault: capped exponential backoff with jitter, as storage.retry does
            time.sleep(min(storage.RETRY_CAP_S, storage.RETRY_FIRST_S * 2 ** min(streak, 10)) * random.uniform(0.5, 1))
        elif self.deaths + self.failures > 1:  # repeated failures: back off instead of spinning
            time.sleep(min(0.25 * 2 ** (self.deaths + self.failures - 2), 5.0))
        pending = list(self._inflight) + list(self._ckpts) + [s for s in self._skips if s >= 0]
        remake = self.on_lost(gen.number)  # its shards died with it
        if remake is not None:
            pending.append(remake)
        first = min(pending) if pending else self.next_step
        self._inflight.clear()
        self._ckpts.clear()
        self._skips.clear()
        ckpt = self.state.nearest_checkpoint(first) or 0
        try:
            state = self.state.read_checkpoint(ckpt) if ckpt else None  # transient faults retried inside
        except (ServiceStateError, OSError) as exc:
            self.fatal = f"service {self.config.name!r}: cannot restore producers at step {ckpt}: {describe(exc)}"
            return self.fatal
        self.launch(producers, ckpt, state)
        return self.fatal

    # ------------------------------------------------------------------ running
    @property
    def busy(self) -> bool:
        return bool(self._inflight or self._skips or self._ckpts)

    def inflight_steps(self) -> list[int]:
        return sorted(self._inflight)

    def catch_up(self, first_wanted: int) -> None:
        """When the first step the window wants lies more than K steps past the producers (the consumers are far
        past the commit a restarted service began at), relaunch the group from the newest durable checkpoint <= it
        instead of stepping through the steps between: serving step s costs a restore and at most K steps, as
        after any restart. Only between calls (nothing in flight)."""
        if self.busy or self.gen is None:
            return
        ckpt = self.state.nearest_checkpoint(first_wanted)
        if ckpt is None or ckpt <= self.next_step + self.config.checkpoint_every:
            return
        log.info("producers at step %d catch up to step %d from its checkpoint", self.next_step, ckpt)
        self._relaunch(ckpt)

    def _relaunch(self, ckpt: int) -> int:
        """Replace the group by one of the same size from durable checkpoint ``ckpt`` (0: a fresh pipeline); returns
        the step it starts at (:meth:`_replace`)."""
        gen = self.live_generation()
        return self._replace(len(gen.actors), ckpt, self.state.read_checkpoint(ckpt) if ckpt else None)

    def _replace(self, producers: int, step: int, state: dict[str, Any] | None) -> int:
        """Launch ``producers`` at ``step`` from ``state`` in place of the live group, nothing in flight; returns the
        step the new group starts at. With room in the cluster for the new group beside the old one, the old one is
        retired: its shards in the table stay readable until :meth:`reap`. Without it, or without an answer from
        Ray about it within ``ROOM_CHECK_S``, the old group is killed and its steps dropped, and the new one starts
        from the newest durable checkpoint at or before the first of them that must be made again: retired, the old
        group would keep its resources while the table holds its steps, and consumers cannot pass those before the
        new group makes the next ones, so the new group would never start (without this,
        tests/test_service_faults.py::test_a_group_replaced_without_room_for_both_groups_is_not_a_hang timed out)."""
        gen = self.live_generation()
        why = self._no_room(producers)
        if why is None:
            self._retire(gen)
        else:
            log.warning("producer group g%d killed, not retired: %s", gen.number, why)
            self.replaced_without_room += 1
            self._kill(gen)
            remake = self.on_lost(gen.number)
            if remake is not None and remake < step:
                step = self.state.nearest_checkpoint(remake) or 0
                state = self.state.read_checkpoint(step) if step else None
        self.launch(producers, step, state)
        return step

    def _no_room(self, producers: int) -> str | None:
        """Why ``producers`` more producers may not fit in the cluster's free resources now, or None if they fit."""
        res = self.config.resources
        demand = {k: v for k, v in {"CPU": res.producer_num_cpus, **res.producer_resources}.items() if v > 0}
        asking = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-ray-room")
        try:
            free = asking.submit(ray_internals.free_resources_per_node).result(timeout=ROOM_CHECK_S)
            return None if fits(free, producers, demand) else f"no room for {producers} more producers ({demand} each)"
        except Exception as exc:  # noqa: BLE001 - Ray's GCS did not answer: kill, which needs no room
            return f"the cluster's free resources were not read within {ROOM_CHECK_S:.0f}s: {describe(exc)}"
        finally:
            asking.shutdown(wait=False)

    def submit(self, target: int, wanted: Callable[[int], bool], submitted: Callable[[int], None]) -> None:
        """Send calls for steps ``next_step .. target - 1`` (bounded in flight): produce the wanted ones, skip the
        rest, and a collective checkpoint call before every K-th step that is not durable yet (with M > 1, once the
        calls before it have finished)."""
        gen = self.live_generation()
        k = self.config.checkpoint_every
        while self.next_step < target and len(self._inflight) + len(self._skips) < 2 * self.config.window:
            step = self.next_step
            if step > 0 and step % k == 0 and step not in self._writing and not self.state.has_checkpoint(step):
                if len(gen.actors) > 1 and self._calls_before(step):
                    # A collective is sent once every producer has finished the calls before it, so that its
                    # timeout (aggregate_timeout_s) measures the collective alone: a producer still waiting out a
                    # storage outage in its first step must not time out a peer that went ahead into it.
                    break
                self._ckpts[step] = [a.checkpoint.remote(step) for a in gen.actors]
            if wanted(step):
                # no Ray task events: M per step, recorded and shipped to the GCS for calls nobody inspects
                self._inflight[step] = [
                    actor.produce.options(enable_task_events=False).remote(step) for actor in gen.actors
                ]
                submitted(step)
            else:
                self._skips[step] = [a.skip.remote(step) for a in gen.actors]
            self.next_step += 1

    def _calls_before(self, step: int) -> bool:
        """Whether a produce, skip or checkpoint call of a step before ``step`` is still unfinished (not a ping)."""
        return any(s < step for s in self._inflight) or any(0 <= s < step for s in (*self._skips, *self._ckpts))

    def collect(self, timeout: float) -> list[Finished]:
        """Wait up to ``timeout`` for calls to finish; returns finished steps. Failures restart the group."""
        if not self._written():
            return []
        waiting = [r for metas in self._inflight.values() for r in metas]
        waiting += [r for refs in self._skips.values() for r in refs]
        waiting += [r for refs in self._ckpts.values() for r in refs]
        now = time.monotonic()
        if not waiting:
            self._last_progress = now
            if now - self._last_ping > PING_EVERY_S:
                # Idle producers (window full) are pinged, so that one killed while idle is replaced before a
                # consumer needs the next step rather than when it does.
                self._last_ping = now
                # no task events: one ping per producer every PING_EVERY_S, for life, that nobody inspects
                self._skips[-1] = [
                    a.info.options(enable_task_events=False).remote() for a in self.live_generation().actors
                ]
            return []
        # Until the first call finishes, then whatever else is done by then: waiting for all of them held new work
        # back for up to ``timeout`` after a cursor move made steps wanted (a rank's wait p99 was 406 ms for 43 ms
        # with one handle per rank, benchmarks/bench_service_load.py). Calls already seen done are left out of the
        # first wait: with M >= 2 a step's first finished call would end every wait at once until its last one
        # finished, a spin (the pump's CPU per produced step at M = 2 was 11 ms, 1.0 at M = 1; bench's pump part).
        self._seen_done &= set(waiting)
        fresh = [r for r in waiting if r not in self._seen_done] or waiting
        ready, _ = ray.wait(fresh, num_returns=1, timeout=timeout, fetch_local=False)
        if ready and len(waiting) > 1:
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0, fetch_local=False)
        if ready:
            self._seen_done = set(ready)
        if not self.started:
            self.resolve_infos()
            now = self._last_progress = time.monotonic()  # starting (actor, identity check, restore) is not a hang
        if not ready:
            if now - self._last_progress > self.config.progress_timeout_s:
                self.hung_replacements += 1
                self.restart(
                    f"no producer call finished for {self.config.progress_timeout_s:.0f}s "
                    f"(progress_timeout_s): a producer is alive but stuck"
                )
            return []
        self._last_progress = time.monotonic()
        done = set(ready)
        out: list[Finished] = []
        try:
            pending_ckpts = {r for refs in self._ckpts.values() for r in refs}
            self._ckpt_checked &= pending_ckpts
            for step in sorted(self._ckpts):
                refs = self._ckpts[step]
                for r in refs:
                    if r in done and r not in self._ckpt_checked:
                        # surface a dead rank while the others still wait inside the collective; once per call:
                        # every read deserialises its state again (at M = 8, 40 % of the pump's CPU went here)
                        get_off_loop(r)
                        self._ckpt_checked.add(r)
                if all(r in done for r in refs):
                    states = get_off_loop(refs)  # small merged Zephon states, not shard bytes
                    check_checkpoint_agreement(states)
                    if not self.persist(step, states[0]):
                        return out
                    del self._ckpts[step]
            for step in sorted(self._skips):
                refs = self._skips[step]
                for r in refs:
                    if r in done:
                        get_off_loop(r)
                if all(r in done for r in refs):
                    del self._skips[step]
            for step in sorted(self._inflight):
                metas = self._inflight[step]
                # Read once all are done (a producer error surfaces here: metadata and refs only, never the
                # shard): each read deserialises the reply and borrows its container ref again, so no early
                # read of the finished ones, as produce calls (unlike a collective checkpoint) never wait on each
                # other.
                if all(r in done for r in metas):
                    meta_values = get_off_loop(metas)
                    del self._inflight[step]
                    meta = {
                        "step": step,
                        "nbytes": sum(m["nbytes"] for m in meta_values),
                        "tokens": sum(m["tokens"] for m in meta_values),
                    }
                    containers = [m[KEY_CONTAINER] for m in meta_values]
                    out.append(Finished(step, containers, meta, self.live_generation().number))
            if out:
                self.failures = self.deaths = 0
                self.transient_since = None
        except RayActorError as exc:
            log.warning("producer died: %s", exc)
            self.restart(f"{type(exc).__name__}: {describe(exc)}", death=True)
        except RayError as exc:
            log.warning("producer call failed: %s", exc)
            self.restart(
                describe(exc),
                transient=storage.is_transient(getattr(exc, "cause", None) or exc)
                or storage.is_transient(Exception(describe(exc))),
            )
        return out

    def persist(self, step: int, state: dict[str, Any]) -> bool:
        """Hand a merged checkpoint to the writer thread and go on producing: it is written in order, retrying
        transient faults for the storage budget (tests/test_storage_faults.py: a 15 s outage does not stall
        production). At most ``MAX_UNWRITTEN_CHECKPOINTS`` wait: beyond that (a long outage) the oldest one a newer
        one supersedes is dropped (anchors never are; with ``anchor_every = 0``, which keeps every checkpoint, this
        waits for the oldest instead), so memory stays bounded. False, with ``fatal`` set to one line naming the
        object and the cause, once one cannot be made durable."""
        while self._written() and len(self._writing) >= MAX_UNWRITTEN_CHECKPOINTS:
            if self._drop_superseded():
                continue
            oldest = self._writing[min(self._writing)]
            # bounded: the write gives up itself when the storage budget is spent
            concurrent.futures.wait([oldest], timeout=storage.retry_budget_s() + 60)
        if self.fatal:
            return False
        self._writing[step] = self._writer.submit(self.metrics.time_checkpoint, self.state.write_checkpoint, state)
        return True

    def _drop_superseded(self) -> bool:
        """Drop the oldest unwritten checkpoint that a newer one supersedes (not an anchor, not being written): a
        restart restores the newest durable one, and the pruning would delete it anyway. True if one was dropped."""
        anchor = self.state.anchor_every
        for step in sorted(self._writing)[:-1]:
            if (not anchor or step % anchor) and self._writing[step].cancel():
                del self._writing[step]
                return True
        return False

    def _written(self) -> bool:
        """Forget the checkpoint writes that finished; False, with ``fatal`` set, if one failed for good."""
        for step in sorted(self._writing):
            future = self._writing[step]
            if not future.done():
                continue
            del self._writing[step]
            exc = None if future.cancelled() else future.exception()
            if isinstance(exc, (storage.StorageError, ServiceStateError, OSError)):
                self.fatal = (
                    f"service {self.config.name!r}: the checkpoint of step {step} cannot be made durable: "
                    f"{describe(exc)}"
                )
            elif exc is not None:
                raise exc
        return not self.fatal

    def unwritten_checkpoints(self) -> list[int]:
        return sorted(self._writing)

    def drain(self) -> list[Finished]:
        out: list[Finished] = []
        while self.busy and not self.fatal:
            out += self.collect(0.05)
        return out

    def recycle_due(self) -> bool:
        """Whether the group has made ``producer_recycle_steps`` steps since it was launched (ServiceConfig)."""
        every = self.config.producer_recycle_steps
        return bool(every) and self.gen is not None and self.next_step >= self._recycle_at

    def rescale(self, target: int, recycle: bool = False) -> list[Finished]:
        """Drain (returning the steps that finished meanwhile), take a collective checkpoint at the current
        boundary, then start the new group from it (:meth:`_replace`). ``recycle``: replace the group even at the same
        size."""
        out: list[Finished] = []
        try:
            out = self.drain()
            if self.fatal:
                return out
            gen = self.live_generation()
            if recycle or target != len(gen.actors):
                step = self.next_step
                if recycle:
                    log.info("recycling producer group g%d at step %d (producer_recycle_steps)", gen.number, step)
                state = None
                if step > 0:
                    states = get_off_loop(
                        [a.checkpoint.remote(step) for a in gen.actors], timeout=self.config.aggregate_timeout_s + 30
                    )
                    state = check_checkpoint_agreement(states)
                    if not self.persist(step, state):
                        return out
                self._replace(target, step, state)
                self.recycles += recycle
        except Exception as exc:  # noqa: BLE001 - a producer died mid-rescale: fall back to durable checkpoints
            self.restart(f"rescale: {describe(exc)}", producers=target, death=isinstance(exc, RayActorError))
        return out

    def adopt(self, first: int) -> int:
        """After the recipe changed from ``first`` on (a phase added, ``self.recipe`` already the new one): abandon
        the calls in flight (no wait: a group still starting would cost its start) and replace the group by one of the
        same size under the new recipe (:meth:`_replace`) from the newest durable checkpoint <= ``first`` and <=
        every abandoned step; returns the step the new group starts at."""
        pending = list(self._inflight) + list(self._ckpts) + [s for s in self._skips if s >= 0]
        self._inflight.clear()
        self._ckpts.clear()
        self._skips.clear()
        first = min(pending + [first, self.next_step])
        return self._relaunch(self.state.nearest_checkpoint(first) or 0)

    def describe(self) -> list[dict[str, Any]]:
        gen = self.live_generation()
        return [
            {
                "index": i,
                "generation": gen.number,
                "lanes": list(lanes),
                "pid": (info or {}).get("pid"),
                "node": (info or {}).get("node"),
                "node_id": (info or {}).get("node_id"),
                "worker_id": (info or {}).get("worker_id"),
            }
            for i, (lanes, info) in enumerate(zip(gen.lanes, gen.infos))
        ]
