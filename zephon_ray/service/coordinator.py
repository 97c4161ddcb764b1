"""The coordinator: a named, detached Ray actor that owns one service.

    consumers ──get_step(s)──►  Coordinator ──produce(s)──► Producer 0 (lanes 0..L/M-1)    ┐ one Zephon
        ▲                        │  step table {s: lane refs}  ──► Producer 1 (lanes L/M..)  │ collective
        └── lane refs (owned ────┘  cursors, window, state_dir       ...                    ┘ group
            by the coordinator)     side stepper (past steps)

It runs a *pump* thread that keeps producers at most ``window`` steps ahead of the slowest live consumer cursor,
files finished steps into the step table, takes a collective checkpoint every K steps and writes it durably,
and replaces the producer group when any producer dies. Consumer calls run on other threads (a threaded actor)
and block on a condition until their step is in the table.

Guarantees:
- Every step it serves has the rows of ``GlobalBatchSource(recipe).batch(s)``: live steps come from producers
  restored only from merged checkpoints at step boundaries; past steps come from a side LaneStepper restored
  from the nearest durable checkpoint <= s. Neither path touches the other's state.
- The table holds steps ``[low, low + window)`` only (``low`` = slowest live cursor), so the shard bytes it
  owns stay within ``window`` x global-batch bytes; ``status()`` reports the current and peak bytes.
- Shards are return values of producer calls: the coordinator owns them and they survive a producer crash.
- A dead producer (any moment, including inside a collective checkpoint) makes the coordinator kill the rest
  of its group and start a new group from the newest durable checkpoint <= the first unfinished step; steps
  already in the table are skipped, not re-served, so no step goes missing or appears twice.

Limits:
- The whole group is replaced, not only the dead producer: Zephon requires every participant of a collective
  checkpoint group to restore the same checkpoint. Cost: one restore plus at most K steps of replay.
- A dead producer is noticed at its next call. An idle producer (window full) that dies is replaced when the
  window moves.
- The coordinator itself is not replicated: if it dies, start a new service from the same ``state_dir``.
- A consumer that asks for a step more than ``window`` ahead of the slowest live consumer waits (backpressure)
  up to ``request_timeout_s``; cursors of consumers silent for ``consumer_ttl_s`` stop holding the window.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from zephon_ray.lanes import LaneShard, LaneStepper
from zephon_ray.pipeline import ZephonRank
from zephon_ray.recipe import Recipe
from zephon_ray.service.config import HOSTED_STORE, ServiceConfig
from zephon_ray.service.errors import ServiceError
from zephon_ray.service.producer import Producer
from zephon_ray.service.state import ServiceState

log = logging.getLogger("zephon_ray.service")

REPLY_REFS = "refs"
"""get_step reply kind: lane refs from the live window (owned by the coordinator, borrowed by the caller)."""
REPLY_DATA = "data"
"""get_step reply kind: lane shards as values (a past step replayed on the side; owned by the caller)."""
MAX_CONSECUTIVE_FAILURES = 4
"""Producer *errors* (an exception in producer code: e.g. an unreachable aggregate store, data that ran out)
without one finished step in between before the service gives up: restarting cannot fix a bug."""
MAX_CONSECUTIVE_DEATHS = 50
"""Producer *deaths* (kill -9, OOM, node loss) in a row before giving up; each restart backs off a little."""
SIDE_STEPPERS = 2
SIDE_CACHE_STEPS = 2
"""Replayed steps kept (in coordinator memory, not the object store) so that W ranks reading one past step cost
one replay, not W."""
_POLL_S = 0.05
PING_EVERY_S = 2.0


@dataclass
class _Entry:
    lane_refs: list[Any]
    nbytes: int
    served: int = 0


@dataclass
class _Cursor:
    step: int
    seen: float


@dataclass
class _Group:
    generation: int
    actors: list[Any]
    lanes: list[tuple[int, ...]]
    next_step: int
    run_id: str | None
    info_refs: list[Any]
    infos: list[dict[str, Any] | None] = field(default_factory=list)


def _shard_nbytes(shard: LaneShard) -> int:
    return int(shard.tokens.nbytes + shard.positions.nbytes + shard.source_tokens.nbytes)


def global_batch_nbytes(recipe: Recipe) -> int:
    """Bytes of one step's lane shards (int32 tokens + int32 positions + per-source counts)."""
    return recipe.lanes * (2 * recipe.rows_per_lane * recipe.row_length * 4 + len(recipe.sources) * 8)


