"""The coordinator: a named, detached, async Ray actor that is thin glue between the parts of one service.

    consumers ──get_step(s)──► Coordinator (async; control plane only)
        ▲                        ├─ StepWindow      (window.py: table of refs, cursors, commits, bounds)
        │                        ├─ ProducerPool   (group.py: M producers, restarts, watchdog, rescale)
        │                        ├─ Replayer actors (replayer.py: past steps, real CPU, shared per step)
        └── lane refs ───────────┴─ ServiceState    (state.py: checkpoints + commits under state_dir)

A *pump* thread runs the ProducerPool: it keeps producers up to ``window`` steps ahead of the slowest live cursor,
files finished steps (refs + small metadata) into the StepWindow and persists collective checkpoints. Consumer
calls run on the actor's event loop: a read that must wait awaits an asyncio event, so it holds no thread.

Guarantees:
- Every step it serves has the rows of ``GlobalBatchSource(recipe).batch(s)`` (tests/test_service.py).
- It never fetches shard bytes: only metadata and small checkpoint states are ``ray.get``-ed, ``ray.wait`` does
  not fetch (tests/test_service_cluster.py checks object locations on a multi-node cluster).
- Waiting reads hold no thread: ``status()``/``commit()`` answer while hundreds of reads wait
  (tests/test_service.py::test_many_waiting_reads_hold_no_thread; 512 in benchmarks/bench_service_load.py).
- Past steps are replayed in Replayer actors, one replay shared by every rank asking for the same step.
- With ``materialized_dir`` (steps [A, N)), those steps are read from the directory in the Replayers and the
  producers start at N from its step-N checkpoint; no producer computes a prefix step
  (tests/test_materialized.py::test_service_serves_a_materialised_prefix_then_producers_from_its_end).
- It restarts itself (``coordinator_max_restarts``): a new incarnation reopens ``state_dir``, kills the old
  incarnation's producers and starts at the consumers' newest commits; clients retry (test_service_heal.py).
- Reads, commits and cursors are bounded and checked by the StepWindow (tests/test_window.py).

Limits:
- State held only in memory (cursors, the table) is lost with the process; a restart costs a restore plus up to
  K steps of replay, and in-flight reads see a delay (clients retry for ``reconnect_timeout_s``).
- A consumer more than ``window`` steps ahead of the slowest live consumer waits (backpressure) up to
  ``request_timeout_s``; cursors silent for ``consumer_ttl_s`` stop holding the window.
- Replies of the Replayers are held (as refs) for the newest 4 steps, ``window + 4`` for prefix reads (a tracked
  prefix read reads ``window`` steps ahead), on top of the table's bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import RayError

from zephon_ray.batch import lane_span
from zephon_ray.recipe import Recipe
from zephon_ray.service.config import ServiceConfig
from zephon_ray.service.errors import ServiceError
from zephon_ray.service.pool import PRODUCER_INFIX, ProducerPool
from zephon_ray.service.metrics import ServiceMetrics
from zephon_ray.service.replayer import Replayer
from zephon_ray.formats.service_state import ServiceState
from zephon_ray.service.window import Entry, Read, StepWindow, resume_step

log = logging.getLogger("zephon_ray.service")

REPLY_REFS = "refs"
"""get_step reply kind: lane refs (live window or Replayer), owned by the coordinator, borrowed by the caller."""
REPLAY_SHARED_STEPS = 4
"""Replays kept (as refs) so that W ranks reading one past step cost one replay, not W (prefix reads keep
``window + 4``: a tracked read of the prefix reads ``window`` steps ahead)."""
REPLAYER_INFIX = ".replayer."
_POLL_S = 0.05


def global_batch_nbytes(recipe: Recipe) -> int:
    """Bytes of one step's lane shards (int32 tokens + int32 positions + per-source counts)."""
    return recipe.lanes * (2 * recipe.rows_per_lane * recipe.row_length * 4 + len(recipe.sources) * 8)


def kill_named(name: str, namespace: str, infixes: tuple[str, ...]) -> int:
    """Kill the service's detached helper actors ("<service><infix>...") left by a dead incarnation."""
    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        actor_name = entry.get("name", "")
        if entry.get("namespace") == namespace and any(actor_name.startswith(name + i) for i in infixes):
            try:
                ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=True)
                killed += 1
            except Exception:  # noqa: BLE001 - already gone
                pass
    return killed


