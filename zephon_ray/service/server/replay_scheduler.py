"""Replay scheduling: steps outside the live window, served by Replayer actors (replayer.py), never by the
coordinator, which holds one :class:`ReplayScheduler`.

    lease(step) ──► ReplayScheduler.container(step) ──► shared reply of step? ──yes──► its container
                                                   │ no
                                                   ├─ step of a materialised prefix [A, N)? ──► Replayer.read(step)
                                                   └─ else: the replayer whose pipeline sits just before step
                                                      (or the least used one) ──► Replayer.replay(step, ckpt, state)

Guarantees:
- One replay per step, shared by every rank and node asking for it while its reply is among the newest
  ``REPLAY_SHARED_STEPS`` (``window + REPLAY_SHARED_STEPS`` for a materialised prefix).
- A replay restores the nearest durable checkpoint <= step (at most K steps back for recent steps, ``anchor_every``
  for old ones) unless a replayer's pipeline already sits at most K steps before it (sequential past reads).
- A sequential reader of a materialised prefix reads ``window`` steps ahead, as producers do in the live window.
- A replayer starts at the first read outside the live window (with a materialised prefix: with the service), so a
  service whose consumers read only the live window runs none.
- The shards are put and owned by the replayer; a reply that failed (replayer died or raised) is dropped and asked
  again, and :meth:`ReplayScheduler.drop` forgets one whose shards a client found lost.
- A replayer is replaced without failing a call: :meth:`ReplayScheduler.retire` (each producer-group recycle, each
  phase added) sends new work to fresh processes and kills the old ones once their calls are done (plus
  ``RETIRE_GRACE_S`` for the fetches of their shards). No replay in flight is of a step a new phase changes: the
  coordinator counts a replayed step as leased, and refuses a phase that starts at or before a leased step.

Limits: the first replay also waits for its replayer's start (a process that imports Zephon: about 1-2 s here), and
a replayer that cannot read the data on its node fails that read, not the service's start, with a ServiceError
naming the node (producers check their own nodes at start). A replayer runs one call at a time, so a prefix read
can wait behind a replay in the same actor; the replies held keep their shards in the object store
(``REPLAY_SHARED_STEPS`` steps). A retired replayer lives on for its calls in flight (at most ``request_timeout_s``):
meanwhile its successor needs room of its own (``replayer_num_cpus``), or waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

from zephon_ray.errors import best_effort
from zephon_ray.formats.service_state import ServiceState
from zephon_ray.recipe import Recipe
from zephon_ray.service.config import ServiceConfig
from zephon_ray.service.errors import ServiceError
from zephon_ray.service.server.metrics import NO_METRICS
from zephon_ray.service.server.producer import KEY_CONTAINER
from zephon_ray.service.server.replayer import Replayer
from zephon_ray.service.wire import REPLAYER_INFIX

log = logging.getLogger("zephon_ray")

REPLAY_SHARED_STEPS = 4
"""Replays kept (as refs) so that W ranks reading one past step cost one replay, not W."""

RETIRE_GRACE_S = 10.0
"""How long a retired replayer outlives its last call. Why: it owns the shards of its replies, and a client that got
a reply fetches them meanwhile; one that fetches later finds them lost and has the step replayed again (drop)."""


@dataclass
class _Retired:
    """A replayer replaced by a fresh one, finishing its calls in flight before :meth:`ReplayScheduler.reap` kills
    it."""

    actor: Any
    calls: list[Any]  # futures of its calls in flight when it was retired
    kill_by: float  # monotonic: killed then, whatever is still in flight (a call past request_timeout_s has no waiter)
    idle_since: float | None = None  # when reap() first saw every call done


def read_materialized_prefix(recipe: Recipe, path: str) -> tuple[range, dict[str, Any]]:
    """``(steps [A, N) of the materialised directory at path, the Zephon state at N)``, checked against ``recipe``;
    a directory that is missing, damaged, of another recipe or without its step-N checkpoint is one ValueError
    naming it. Reads the manifest and one checkpoint."""
    from zephon_ray.formats.materialized import MaterializedError, MaterializedSource

    try:
        with MaterializedSource(path, recipe=recipe) as source:
            return source.steps, source.checkpoint(source.end_step, recipe)
    except MaterializedError as exc:
        raise ValueError(f"ServiceConfig: materialized_dir: {exc}") from None


class ReplayScheduler:
    """The coordinator's replay bookkeeping. ``lanes`` runs on the coordinator's read event loop."""

    def __init__(
        self,
        recipe: Recipe,
        config: ServiceConfig,
        state: ServiceState,
        instance: str,
        prefix: range = range(0),
        metrics: Any = NO_METRICS,
    ) -> None:
        self.recipe = recipe
        self.config = config
        self.state = state
        self.instance = instance
        self.prefix = prefix
        self.metrics = metrics
        # Held for the coordinator's lifetime: Ray needs a replayer's constructor argument again to restart it.
        self._recipe_ref = ray.put(recipe)
        self._version = 0  # bumped by retire(): part of each replayer's name
        self.replayers: list[Any]
        self.info_refs: list[Any]
        self._infos: list[dict[str, Any] | None]  # filled by the info replies' callbacks
        self._next: list[int | None]  # each replayer's position after queued work
        self._calls: list[list[Any]]  # each one's call futures, pruned
        self._new_slots()
        self._retired: list[_Retired] = []
        # step -> (reply, kept, its future, the replayer that owns it)
        self._replies: OrderedDict[int, tuple[Any, int, Any, Any]] = OrderedDict()
        self.stats: dict[str, Any]
        self.stats = {
            "requests": 0,
            "shared": 0,
            "submitted": 0,
            "max_replay_steps": 0,
            "last": None,
            "materialized_reads": 0,
            "retired": 0,
        }

    def _replayer(self, i: int) -> Any:
        """Replayer ``i``, started on its first use: a service that nobody reads outside the live window of never
        pays for one (a process that imports Zephon and torch, about 270 MB)."""
        if self.replayers[i] is None:
            config, res = self.config, self.config.resources
            self.replayers[i] = (
                ray.remote(Replayer)
                .options(
                    name=f"{config.name}{REPLAYER_INFIX}{self.instance}.{i}"
                    + (f".v{self._version}" if self._version else ""),
                    namespace=config.namespace,
                    lifetime="detached",
                    num_cpus=res.replayer_num_cpus,
                    resources=dict(res.replayer_resources),
                    # A replayer lost with its node comes back elsewhere; calls wait for it (replays are idempotent).
                    max_restarts=-1,
                    max_task_retries=-1,
                )
                .remote(
                    self._recipe_ref,
                    config.materialized_dir,
                    storage_retry_s=config.storage_retry_s,
                    pack_bytes=config.pack_bytes,
                )
            )
            self.info_refs[i] = self.replayers[i].info.remote()
            self.info_refs[i].future().add_done_callback(lambda f, i=i: self._got_info(i, f))
        return self.replayers[i]

    def _got_info(self, i: int, future: Any) -> None:
        """(Ray's callback thread) Replayer ``i`` answered ``info()``: status() reads it without a ray.get."""
        self._infos[i] = future.result() if future.exception() is None else None  # done: a done-callback

    # ------------------------------------------------------------------ serving
    async def container(self, step: int, read_ahead: bool = False) -> Any:
        """The ref of a container of the L lane refs of ``step`` (owned by a replayer), replayed or read once
        and shared."""
        self.stats["requests"] += 1
        ref = self._shared(step)
        if ref is None and step not in self.prefix:
            # The checkpoint is read off the event loop: during an object-store outage the read waits (retried
            # for the storage budget) while every other lease is served. The pump may prune it meanwhile.
            ckpt, state = await asyncio.get_running_loop().run_in_executor(None, self.state.read_nearest, step)
            ref = self._shared(step)  # another read may have asked for it meanwhile
            if ref is None:
                ref = self._replay(step, ckpt, state)
            else:
                self.stats["shared"] += 1
        elif ref is None:
            ref = self._read_prefix(step)
        else:
            self.stats["shared"] += 1
        if read_ahead and step in self.prefix:
            # A consumer walking through the prefix: read ahead as producers do in the live window.
            for ahead in range(step + 1, min(step + 1 + self.config.window, self.prefix.stop)):
                if ahead not in self._replies:
                    self._read_prefix(ahead)
        try:
            reply = await ref
        except RayError as exc:
            self.drop(step)
            raise ServiceError(f"step {step}: its replay failed: {str(exc).strip().splitlines()[-1]}") from None
        return reply[KEY_CONTAINER]

    def drop(self, step: int) -> bool:
        """Forget the shared reply of ``step`` (a client found its shards lost): the next read replays again."""
        return self._replies.pop(step, None) is not None

    def _shared(self, step: int) -> Any:
        held = self._replies.get(step)
        if held is None:
            return None
        ref, _, done, _ = held
        # Looked at without a ray.get: this runs on the coordinator's read event loop.
        if done.done() and done.exception() is not None:
            del self._replies[step]  # the replayer died or raised: ask again
            return None
        self._replies.move_to_end(step)
        return ref

    def _replay(self, step: int, ckpt: int, state: dict[str, Any] | None) -> Any:
        k = self.config.checkpoint_every
        # Prefer a replayer whose pipeline will sit just before this step; else the one used longest ago.
        best = None
        for i, position in enumerate(self._next):
            if position is not None and position <= step and step - position <= k:
                best = i
                break
        if best is None:
            best = min(range(len(self.replayers)), key=lambda i: (self._next[i] is not None, i))
            if all(p is not None for p in self._next):
                best = self.stats["submitted"] % len(self.replayers)
        position = self._next[best]
        replayed = step - (position if position is not None and ckpt <= position <= step else ckpt)
        ref = self._replayer(best).replay.remote(step, ckpt, state, k)
        self._next[best] = step + 1
        self.stats["max_replay_steps"] = max(self.stats["max_replay_steps"], replayed)
        self.stats["last"] = {"step": step, "replay_steps": replayed}
        self.metrics.replay(replayed)
        return self._keep(step, best, ref, REPLAY_SHARED_STEPS)

    def _read_prefix(self, step: int) -> Any:
        """A materialised step: one row-group read in any replayer (spread round-robin, no pipeline position)."""
        best = self.stats["submitted"] % len(self.replayers)
        self.stats["materialized_reads"] += 1
        ref = self._replayer(best).read.remote(step)
        return self._keep(step, best, ref, self.config.window + REPLAY_SHARED_STEPS)

    def _keep(self, step: int, i: int, ref: Any, keep: int) -> Any:
        """Keep the newest replies for ranks that ask for the same step next, and replayer ``i``'s calls in flight
        for :meth:`retire`."""
        done = ref.future()
        self._replies[step] = (ref, keep, done, self.replayers[i])
        while len(self._replies) > keep:
            self._replies.popitem(last=False)
        self._calls[i] = [f for f in self._calls[i] if not f.done()] + [done]
        self.stats["submitted"] += 1
        return ref

    def set_recipe(self, recipe: Recipe) -> None:
        """Run under ``recipe`` from now on (a phase was added): the replayers started under the old one are
        retired and the replies they own forgotten (the next read of a step replays it again)."""
        self.recipe = recipe
        self._recipe_ref = ray.put(recipe)
        self._replies.clear()
        self.retire()

    def retire(self) -> None:
        """Replace the started replayers by fresh processes, started on their next use (a replayer's memory grows
        with the run, docs/limits.md). Calls in flight finish at the old ones, and their replies stay shared until
        :meth:`reap` kills them."""
        now = time.monotonic()
        for i, actor in enumerate(self.replayers):
            if actor is not None:
                calls = [f for f in self._calls[i] if not f.done()]
                self._retired.append(_Retired(actor, calls, kill_by=now + self.config.request_timeout_s))
                self.stats["retired"] += 1
        self._version += 1  # a new replayer never takes the name of one still finishing its calls
        self._new_slots()

    def _new_slots(self) -> None:
        """Empty slots for ``config.replayers`` replayers."""
        n = self.config.replayers
        self.replayers, self.info_refs, self._infos = [None] * n, [None] * n, [None] * n
        self._next, self._calls = [None] * n, [[] for _ in range(n)]
        if self.prefix:  # prefix steps are read through the replayers from the first read on: start them now
            for i in range(n):
                self._replayer(i)

    def reap(self) -> None:
        """Kill the retired replayers whose calls are done since ``RETIRE_GRACE_S`` (or whose time is up), and
        forget the replies they own. On the read event loop: the pump schedules it every round (at most 2 s apart)
        while :attr:`retiring` is not 0."""
        now = time.monotonic()
        kept = []
        for old in self._retired:
            if old.idle_since is None and all(f.done() for f in old.calls):
                old.idle_since = now
            if now < old.kill_by and (old.idle_since is None or now - old.idle_since < RETIRE_GRACE_S):
                kept.append(old)
                continue
            for step in [s for s, held in self._replies.items() if held[3] is old.actor]:
                del self._replies[step]
            with best_effort(log, "already dead"):
                ray.kill(old.actor, no_restart=True)
        self._retired = kept

    @property
    def retiring(self) -> int:
        """Retired replayers not killed yet (read from any thread: a length)."""
        return len(self._retired)

    # ------------------------------------------------------------------ lifecycle
    async def check_started(self) -> str | None:
        """The first start-up error of a started replayer (None: none failed)."""
        for info in await asyncio.gather(*(ref for ref in self.info_refs if ref is not None)):
            if info.get("error"):
                return info["error"]
        return None

    def infos(self) -> list[dict[str, Any] | None]:
        """Start-up infos of the replayers (pid, node), without waiting for any and without a ray.get (it runs on
        the coordinator's event loop); None for one that has not started (or not answered yet)."""
        return list(self._infos)

    def close(self) -> None:
        for replayer in [*filter(None, self.replayers), *(old.actor for old in self._retired)]:
            with best_effort(log, "already dead"):
                ray.kill(replayer, no_restart=True)