class Coordinator:
    """Created by :meth:`zephon_ray.DataService.start`; talk to it through :class:`DataService`."""

    def __init__(self, recipe: Recipe, config: ServiceConfig) -> None:
        if config.state_dir is None:
            raise ValueError("Coordinator: config.state_dir is required")
        self.recipe = recipe
        self.config = config
        self.state = ServiceState.open(recipe, config.state_dir)
        self._cond = threading.Condition()
        self._table: dict[int, _Entry] = {}
        self._cursors: dict[tuple[str, int | None, int | None], _Cursor] = {}
        self._inflight: dict[int, tuple[int, list[Any]]] = {}  # step -> (generation, lane refs)
        self._skips: dict[int, list[Any]] = {}
        self._ckpt_inflight: dict[int, list[Any]] = {}
        self._checked: set[Any] = set()  # finished refs already checked for errors
        self._last_ping = time.monotonic()
        self._instance = uuid.uuid4().hex[:6]  # producer names never collide with an earlier coordinator's
        self._stopping = False
        self._fatal: str | None = None
        self._failures = 0
        self._deaths = 0
        self._restarts = 0
        self._store = None
        self._store_address: str | None = None
        self._rescale_to: int | None = None
        self._rescale_error: str | None = None
        self._side: list[LaneStepper] = []
        self._side_lock = threading.Lock()
        self._side_cache: OrderedDict[int, list[LaneShard]] = OrderedDict()
        self._side_stats = {"requests": 0, "max_replay_steps": 0, "last": None}
        self._held_bytes = 0
        self._peak_bytes = 0
        self._produced_steps = 0
        self._produced_tokens = 0
        self._t0 = time.monotonic()
        self._first_produced: float | None = None
        self._last_produced: float | None = None
        self._commits: list[dict[str, Any]] = []

        commit = self.state.latest_commit()
        start = config.start_step if config.start_step is not None else (commit or 0)
        ckpt = self.state.nearest_checkpoint(start) or 0
        self._floor = start
        self._low = start
        self._start = {"start_step": start, "checkpoint_step": ckpt, "replay_steps": start - ckpt,
                       "latest_commit": commit, "first_batch_s": None}
        self._group: _Group | None = None
        self._launch(config.producers, ckpt, self.state.read_checkpoint(ckpt) if ckpt else None)
        self._pump_thread = threading.Thread(target=self._pump, name="zephon-ray-pump", daemon=True)
        self._pump_thread.start()

    # ================================================================== consumer API (any thread)
    def ready(self) -> dict[str, Any]:
        return {"fingerprint": self.recipe.fingerprint, "pid": os.getpid()}

    def recipe_and_config(self) -> tuple[Recipe, ServiceConfig]:
        return self.recipe, self.config

    def get_step(self, step: int, consumer: str, rank: int | None = None, world: int | None = None,
                 track: bool = True, timeout_s: float | None = None) -> tuple[str, int, list[Any]]:
        """Block until step ``step`` is available; reply ``(REPLY_REFS, step, lane refs)`` for a live step or
        ``(REPLY_DATA, step, lane shards)`` for one replayed on the side. ``track`` moves this consumer's cursor
        (prefetches do not)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if world is None:  # a whole batch is the one rank of a world of 1
            rank, world = 0, 1
        key = (str(consumer), rank, world)
        with self._cond:
            while True:
                if self._fatal:
                    raise ServiceError(self._fatal)
                if self._stopping:
                    raise ServiceError(f"service {self.config.name!r} is stopping")
                now = time.monotonic()
                if track:
                    # One world per consumer: a consumer that restarted at another world size (or switched between
                    # batch() and slice()) must not leave its old ranks' cursors holding the window back.
                    for other in [k for k in self._cursors if k[0] == key[0] and k[2] != world]:
                        del self._cursors[other]
                    self._cursors[key] = _Cursor(step, now)
                    self._cond.notify_all()
                entry = self._table.get(step)
                if entry is not None:
                    entry.served += 1
                    if self._start["first_batch_s"] is None:
                        self._start["first_batch_s"] = now - self._t0
                    return REPLY_REFS, step, list(entry.lane_refs)
                if step < self._floor or (not track and step >= self._low + self.config.window):
                    break  # not in (or headed for) the live window: replay it on the side
                if now >= deadline:
                    raise TimeoutError(
                        f"step {step} was not produced within {timeout_s:.0f}s: the live window is "
                        f"[{self._low}, {self._low + self.config.window}) (slowest live cursor {self._low}, "
                        f"window {self.config.window}); a consumer more than `window` steps ahead waits for the "
                        f"slowest one (cursors expire after consumer_ttl_s={self.config.consumer_ttl_s:.0f}s)")
                self._cond.wait(min(deadline - now, 1.0))
        return REPLY_DATA, step, self._replay(step)

    def touch(self, step: int, consumer: str, rank: int | None = None, world: int | None = None) -> None:
        """Move a cursor without asking for data (a read served from a prefetch)."""
        if world is None:
            rank, world = 0, 1
        with self._cond:
            for other in [k for k in self._cursors if k[0] == consumer and k[2] != world]:
                del self._cursors[other]
            self._cursors[(str(consumer), rank, world)] = _Cursor(int(step), time.monotonic())
            self._cond.notify_all()

    def commit(self, step: int, consumer: str) -> dict[str, Any]:
        """Record durably that ``consumer`` checkpointed and resumes at ``step``; a restarted service starts its
        live window at the newest commit."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"commit step must be a non-negative integer, got {step!r}")
        with self._cond:
            entry = self.state.add_commit(step, consumer)
            self._commits = (self._commits + [entry])[-8:]
        return entry

    def release(self, consumer: str) -> int:
        """Forget every cursor of ``consumer`` (it stops holding the window back)."""
        with self._cond:
            keys = [k for k in self._cursors if k[0] == consumer]
            for k in keys:
                del self._cursors[k]
            self._cond.notify_all()
            return len(keys)

    def rescale(self, producers: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """Replace the producer group by ``producers`` actors at the current step boundary; no batch changes."""
        if isinstance(producers, bool) or not isinstance(producers, int) or producers < 1:
            raise ValueError(f"producers must be an integer >= 1, got {producers!r}")
        self.config.check_lanes(self.recipe, producers)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._rescale_to is not None:
                raise ServiceError("a rescale is already in progress")
            self._rescale_to = producers
            self._rescale_error = None
            self._cond.notify_all()
            while self._rescale_to is not None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rescale to {producers} producers did not finish within {timeout_s:.0f}s")
                self._cond.wait(0.5)
            if self._rescale_error:
                raise ServiceError(self._rescale_error)
            return {"producers": len(self._group.actors), "generation": self._group.generation,
                    "at_step": self._group.next_step}

    def status(self) -> dict[str, Any]:
        group = self._group
        self._resolve_infos(group, timeout=1.0)
        with self._cond:
            now = time.monotonic()
            ckpts = self.state.checkpoint_steps()
            elapsed = (self._last_produced or now) - (self._first_produced or now)
            gb = global_batch_nbytes(self.recipe)
            return {
                "name": self.config.name,
                "namespace": self.config.namespace,
                "fingerprint": self.recipe.fingerprint,
                "recipe": str(self.recipe.path) if self.recipe.path else None,
                "state_dir": str(self.state.root),
                "fatal": self._fatal,
                "producers": [
                    {"index": i, "generation": group.generation, "lanes": list(lanes),
                     "pid": (info or {}).get("pid"), "node": (info or {}).get("node")}
                    for i, (lanes, info) in enumerate(zip(group.lanes, group.infos))
                ],
                "generation": group.generation,
                "restarts": self._restarts,
                "aggregate": {"store": self._store_address or self.config.aggregate_store,
                              "dir": self.config.aggregate_dir, "run_id": group.run_id},
                "window": {
                    "size": self.config.window, "low": self._low, "floor": self._floor,
                    "next_step": group.next_step, "held_steps": sorted(self._table),
                    "inflight_steps": sorted(self._inflight),
                    "held_bytes": self._held_bytes, "peak_held_bytes": self._peak_bytes,
                    "bound_bytes": self.config.window * gb, "global_batch_bytes": gb,
                },
                "cursors": [
                    {"consumer": k[0], "rank": k[1], "world": k[2], "step": c.step, "idle_s": round(now - c.seen, 3),
                     "live": now - c.seen <= self.config.consumer_ttl_s}
                    for k, c in sorted(self._cursors.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1))
                ],
                "throughput": {
                    "produced_steps": self._produced_steps, "produced_tokens": self._produced_tokens,
                    "elapsed_s": round(elapsed, 4),
                    "tokens_per_s": self._produced_tokens / elapsed if elapsed > 0 else None,
                    "steps_per_s": self._produced_steps / elapsed if elapsed > 0 else None,
                },
                "checkpoints": {"every": self.config.checkpoint_every, "count": len(ckpts),
                                "latest": ckpts[-1] if ckpts else None, "steps": ckpts[-16:]},
                "commits": {"latest": self._commits[-1] if self._commits else None,
                            "latest_durable_step": self.state.latest_commit()},
                "start": dict(self._start),
                "replay": dict(self._side_stats),
            }

    def stop(self) -> None:
        """Stop producing and kill the producers; the caller then kills this actor."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._pump_thread.join(timeout=10)
        if self._group is not None:
            self._kill_group(self._group)
        with self._side_lock:
            for stepper in self._side:
                stepper.close(background=True)
            self._side.clear()
        self._store = None

    # ================================================================== side replay (past steps)
    def _replay(self, step: int) -> list[LaneShard]:
        """Serve a step outside the live window from a world-size-1 LaneStepper over all lanes, restored from the
        nearest durable checkpoint <= step (or reused when it is at most K steps behind)."""
        k = self.config.checkpoint_every
        with self._side_lock:
            cached = self._side_cache.get(step)
            if cached is not None:
                self._side_cache.move_to_end(step)
                self._side_stats["cache_hits"] = self._side_stats.get("cache_hits", 0) + 1
                return cached
            usable = [s for s in self._side if s.position <= step and step - s.position <= k]
            if usable:
                stepper = max(usable, key=lambda s: s.position)
                self._side.remove(stepper)
            else:
                stepper = LaneStepper(self.recipe)
                ckpt = self.state.nearest_checkpoint(step)
                if ckpt:
                    stepper.restore(self.state.read_checkpoint(ckpt))
            replayed = step - stepper.position
            while True:
                position = stepper.position
                if position > 0 and position % k == 0 and not self.state.has_checkpoint(position):
                    self.state.write_checkpoint(stepper.checkpoint())  # keep "at most K steps of replay" true
                shards = stepper.next_step()
                if position == step:
                    break
            self._side.insert(0, stepper)
            for old in self._side[SIDE_STEPPERS:]:
                old.close(background=True)
            del self._side[SIDE_STEPPERS:]
            stats = self._side_stats
            stats["requests"] += 1
            stats["max_replay_steps"] = max(stats["max_replay_steps"], replayed)
            stats["last"] = {"step": step, "replay_steps": replayed}
            out = [shards[lane] for lane in range(self.recipe.lanes)]
            self._side_cache[step] = out
            while len(self._side_cache) > SIDE_CACHE_STEPS:
                self._side_cache.popitem(last=False)
            return out

    # ================================================================== producer group
    def _aggregation(self, generation: int) -> tuple[str | None, str | None, str | None]:
        """(run_id, store, dir) for a group. Each generation gets its own Zephon run id: a replaced group must
        not meet half-finished rounds of the group it replaces in the same store or directory."""
        if not self.config.run_id:
            return None, None, None
        run_id = f"{self.config.run_id}-g{generation}"
        store = self.config.aggregate_store
        if store == HOSTED_STORE:
            if self._store is None:
                from torch.distributed import TCPStore

                host = ray.util.get_node_ip_address()
                self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
                self._store_address = f"torch://{host}:{self._store.port}"
            store = self._store_address
        return run_id, store, self.config.aggregate_dir

    def _launch(self, producers: int, step: int, state: dict[str, Any] | None) -> None:
        generation = 0 if self._group is None else self._group.generation + 1
        run_id, store, agg_dir = self._aggregation(generation) if producers > 1 else (None, None, None)
        actor_cls = ray.remote(Producer)
        actors, lanes = [], []
        for i in range(producers):
            rank = ZephonRank(groups=producers, group=i, run_id=run_id, aggregate_store=store,
                              aggregate_dir=agg_dir, aggregate_timeout_s=self.config.aggregate_timeout_s)
            actors.append(actor_cls.options(
                name=f"{self.config.name}.producer.{self._instance}.g{generation}.{i}",
                namespace=self.config.namespace,
                # Detached: producers must outlive the job that started the service (a job's non-detached
                # actors die with it), and they are killed explicitly by the coordinator.
                lifetime="detached", num_cpus=self.config.resources.producer_num_cpus, max_restarts=0,
            ).remote(self.recipe, rank, state))
            lanes.append(rank.owned_lanes(self.recipe.lanes))
        self._group = _Group(generation=generation, actors=actors, lanes=lanes, next_step=step, run_id=run_id,
                             info_refs=[a.info.remote() for a in actors], infos=[None] * producers)

    def _resolve_infos(self, group: _Group, timeout: float) -> None:
        for i, ref in enumerate(group.info_refs):
            if group.infos[i] is None:
                try:
                    info = ray.get(ref, timeout=timeout)
                except (GetTimeoutError, RayError):
                    continue
                group.infos[i] = info

    def _kill_group(self, group: _Group) -> None:
        for actor in group.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass

    def _restart(self, reason: str, producers: int | None = None, death: bool = False) -> None:
        """Replace the whole group from the newest durable checkpoint <= the first unfinished step."""
        group = self._group
        producers = producers or len(group.actors)
        if death:
            self._deaths += 1
        else:
            self._failures += 1
        self._restarts += 1
        if self._failures > MAX_CONSECUTIVE_FAILURES or self._deaths > MAX_CONSECUTIVE_DEATHS:
            with self._cond:
                self._fatal = (f"service {self.config.name!r}: producers failed "
                               f"{self._failures + self._deaths} times in a row "
                               f"without finishing a step; last error: {reason}")
                self._cond.notify_all()
            return
        log.warning("replacing producer group g%d (%s)", group.generation, reason.splitlines()[0][:300])
        self._kill_group(group)
        if self._deaths + self._failures > 1:  # repeated failures: back off instead of spinning
            time.sleep(min(0.25 * 2 ** (self._deaths + self._failures - 2), 5.0))
        pending = list(self._inflight) + list(self._ckpt_inflight) + [s for s in self._skips if s >= 0]
        first = min(pending) if pending else group.next_step
        self._inflight.clear()
        self._ckpt_inflight.clear()
        self._skips.clear()
        self._checked.clear()
        ckpt = self.state.nearest_checkpoint(first) or 0
        self._launch(producers, ckpt, self.state.read_checkpoint(ckpt) if ckpt else None)

    # ================================================================== pump (one thread)
    def _pump(self) -> None:
        while not self._stopping and not self._fatal:
            try:
                if self._rescale_to is not None:
                    self._do_rescale()
                self._submit()
                self._collect()
            except Exception:  # never let the pump die silently: replace the group, or give up loudly
                try:
                    self._restart(traceback.format_exc(limit=3))
                except Exception:
                    with self._cond:
                        self._fatal = f"service {self.config.name!r}: pump failed: {traceback.format_exc(limit=3)}"
                        self._cond.notify_all()

    def _update_window(self) -> int:
        """Under the lock: expire cursors, move ``low``/``floor`` and evict steps below ``low``."""
        now = time.monotonic()
        ttl = self.config.consumer_ttl_s
        live = [c.step for c in self._cursors.values() if now - c.seen <= ttl and c.step >= self._floor]
        low = min(live) if live else self._floor
        changed = low != self._low or low > self._floor
        self._low = low
        self._floor = max(self._floor, low)
        for step in [s for s in self._table if s < low]:
            self._held_bytes -= self._table.pop(step).nbytes
            changed = True
        if changed:
            self._cond.notify_all()
        return low

    def _submit(self) -> None:
        group = self._group
        k = self.config.checkpoint_every
        with self._cond:
            low = self._update_window()
            target = low + self.config.window
            if self._rescale_to is not None:
                target = group.next_step  # drain before a rescale
        # Bound the calls in flight too: a consumer jumping far ahead must not queue thousands of skips at once.
        while group.next_step < target and len(self._inflight) + len(self._skips) < 2 * self.config.window:
            step = group.next_step
            if step > 0 and step % k == 0 and not self.state.has_checkpoint(step):
                self._ckpt_inflight[step] = [a.checkpoint.remote(step) for a in group.actors]
            with self._cond:
                need = step >= self._low and step not in self._table
            if need:
                refs: list[Any] = []
                for actor, lanes in zip(group.actors, group.lanes):
                    out = actor.produce.options(num_returns=len(lanes)).remote(step)
                    refs.extend([out] if len(lanes) == 1 else out)
                self._inflight[step] = (group.generation, refs)
            else:
                self._skips[step] = [a.skip.remote(step) for a in group.actors]
            group.next_step += 1

    def _collect(self) -> None:
        waiting = [r for _, refs in self._inflight.values() for r in refs]
        waiting += [r for refs in self._skips.values() for r in refs]
        waiting += [r for refs in self._ckpt_inflight.values() for r in refs]
        if not waiting:
            now = time.monotonic()
            if now - self._last_ping > PING_EVERY_S:
                # Idle producers (window full) are pinged, so that one killed while idle is replaced before a
                # consumer needs the next step rather than when it does.
                self._last_ping = now
                group = self._group
                self._skips[-1] = [a.info.remote() for a in group.actors]
                return
            with self._cond:
                if not self._stopping and self._rescale_to is None:
                    self._cond.wait(_POLL_S)
            return
        ready, _ = ray.wait(waiting, num_returns=1, timeout=_POLL_S)
        if not ready:
            return
        done = set(ready)
        ready_all, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        done.update(ready_all)
        try:
            # Surface a dead producer as soon as *its* ref fails, even while the rest of its group is blocked
            # (e.g. survivors waiting inside a collective checkpoint for the dead rank).
            for ref in done - self._checked:
                ray.get(ref)
                self._checked.add(ref)
            for step in sorted(self._ckpt_inflight):
                refs = self._ckpt_inflight[step]
                if all(r in done for r in refs):
                    states = ray.get(refs)
                    self.state.write_checkpoint(states[0])
                    del self._ckpt_inflight[step]
                    self._checked.difference_update(refs)
            for step in sorted(self._skips):
                if all(r in done for r in self._skips[step]):
                    self._checked.difference_update(self._skips.pop(step))
            for step in sorted(self._inflight):
                _, refs = self._inflight[step]
                if not all(r in done for r in refs):
                    continue
                shards = ray.get(refs)
                del self._inflight[step]
                self._checked.difference_update(refs)
                self._file(step, refs, shards)
        except RayActorError as exc:
            self._restart(f"{type(exc).__name__}: {exc}", death=True)
        except RayError as exc:
            self._restart(f"{type(exc).__name__}: {exc}")

    def _file(self, step: int, refs: list[Any], shards: list[LaneShard]) -> None:
        nbytes = sum(_shard_nbytes(s) for s in shards)
        now = time.monotonic()
        self._failures = self._deaths = 0
        with self._cond:
            self._produced_steps += 1
            self._produced_tokens += self.recipe.tokens_per_step
            self._first_produced = self._first_produced or now
            self._last_produced = now
            if step >= self._low and step not in self._table:
                self._table[step] = _Entry(lane_refs=refs, nbytes=nbytes)
                self._held_bytes += nbytes
                self._peak_bytes = max(self._peak_bytes, self._held_bytes)
                self._cond.notify_all()

    def _do_rescale(self) -> None:
        """Drain, take a collective checkpoint at the current boundary, then start the new group from it."""
        target = self._rescale_to
        group = self._group
        try:
            while self._inflight or self._skips or self._ckpt_inflight:
                self._collect()
                if self._fatal:
                    return
            group = self._group  # a failure while draining may have replaced it
            if target != len(group.actors):
                step = group.next_step
                state = None
                if step > 0:
                    states = ray.get([a.checkpoint.remote(step) for a in group.actors],
                                     timeout=self.config.aggregate_timeout_s + 30)
                    state = states[0]
                    self.state.write_checkpoint(state)
                self._kill_group(group)
                self._launch(target, step, state)
        except Exception as exc:  # a producer died mid-rescale: fall back to the durable checkpoints
            self._restart(f"rescale: {type(exc).__name__}: {exc}", producers=target,
                          death=isinstance(exc, RayActorError))
        finally:
            with self._cond:
                self._rescale_to = None
                self._cond.notify_all()