class Coordinator:
    """Created by :meth:`zephon_ray.DataService.start`; talk to it through :class:`DataService`."""

    def __init__(self, recipe: Recipe, config: ServiceConfig) -> None:
        if config.state_dir is None:
            raise ValueError("Coordinator: config.state_dir is required")
        self.recipe = recipe
        self.config = config
        self.state = ServiceState.open(recipe, config.state_dir, keep_checkpoints=config.keep_checkpoints,
                                       anchor_every=config.anchor_every)
        self._instance = uuid.uuid4().hex[:6]  # actor names and Zephon run ids never collide with an earlier one
        self._t0 = time.monotonic()
        self._incarnation = ray.get_runtime_context().was_current_actor_reconstructed
        # A restarted incarnation: the previous one's producers and replayers are orphans now.
        kill_named(config.name, config.namespace, (PRODUCER_INFIX, REPLAYER_INFIX))

        commits = self.state.consumer_commits()
        start = config.start_step if config.start_step is not None else resume_step(commits, config.max_ahead)
        # A materialised prefix [A, N): its steps are read from the directory, producers start at N from the
        # directory's checkpoint (imported into state_dir, pinned, so past steps >= N replay from it).
        self._prefix = range(0)
        if config.materialized_dir is not None:
            self._prefix, prefix_end_state = config.materialized_prefix(recipe)
            self.state.write_checkpoint(prefix_end_state, pin=True)
            if start in self._prefix:
                start = self._prefix.stop
        self._lock = threading.Lock()  # guards the window and counters (pump thread vs event loop)
        self.window = StepWindow(window=config.window, start=start, max_ahead=config.max_ahead,
                                 retain_behind=config.retain_behind, consumer_ttl_s=config.consumer_ttl_s,
                                 rows=recipe.global_batch_rows)
        self.window.commits = dict(commits)
        ckpt = self.state.nearest_checkpoint(start) or 0
        self._start = {"start_step": start, "checkpoint_step": ckpt, "replay_steps": start - ckpt,
                       "latest_commit": max(commits.values()) if commits else None, "first_batch_s": None,
                       "restarted": bool(self._incarnation)}
        self._stopping = False
        self._fatal: str | None = None
        self._rescale_to: int | None = None
        self._rescale_error: str | None = None
        self._produced_steps = 0
        self._produced_tokens = 0
        self._first_produced: float | None = None
        self._last_produced: float | None = None
        self._recent_commits: list[dict[str, Any]] = []
        self._pump_wake = threading.Event()
        self._commit_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-ray-commit")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

        self.group = ProducerPool(recipe, config, self.state, self._instance)
        self.group.metrics = self._metrics = ServiceMetrics.for_config(config)  # Ray metrics: metrics.py
        self.group.launch(config.producers, ckpt, self.state.read_checkpoint(ckpt) if ckpt else None)
        res = config.resources
        replayer_cls = ray.remote(Replayer)
        # Held for the coordinator's lifetime: Ray needs a replayer's constructor argument again to restart it.
        self._recipe_ref = ray.put(recipe)
        self._replayers = [replayer_cls.options(
            name=f"{config.name}{REPLAYER_INFIX}{self._instance}.{i}", namespace=config.namespace,
            lifetime="detached", num_cpus=res.replayer_num_cpus, resources=dict(res.replayer_resources),
            # A replayer lost with its node comes back elsewhere; calls wait for it (replays are idempotent).
            max_restarts=-1, max_task_retries=-1,
        ).remote(self._recipe_ref, config.materialized_dir) for i in range(config.replayers)]
        self._replayer_info = [r.info.remote() for r in self._replayers]
        self._replayer_next: list[int | None] = [None] * config.replayers  # expected position after queued work
        self._replays: OrderedDict[int, tuple[list[Any], Any]] = OrderedDict()
        self._replay_stats = {"requests": 0, "shared": 0, "submitted": 0, "max_replay_steps": 0, "last": None,
                              "materialized_reads": 0}
        self._pump_thread = threading.Thread(target=self._pump, name="zephon-ray-pump", daemon=True)
        self._pump_thread.start()

    # ================================================================== event-loop plumbing
    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()

    def _wake_waiters(self) -> None:  # on the loop
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def _notify(self) -> None:
        """From any thread: waiting reads re-check the window."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake_waiters)

    # ================================================================== consumer API (event loop)
    async def ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Return once every producer and replayer has started (or raise the configuration error they report)."""
        self._bind_loop()
        deadline = time.monotonic() + timeout_s
        while not self.group.started and not self._fatal:
            if time.monotonic() > deadline:
                raise ServiceError(f"service {self.config.name!r}: producers did not start within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        if self._fatal:
            raise ServiceError(self._fatal)
        for info in await asyncio.gather(*self._replayer_info):
            if info.get("error"):
                raise ServiceError(f"service {self.config.name!r}: configuration error: {info['error']}")
        return {"fingerprint": self.recipe.fingerprint, "pid": os.getpid()}

    async def recipe_and_config(self) -> tuple[Recipe, ServiceConfig]:
        return self.recipe, self.config

    async def pid(self) -> int:
        return os.getpid()

    async def get_step(self, step: int, consumer: str, rank: int | None = None, world: int | None = None,
                       track: bool = True, timeout_s: float | None = None) -> tuple[str, int, list[Any]]:
        """Reply ``(REPLY_REFS, step, lane refs)`` once step ``step`` is in the table or replayed. ``track`` moves
        this consumer's cursor (monotonic)."""
        self._bind_loop()
        timeout_s = self.config.request_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout_s
        first = True
        while True:
            with self._lock:
                if self._fatal:
                    raise ServiceError(self._fatal)
                if self._stopping:
                    raise ServiceError(f"service {self.config.name!r} is stopping")
                now = time.monotonic()
                # A tracked read re-touches its cursor while it waits: idempotent, and it keeps the cursor alive.
                kind = self.window.read(step, consumer, rank, world, track=track, now=now)
                if track and first:
                    self._pump_wake.set()
                first = False
                if kind is Read.HIT:
                    entry = self.window.table[step]
                    entry.served += 1
                    self._metrics.consumer_wait(now - (deadline - timeout_s))
                    if self._start["first_batch_s"] is None:
                        self._start["first_batch_s"] = round(now - self._t0, 3)
                    return REPLY_REFS, step, self._only_needed(entry.lanes, rank, world)
                low, high = self.window.keep_from, self.window.produce_until
            if kind is Read.REPLAY:
                lanes = self._replay_refs(step)
                if track and step in self._prefix:
                    # A consumer walking through the prefix: read ahead as producers do in the live window.
                    for ahead in range(step + 1, min(step + 1 + self.config.window, self._prefix.stop)):
                        if ahead not in self._replays:
                            self._read_prefix(ahead)
                return REPLY_REFS, step, self._only_needed(lanes, rank, world)
            if now >= deadline:
                raise TimeoutError(
                    f"step {step} was not produced within {timeout_s:.0f}s: the live window is [{low}, {high}) "
                    f"(slowest live cursor {high - self.config.window}, window {self.config.window}); a consumer "
                    f"more than `window` steps ahead waits for the slowest one (cursors expire after "
                    f"consumer_ttl_s={self.config.consumer_ttl_s:.0f}s)")
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), min(deadline - now, 1.0))
            except asyncio.TimeoutError:
                pass

    def _only_needed(self, lanes: list[Any], rank: int | None, world: int | None) -> list[Any]:
        """The refs of the lanes holding this rank's rows, None elsewhere: every ref in a reply costs the
        coordinator a borrower registration, so a rank of W >= L gets one ref, not L."""
        if world is None or world == 1:
            return list(lanes)
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, rank, world)
        return [ref if span.first <= i < span.stop else None for i, ref in enumerate(lanes)]

    async def touch(self, step: int, consumer: str, rank: int | None = None, world: int | None = None) -> None:
        """Move a cursor forward without asking for data (a read served from a read-ahead). Never moves it back."""
        with self._lock:
            self.window.touch(step, consumer, rank, world, now=time.monotonic())
        self._pump_wake.set()

    async def commit(self, step: int, consumer: str) -> dict[str, Any]:
        """Record durably that ``consumer`` checkpointed and resumes at ``step`` (at most one past what it read)."""
        with self._lock:
            self.window.commit(step, consumer)
        # The fsyncs run on one writer thread, in call order, so waiting reads never queue behind a disk flush.
        entry = await asyncio.get_running_loop().run_in_executor(self._commit_writer, self.state.add_commit, step,
                                                                 consumer)
        self._recent_commits = (self._recent_commits + [entry])[-8:]
        return entry

    async def release(self, consumer: str) -> int:
        """Forget every cursor of ``consumer`` (it stops holding the window back)."""
        with self._lock:
            n = self.window.release(consumer)
        self._pump_wake.set()
        return n

    async def invalidate(self, step: int) -> bool:
        """A client found this step's shards lost (their node died): serve it from the Replayer from now on."""
        with self._lock:
            dropped = self.window.invalidate(int(step)) is not None
            if dropped:
                self.window.replay_below = max(self.window.replay_below, int(step) + 1)
        self._replays.pop(int(step), None)
        return dropped

    async def rescale(self, producers: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """Replace the producer group by ``producers`` actors at the current step boundary; no batch changes."""
        if isinstance(producers, bool) or not isinstance(producers, int) or producers < 1:
            raise ValueError(f"producers must be an integer >= 1, got {producers!r}")
        self.config.check_lanes(self.recipe, producers)
        if self._rescale_to is not None:
            raise ServiceError("a rescale is already in progress")
        deadline = time.monotonic() + timeout_s
        self._rescale_error = None
        self._rescale_to = producers
        self._pump_wake.set()
        while self._rescale_to is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rescale to {producers} producers did not finish within {timeout_s:.0f}s")
            await asyncio.sleep(0.1)
        if self._rescale_error or self._fatal:
            raise ServiceError(self._rescale_error or self._fatal)
        gen = self.group.gen
        return {"producers": len(gen.actors), "generation": gen.number, "at_step": self.group.next_step}

    async def status(self) -> dict[str, Any]:
        self.group.resolve_infos()
        with self._lock:
            now = time.monotonic()
            w = self.window.status(now)
            cursors = w.pop("cursors")
            commits = w.pop("commits")
            elapsed = (self._last_produced or now) - (self._first_produced or now)
            produced_steps, produced_tokens = self._produced_steps, self._produced_tokens
        gb = global_batch_nbytes(self.recipe)
        gen = self.group.gen
        ckpts = self.state.checkpoint_steps()
        w.update({"floor": w["replay_below"], "next_step": self.group.next_step,
                  "inflight_steps": self.group.inflight_steps(), "bound_bytes": w["bound_steps"] * gb,
                  "global_batch_bytes": gb})
        return {
            "name": self.config.name,
            "namespace": self.config.namespace,
            "fingerprint": self.recipe.fingerprint,
            "recipe": str(self.recipe.path) if self.recipe.path else None,
            "state_dir": str(self.state.root),
            "fatal": self._fatal,
            "coordinator": {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                            "node_id": ray.get_runtime_context().get_node_id(),
                            "restarted": self._start["restarted"], "uptime_s": round(now - self._t0, 3)},
            "producers": self.group.describe(),
            "replayers": self._replayer_infos(),
            "generation": gen.number,
            "restarts": self.group.restarts,
            "hung_replacements": self.group.hung_replacements,
            "aggregate": {"store": self.group.store_address, "dir": self.config.aggregate_dir,
                          "run_id": gen.run_id},
            "window": w,
            "cursors": cursors,
            "throughput": {"produced_steps": produced_steps, "produced_tokens": produced_tokens,
                           "tokens_per_s": produced_tokens / elapsed if elapsed > 0 else None},
            "checkpoints": {"every": self.config.checkpoint_every, "count": len(ckpts),
                            "latest": ckpts[-1] if ckpts else None, "steps": ckpts[-16:],
                            "keep": self.config.keep_checkpoints, "anchor_every": self.config.anchor_every},
            "commits": {"latest": self._recent_commits[-1] if self._recent_commits else None,
                        "latest_durable_step": self.state.latest_commit(), "per_consumer": commits},
            "start": dict(self._start),
            "replay": dict(self._replay_stats),
            "materialized": {"dir": self.config.materialized_dir, "first_step": self._prefix.start,
                             "end_step": self._prefix.stop} if self.config.materialized_dir else None,
        }

    async def stop(self) -> None:
        """Stop producing, kill producers and replayers; the caller then kills this actor."""
        with self._lock:
            self._stopping = True
        self._notify()
        self._pump_wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._pump_thread.join, 10)
        self._commit_writer.shutdown(wait=True)  # commits already accepted reach the disk
        self.group.close()  # after this no restart can launch producers
        for replayer in self._replayers:
            try:
                ray.kill(replayer, no_restart=True)
            except Exception:  # noqa: BLE001
                pass

    def _replayer_infos(self) -> list[dict[str, Any] | None]:
        """Start-up infos of the replayers (pid, node), without waiting for any."""
        ready, _ = ray.wait(self._replayer_info, num_returns=len(self._replayer_info), timeout=0, fetch_local=False)
        out = []
        for ref in self._replayer_info:
            try:
                out.append(ray.get(ref, timeout=0) if ref in ready else None)
            except RayError:
                out.append(None)
        return out

    # ================================================================== replay (past steps, other actors)
    def _replay_refs(self, step: int) -> list[Any]:
        """Lane refs of ``step`` from a Replayer; a replay of the same step already asked for is shared."""
        self._replay_stats["requests"] += 1
        shared = self._replays.get(step)
        if shared is not None:
            lanes, meta = shared
            ready, _ = ray.wait([meta], timeout=0, fetch_local=False)
            failed = False
            if ready:
                try:
                    ray.get(meta, timeout=0)
                except RayError:
                    failed = True  # the replayer died or raised: ask again
            if not failed:
                self._replays.move_to_end(step)
                self._replay_stats["shared"] += 1
                return list(lanes)
            del self._replays[step]
        if step in self._prefix:
            return self._read_prefix(step)
        k = self.config.checkpoint_every
        # Prefer a replayer whose pipeline will sit just before this step; else the one used longest ago.
        best = None
        for i, position in enumerate(self._replayer_next):
            if position is not None and position <= step and step - position <= k:
                best = i
                break
        if best is None:
            best = min(range(len(self._replayers)), key=lambda i: (self._replayer_next[i] is not None, i))
            if all(p is not None for p in self._replayer_next):
                best = self._replay_stats["submitted"] % len(self._replayers)
        ckpt = self.state.nearest_checkpoint(step) or 0
        state = self.state.read_checkpoint(ckpt) if ckpt else None
        position = self._replayer_next[best]
        replayed = step - (position if position is not None and ckpt <= position <= step else ckpt)
        out = self._replayers[best].replay.options(num_returns=self.recipe.lanes + 1).remote(step, ckpt, state, k)
        self._replayer_next[best] = step + 1
        stats = self._replay_stats
        stats["max_replay_steps"] = max(stats["max_replay_steps"], replayed)
        self._metrics.replay(replayed)
        stats["last"] = {"step": step, "replay_steps": replayed}
        return self._share_replay(step, list(out[:-1]), out[-1], REPLAY_SHARED_STEPS)

    def _read_prefix(self, step: int) -> list[Any]:
        """A materialised step: one row-group read in any replayer (spread round-robin, no pipeline position)."""
        best = self._replay_stats["submitted"] % len(self._replayers)
        out = self._replayers[best].read.options(num_returns=self.recipe.lanes + 1).remote(step)
        self._replay_stats["materialized_reads"] += 1
        return self._share_replay(step, list(out[:-1]), out[-1], self.config.window + REPLAY_SHARED_STEPS)

    def _share_replay(self, step: int, lanes: list[Any], meta: Any, keep: int) -> list[Any]:
        """Keep the newest ``keep`` replies for ranks that ask for the same step next."""
        self._replays[step] = (lanes, meta)
        while len(self._replays) > keep:
            self._replays.popitem(last=False)
        self._replay_stats["submitted"] += 1
        return lanes

    # ================================================================== pump (one thread)
    def _pump(self) -> None:
        group = self.group
        while not self._stopping and not self._fatal:
            try:
                with self._lock:
                    self.window.refresh(time.monotonic())
                    target = self.window.produce_until
                if self._rescale_to is not None:
                    self._do_rescale()
                    continue
                group.resolve_infos()
                if group.fatal:
                    self._fail(group.fatal)
                    break
                group.submit(target, self._wanted, self._submitted)
                if not group.busy:
                    group.collect(0)  # idle ping
                    self._pump_wake.wait(_POLL_S)
                    self._pump_wake.clear()
                    continue
                finished = group.collect(_POLL_S)
                if finished:
                    self._file(finished)
                if group.fatal:
                    self._fail(group.fatal)
            except Exception:  # noqa: BLE001 - never let the pump die silently: replace the group, or give up
                try:
                    group.restart(traceback.format_exc(limit=3))
                    if group.fatal:
                        self._fail(group.fatal)
                except Exception:  # noqa: BLE001
                    self._fail(f"service {self.config.name!r}: pump failed: {traceback.format_exc(limit=3)}")

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._fatal = reason
        log.error("%s", reason)
        self._notify()

    def _wanted(self, step: int) -> bool:
        with self._lock:
            return self.window.wanted(step)

    def _submitted(self, step: int) -> None:
        with self._lock:
            self.window.submitted(step)

    def _file(self, finished: list) -> None:
        now = time.monotonic()
        with self._lock:
            for item in finished:
                self._produced_steps += 1
                self._produced_tokens += self.recipe.tokens_per_step
                self.window.file(item.step, Entry(lanes=item.lane_refs, nbytes=item.meta["nbytes"]))
            self._first_produced = self._first_produced or now
            self._last_produced = now
            self._metrics.produced(len(finished), len(finished) * self.recipe.tokens_per_step, self.window)
        self._notify()

    def _do_rescale(self) -> None:
        target = self._rescale_to
        try:
            finished = self.group.rescale(target)
            if finished:
                self._file(finished)
            if self.group.fatal:
                self._rescale_error = self.group.fatal
        except Exception as exc:  # noqa: BLE001
            self._rescale_error = f"rescale failed: {exc}"
        finally:
            self._rescale_to = None
            self._notify()
