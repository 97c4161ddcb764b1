"""``DataService``: the client of the Ray data service. This is the API trainers, loaders and notebooks use.

    svc = DataService.start(recipe, name="run7", namespace="zr", producers=2, window=8,
                            state_dir="/shared/run7", checkpoint_every=8,
                            aggregate_store="torch://", run_id="run7")
    svc = DataService.connect("run7", namespace="zr", consumer="trainer")   # any driver, job, Train worker
    svc.prefetch(range(s + 1, s + 4), rank=r, world=W)   # optional: start fetching upcoming steps
    part = svc.slice(s, rank, world)             # RankSlice: rows [r*B/W, (r+1)*B/W) of global batch s (tracked)
    refs = svc.refs(s + 1, rank=r, world=W, track=False)  # read ahead: StepRefs (.slice/.batch) ...
    svc.touch(s + 1, rank=r, world=W)            # ... and move the cursor when the trainer takes the step
    svc.commit(s + 1)                            # after the trainer checkpoint that resumes at step s + 1
    svc.batch(s).digest                          # the whole GlobalBatch (ad hoc: moves no cursor unless track=True)

Reads go to this node's **node reader** (node.py), which leases the refs of up to ``lease_steps`` steps from the
coordinator in one call for every rank on the node; the rank then fetches only its lanes' bytes from the object
store (zero-copy, read-only arrays, on the producer's node). ``read_path="direct"`` makes one coordinator call per
read instead (the path before leases, kept for comparison).

Guarantee: ``batch(s)`` and ``slice(s, r, W)`` return exactly the rows of the reference global batch s (whole, or
the rank's contiguous row range) for any s, any W with B % W == 0, any number of producers, and across producer
crashes, rescales and service restarts from the same ``state_dir`` (tests/test_service.py, checked on rows).

Reads heal themselves: when the coordinator restarts (also with reads in flight), a node reader dies, or the
producer or node holding a step's shards dies, ``batch``/``slice`` retry (backoff, at most
``reconnect_timeout_s``), the lost step is made again, and the caller sees only a delay
(tests/test_service_heal.py, tests/test_service_cluster.py). Reads are idempotent.

Limits:
- Steps inside the live window are served from the object store. Steps behind it are replayed in a Replayer
  actor (restore of the nearest durable checkpoint + at most K steps for recent ones, ``anchor_every`` for old
  ones; sequential reads are cheap); steps more than ``window`` ahead of the slowest live consumer wait for it;
  reads more than ``max_ahead`` past the head are refused (ValueError).
- ``slice`` moves the cursor by default (the trainer path); ``batch``, ``refs`` and ``to_dataset`` do not unless
  ``track=True``. The default consumer name is unique per Ray job (``job-<id>``).
- Returned arrays are read-only views of shared memory; copy them before writing. A slice spanning several lanes
  is one concatenation (a copy); a slice inside one lane is a view.
- The cursor of a consumer is keyed by (consumer, rank, world); pass a stable ``consumer`` (e.g. the run id)
  from every rank of one job. A consumer silent for ``consumer_ttl_s`` stops holding the window back;
  ``release()`` does that at once. The coordinator sees cursor moves with the node reader's next lease, up to
  ``lease_steps`` steps late; ``commit`` and ``status`` carry this client's own moves, so they are exact for it.
- Errors are raised as clean Python exceptions (ValueError, TimeoutError, ServiceError, ...), never as Ray
  wrappers. This module imports no server class: ``connect`` and reads need only config, errors and protocol.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectFetchTimedOutError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RayTaskError,
)

from zephon_ray.batch import GlobalBatch, RankSlice, lane_span, slice_bounds
from zephon_ray.lanes import LaneShard
from zephon_ray.recipe import Recipe
from zephon_ray.service.config import DEFAULT_NAME, DEFAULT_NAMESPACE, READ_PATHS, ActorResources, ServiceConfig
from zephon_ray.service.errors import ReplyTimeoutError, ServiceError, ServiceNotFoundError, ShardsLostError
from zephon_ray.service.protocol import (
    KEY_KEEP_FROM, KEY_STEPS, REPLAYED, HeldStep, check_reader, expand, only_lanes)
from zephon_ray.source import assemble, pad_token_id

_LOST = (ObjectLostError, OwnerDiedError, ObjectFetchTimedOutError)


def default_consumer() -> str:
    """One consumer name per Ray job, so that two jobs never share (and wipe) each other's cursors and commits,
    while every rank of one job (Train workers run in their driver's job) shares one."""
    try:
        return f"job-{ray.get_runtime_context().get_job_id()}"
    except Exception:  # noqa: BLE001 - outside a Ray job
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _ensure_ray(ray_init: bool | dict[str, Any] | None = None) -> None:
    """Attach to the cluster this process belongs to (a job, a Train worker, ``RAY_ADDRESS``). Only an explicit
    ``ray_init`` starts one: ``True`` is a private local Ray for this process (a notebook on a laptop), a dict is
    passed to ``ray.init`` as is. Ignored when Ray is already initialised."""
    if ray.is_initialized():
        return
    if ray_init is True:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    elif isinstance(ray_init, dict):
        ray.init(**ray_init)
    else:
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
        except ConnectionError as exc:
            raise ServiceError(f"no Ray cluster to attach to ({exc}); start one (`ray start --head`), set "
                               "RAY_ADDRESS, or pass ray_init=True to start a private local Ray") from None


def _unwrap(exc: BaseException, service: str) -> BaseException:
    """A Ray error as the clean exception it wraps, or a typed ServiceError with a one-line reason."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, RayTaskError):
            return cause
        return ServiceError(f"service {service}: {str(exc).strip().splitlines()[-1]}")
    if isinstance(exc, _LOST):
        return ShardsLostError(f"service {service}: a reply was lost ({type(exc).__name__})")
    if isinstance(exc, (RayActorError, ActorUnavailableError)):
        return ServiceNotFoundError(
            f"service {service} is not running (its coordinator died or was stopped); start it again from its "
            "state_dir")
    if isinstance(exc, GetTimeoutError):
        return ReplyTimeoutError(f"service {service}: no reply in time")
    return exc


@dataclass(frozen=True)
class StepRefs:
    """One step's lane shards as Ray object refs, owned by the producer (or replayer) that made them.

    ``lanes[l]`` is a ref to lane l's shard, ``None`` for lanes outside the (rank, world) it was asked for (a rank is
    handed only the refs it needs). ``generation`` is the producer generation that made it (protocol.REPLAYED for a
    replay). Keep the object to keep the shards alive; ``slice`` and ``batch`` only fetch the lanes they need.
    """

    step: int
    lanes: list[Any]
    recipe: Recipe
    pad_token_id: int | None
    generation: int = 0

    @property
    def is_refs(self) -> bool:
        return any(isinstance(lane, ray.ObjectRef) for lane in self.lanes)

    def _fetch(self, lanes: range) -> list[LaneShard]:
        picked = [self.lanes[lane] for lane in lanes]
        if any(p is None for p in picked):
            raise ValueError(f"step {self.step}: these refs were asked for another rank's rows (lanes "
                             f"{[i for i, p in enumerate(self.lanes) if p is not None]}); read them with refs() again")
        if not self.is_refs:
            return picked
        try:
            return ray.get(picked)
        except (*_LOST, RayActorError, ActorUnavailableError) as exc:  # the node, owner, producer or replayer died
            raise ShardsLostError(f"step {self.step}: its shards were lost ({type(exc).__name__}); read it again "
                                  "to have it made again") from None
        except RayTaskError as exc:
            raise _unwrap(exc, "(replay)") from None

    def batch(self) -> GlobalBatch:
        shards = self._fetch(range(self.recipe.lanes))
        return assemble(self.recipe, self.step, dict(zip(range(self.recipe.lanes), shards)))

    def slice(self, rank: int, world: int) -> RankSlice:
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, rank, world)
        return RankSlice.from_lanes(self.step, rank, world, span, self._fetch(span.lanes), self.pad_token_id)


def _reader_key(rank: int | None, world: int | None) -> tuple[int, int]:
    return (0, 1) if world is None and rank is None else (rank, world)


REPLAYS_KEPT = 8
"""Replayed steps a client keeps (its ranks reading one past step share one reply)."""
FLUSH_EVERY_S = 0.05
"""A client sends its ranks' cursor moves to the node reader at most this often (sooner while a read waits)."""


@dataclass
class _Request:
    """One read call to the node reader in flight; threads of this process needing ``step`` wait for it."""

    step: int
    lo: int
    hi: int
    done: threading.Event
    error: BaseException | None = None
    waiting: set = field(default_factory=set)
    """(rank, world) of the tracked reads waiting for it: they are kept alive while it waits."""


class DataService:
    """A handle on a running data service. Cheap to create; picklable state is just (name, namespace, consumer).
    One handle may be shared by threads (each reading as its own rank).

    Create with :meth:`start` (launch a new service) or :meth:`connect` (find a running one by name).
    """

    def __init__(self, coordinator: Any, *, name: str, namespace: str, consumer: str | None = None,
                 read_path: str | None = None) -> None:
        self._coordinator = coordinator
        self.name = name
        self.namespace = namespace
        self.consumer = consumer or default_consumer()
        self._started_here = False  # set by start(): only then does leaving a `with` block stop the service
        self._where = f"{name!r} (namespace {namespace!r})"
        recipe, config = self._call(coordinator.recipe_and_config.remote(), timeout=120)
        self.recipe: Recipe = recipe
        self.config: ServiceConfig = config
        self.read_path = config.read_path if read_path is None else read_path
        if self.read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {list(READ_PATHS)}, got {self.read_path!r}")
        self._pad = pad_token_id(recipe)
        self._lock = threading.Lock()
        self._reader: Any = None
        self._prefetched: dict[tuple[int, int | None, int | None], Any] = {}  # direct path's read-ahead
        self._moves: dict[tuple[int, int], tuple[int, float]] = {}  # this client's own (rank, world) -> (step, when)
        # The node path: what this process's ranks share (one reader call per lease_steps steps, not per read).
        self._cache: dict[int, HeldStep] = {}
        self._replayed: list[int] = []
        self._requests: list[_Request] = []
        self._lo, self._hi = recipe.lanes, 0  # union of the lanes this process's ranks asked for
        self._keep_from = 0
        self._pending: dict[tuple[int, int], int] = {}  # cursor moves not yet sent to the node reader
        self._last_flush = 0.0
        self._flush_timer: threading.Timer | None = None

    def __reduce__(self):  # ship to Ray Train workers / tasks as a reconnect, not as actor state
        return (_reconnect, (self.name, self.namespace, self.consumer, self.read_path))

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        recipe: Recipe | str | os.PathLike,
        *,
        name: str = DEFAULT_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        producers: int = 1,
        window: int = 8,
        state_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 8,
        aggregate_store: str | None = None,
        aggregate_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        consumer: str | None = None,
        resources: ActorResources | dict | None = None,
        ray_init: bool | dict[str, Any] | None = None,
        **options: Any,
    ) -> "DataService":
        """Start a named, detached service and return a client for it.

        ``state_dir`` holds the durable state; start again with the same ``state_dir`` (and recipe) to resume
        where the newest commit left off. Without ``state_dir`` a fresh temporary directory is used (nothing to
        resume from). ``options`` are further :class:`ServiceConfig` fields (``consumer_ttl_s``,
        ``request_timeout_s``, ``start_step``, ``lease_steps``, ...); ``resources`` is an :class:`ActorResources`
        or a dict of its fields. Invalid settings, a ``state_dir`` of another recipe and an unusable
        ``materialized_dir`` raise before anything is created or written (service/launch.py). ``ray_init``
        (``True`` or ``ray.init`` kwargs) starts Ray when this process has none; by default the service attaches
        to a running cluster and never starts one.

        Use it as a context manager to stop the service it started when the block exits, also on an error
        (``tests/test_service_client.py``)::

            with DataService.start("tiny", name="peek", ray_init=True) as svc:
                svc.batch(3)
        """
        from zephon_ray.service import launch

        if not isinstance(recipe, Recipe):
            recipe = Recipe.from_toml(recipe)
        config = ServiceConfig.build(
            recipe, name=name, namespace=namespace, producers=producers, window=window,
            state_dir=None if state_dir is None else str(state_dir), checkpoint_every=checkpoint_every,
            aggregate_store=aggregate_store, aggregate_dir=None if aggregate_dir is None else str(aggregate_dir),
            run_id=run_id, resources=ActorResources() if resources is None else resources, **options,
        )
        config = launch.prepare(recipe, config)  # state_dir and materialized_dir checks: before Ray
        if config.state_dir is None:
            config = replace(config, state_dir=tempfile.mkdtemp(prefix=f"zephon-ray-{name}-"))
        _ensure_ray(ray_init)
        handle = launch.launch(recipe, config)
        client = cls(handle, name=name, namespace=namespace, consumer=consumer)
        client._started_here = True
        return client

    @classmethod
    def connect(cls, name: str = DEFAULT_NAME, *, namespace: str = DEFAULT_NAMESPACE, consumer: str | None = None,
                timeout_s: float = 0.0, read_path: str | None = None) -> "DataService":
        """Find a running service by name. Works from any driver, ``ray job submit`` job, notebook or Ray Train
        worker of the same cluster. A name that does not exist is a :class:`ServiceNotFoundError` at once; pass
        ``timeout_s`` to wait that long for a service that is still starting."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
                or timeout_s < 0:
            raise ValueError(f"connect: timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        _ensure_ray()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                handle = ray.get_actor(name, namespace=namespace)
                break
            except ValueError:
                if time.monotonic() >= deadline:
                    waited = f" after waiting {timeout_s:g}s" if timeout_s else ""
                    raise ServiceNotFoundError(f"no service named {name!r} in namespace {namespace!r}{waited}; "
                                               "start it, or pass timeout_s= to wait for one that is starting"
                                               ) from None
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return cls(handle, name=name, namespace=namespace, consumer=consumer, read_path=read_path)

    def stop(self) -> None:
        """Stop the service: producers, replayers, node readers and coordinator. ``state_dir`` stays."""
        from zephon_ray.service.launch import stop

        self._quiesce()  # no cursor move may be sent to a node reader being killed
        stop(self._coordinator, self.name, self.namespace)

    def _quiesce(self) -> None:
        with self._lock:
            timer, self._flush_timer = self._flush_timer, None
            self._pending.clear()
        if timer is not None:
            timer.cancel()

    def __enter__(self) -> "DataService":
        return self

    def __exit__(self, *exc: object) -> None:
        """A service this handle started is stopped; one it connected to is left running, minus our cursors."""
        if self._started_here:
            self.stop()
        else:
            try:
                self.release()
            except Exception:  # noqa: BLE001 - leaving a block must not mask the error that ended it
                pass

    def release(self) -> None:
        """Drop this consumer's cursors now, so that it no longer holds the window back."""
        self._quiesce()
        with self._lock:
            self._moves.clear()
            reader = self._reader
        if reader is not None:
            reader.release.remote(self.consumer)
        self._call(self._coordinator.release.remote(self.consumer))

    # ------------------------------------------------------------------ reading
    def refs(self, step: int, *, rank: int | None = None, world: int | None = None, track: bool = False,
             timeout_s: float | None = None) -> StepRefs:
        """Step ``step``'s lane shards as refs; blocks until produced or replayed. ``track=True`` moves this
        consumer's cursor (the trainer path); the default leaves it where it is (inspection, read-ahead). Fetching
        from the returned refs may raise :class:`ShardsLostError`; ``batch``/``slice`` retry that themselves."""
        step = _as_step(step)
        r, w = check_reader(rank, world, self.recipe.global_batch_rows)
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, r, w)
        if self.read_path == "node":
            if track:
                self._queue_move(r, w, step)  # travels with the request: the step may wait for this very move
            held = self._held(step, span.first, span.stop, track, timeout_s, (r, w))
            if track:
                self._own_move(step, rank, world)
            return StepRefs(step, only_lanes(held.lanes, span.first, span.stop), self.recipe, self._pad,
                            held.generation)
        pending = self._prefetched.pop((step, rank, world), None)
        if pending is not None:
            reply = self._call(pending)
            if track:  # the prefetch did not move the cursor; this read does, once delivered (commits count it)
                self.touch(step, rank=rank, world=world)
        else:
            moves = [(self.consumer, r, w, step, 0.0)] if track else None
            reply = self._call(self._coordinator.lease.remote(step, 1, (span.first, span.stop), timeout_s, moves,
                                                              track))
            if track:
                self._own_move(step, rank, world)
        got, generation, groups, containers = reply[KEY_STEPS][0]
        try:
            opened = self._call_refs([c for c in containers if c is not None])
        except ShardsLostError:
            self._invalidate(got, generation)
            raise
        values = dict(zip((g for g, c in enumerate(containers) if c is not None), opened))
        return StepRefs(got, expand(groups, values, self.recipe.lanes), self.recipe, self._pad, generation)

    # ------------------------------------------------------------------ the node path
    def _held(self, step: int, lo: int, hi: int, track: bool, timeout_s: float | None,
              reader: tuple[int, int]) -> HeldStep:
        """This process's refs of ``step`` covering lanes ``[lo, hi)``: from its cache, from a call in flight of
        another thread, or from one call to the node reader (which answers for up to ``lease_steps`` steps)."""
        while True:
            with self._lock:
                held = self._cache.get(step)
                if held is not None and held.has(lo, hi):
                    return held
                self._lo, self._hi = min(self._lo, lo), max(self._hi, hi)
                request = next((q for q in self._requests if q.step == step and q.lo <= lo and hi <= q.hi), None)
                owner = request is None
                if owner:
                    request = _Request(step, self._lo, self._hi, threading.Event())
                    self._requests.append(request)
                    moves = self._take_pending()
                if track:
                    request.waiting.add(reader)
            if not owner:
                request.done.wait()
                if request.error is not None:
                    raise request.error
                continue
            try:
                reader = self._node_reader()
                ref = reader.read.remote(step, self.consumer, (request.lo, request.hi), track, timeout_s, moves)
                reply = self._wait(ref, request)
                with self._lock:
                    self._file(reply)
            except BaseException as exc:
                request.error = exc
                with self._lock:
                    for (_, r, w, s) in moves:  # harmless if they arrived: cursor moves are monotonic
                        self._pending[(r, w)] = max(s, self._pending.get((r, w), s))
                raise
            finally:
                with self._lock:
                    self._requests.remove(request)
                request.done.set()

    def _wait(self, ref: Any, request: _Request) -> Any:
        """The reply of a read call; while it waits, this process's new cursor moves go to the node reader (the
        step it waits for may be held back by exactly those moves), and the tracked reads waiting for it are heard
        again every ``consumer_ttl_s / 4``: a rank waiting for its step is alive, its cursor must not expire."""
        keepalive = max(0.25, min(self.config.consumer_ttl_s / 4, 10.0))
        next_keepalive = time.monotonic() + keepalive
        while True:
            ready, _ = ray.wait([ref], timeout=0.25, fetch_local=False)
            if ready:
                return self._call(ref)
            if time.monotonic() >= next_keepalive:
                next_keepalive = time.monotonic() + keepalive
                with self._lock:
                    for key in request.waiting:
                        self._pending[key] = max(request.step, self._pending.get(key, request.step))
            self._flush_moves(force=True)

    def _file(self, reply: dict[str, Any]) -> None:
        """File a reply into this process's cache and evict what the coordinator no longer holds (lock held)."""
        self._keep_from = max(self._keep_from, int(reply[KEY_KEEP_FROM]))
        filed = set()
        for step, generation, lanes in reply[KEY_STEPS]:
            filed.add(step)
            held = self._cache.get(step)
            if held is not None and held.generation == generation:
                held.lanes = [new if new is not None else old for old, new in zip(held.lanes, lanes)]
            else:
                self._cache[step] = HeldStep(generation, list(lanes))
            if generation == REPLAYED:
                if step in self._replayed:
                    self._replayed.remove(step)
                self._replayed.append(step)
        while len(self._replayed) > REPLAYS_KEPT:
            self._cache.pop(self._replayed.pop(0), None)
        keep = filed | set(self._replayed)
        for step in [s for s in self._cache if s < self._keep_from and s not in keep]:
            del self._cache[step]
        cap = 2 * (self.config.window + self.config.lease_steps) + REPLAYS_KEPT
        older = sorted(s for s in self._cache if s not in filed)
        for step in older[:max(0, len(self._cache) - cap)]:
            del self._cache[step]

    def _queue_move(self, rank: int, world: int, step: int) -> None:
        with self._lock:
            self._pending[(rank, world)] = max(step, self._pending.get((rank, world), step))
        self._flush_moves()

    def _take_pending(self) -> list[tuple[str, int, int, int]]:
        moves = [(self.consumer, r, w, s) for (r, w), s in self._pending.items()]
        self._pending.clear()
        return moves

    def _flush_moves(self, force: bool = False) -> None:
        """Send pending cursor moves to the node reader, at most once per ``FLUSH_EVERY_S`` (or now, ``force``).
        Moves held back by that limit go with this process's next read call, or with a timer armed for the end of
        the interval, whichever comes first: a move is never left behind, and ranks of a process that move
        together cost a call or two per step, not one each."""
        now = time.monotonic()
        with self._lock:
            if not self._pending:
                return
            wait = FLUSH_EVERY_S - (now - self._last_flush)
            if not force and wait > 0:
                if self._flush_timer is None:
                    self._flush_timer = threading.Timer(wait, self._flush_moves, kwargs={"force": True})
                    self._flush_timer.daemon = True
                    self._flush_timer.start()
                return
            self._last_flush = now
            self._flush_timer = None
            moves = self._take_pending()
        try:
            self._node_reader().advance.remote(moves)
        except Exception:  # noqa: BLE001 - the service is restarting: the moves go with the next read call
            with self._lock:
                for _, r, w, s in moves:
                    self._pending[(r, w)] = max(s, self._pending.get((r, w), s))

    def _node_reader(self) -> Any:
        with self._lock:
            reader = self._reader
        if reader is None:
            node = ray.get_runtime_context().get_node_id()
            reader = self._call(self._coordinator.node_reader.remote(node), timeout=120)
            with self._lock:
                self._reader = self._reader or reader
                reader = self._reader
        return reader

    def prefetch(self, steps: Iterable[int], *, rank: int | None = None, world: int | None = None) -> None:
        """Ask for upcoming steps without waiting and without moving the cursor; a later ``slice``/``batch``/
        ``refs`` of one of them (same rank and world) uses the answer. On the node path this is not needed: one
        call brings the refs of up to ``lease_steps`` steps. Keep the depth below ``window``: a step beyond the
        live window is replayed on the side instead."""
        steps = [_as_step(step) for step in steps]
        if self.read_path == "node":
            return
        r, w = check_reader(rank, world, self.recipe.global_batch_rows)
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, r, w)
        for step in steps:
            key = (step, rank, world)
            if key not in self._prefetched:
                self._prefetched[key] = self._coordinator.lease.remote(step, 1, (span.first, span.stop), None,
                                                                       None, False)
        while len(self._prefetched) > 4 * self.config.window:  # forget the oldest unused prefetches
            self._prefetched.pop(next(iter(self._prefetched)))

    def touch(self, step: int, *, rank: int | None = None, world: int | None = None) -> None:
        """Move this consumer's cursor (for ``rank`` of ``world``) to ``step`` without reading: for loaders
        that read ahead with ``track=False`` and report what the trainer actually consumed. Fire and forget."""
        step = _as_step(step)
        r, w = check_reader(rank, world, self.recipe.global_batch_rows)
        self._own_move(step, rank, world)
        if self.read_path == "node":
            self._queue_move(r, w, step)
        else:
            self._coordinator.advance.remote([(self.consumer, r, w, step, 0.0)])

    def _own_move(self, step: int, rank: int | None, world: int | None) -> None:
        key = _reader_key(rank, world)
        with self._lock:
            if any(w != key[1] for _, w in self._moves):
                self._moves.clear()  # one world per consumer, as on the coordinator: the newest world wins
            old = self._moves.pop(key, None)
            self._moves[key] = (max(step, old[0]) if old else step, time.monotonic())

    def _own_moves(self) -> list[tuple[str, int, int, int, float]]:
        """This client's cursor moves, sent with commit() and status() so that both are exact for it."""
        now = time.monotonic()
        with self._lock:
            return [(self.consumer, r, w, step, round(now - when, 3)) for (r, w), (step, when) in self._moves.items()]

    def batch(self, step: int, *, track: bool = False) -> GlobalBatch:
        """Global batch ``step`` (all B rows, lane-major); ``.digest`` equals GlobalBatchSource's. Ad hoc by
        default: moves no cursor unless ``track=True``."""
        return self._read(step, None, None, track, lambda refs: refs.batch())

    def slice(self, step: int, rank: int, world: int, *, track: bool = True) -> RankSlice:
        """Rank ``rank`` of ``world``'s rows of step ``step``; only the lanes covering them are fetched. Moves
        this consumer's cursor for (rank, world) unless ``track=False``."""
        slice_bounds(self.recipe.global_batch_rows, rank, world)  # validate before any remote call
        return self._read(step, rank, world, track, lambda refs: refs.slice(rank, world))

    def _read(self, step: int, rank: int | None, world: int | None, track: bool, fetch: Any) -> Any:
        """One read with transparent retries: a restarting coordinator (calls re-sent by Ray, or a fresh handle),
        a lost node reader and lost shards (the step is made again) cost a delay of at most
        ``reconnect_timeout_s``."""
        deadline = time.monotonic() + self.config.reconnect_timeout_s
        delay = 0.1
        while True:
            refs = None
            try:
                refs = self.refs(step, rank=rank, world=world, track=track)
                return fetch(refs)
            except ShardsLostError as exc:
                reason = str(exc)
                self._prefetched.clear()
                if refs is not None:
                    self._invalidate(refs.step, refs.generation)
            except ServiceNotFoundError as exc:
                reason = str(exc)
                self._reconnect_or_raise(exc)
            except ReplyTimeoutError as exc:
                reason = str(exc)
            if time.monotonic() + delay > deadline:
                raise ServiceError(f"service {self._where}: step {step} still unreadable after "
                                   f"reconnect_timeout_s={self.config.reconnect_timeout_s:.0f}s: {reason}")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _invalidate(self, step: int, generation: int) -> None:
        with self._lock:
            held = self._cache.get(step)
            if held is not None and held.generation == generation:
                del self._cache[step]
        try:
            reader = self._reader if self.read_path == "node" else None
            target = reader if reader is not None else self._coordinator
            ray.get(target.invalidate.remote(step, generation), timeout=30)
        except Exception:  # noqa: BLE001 - the coordinator itself may be restarting: the retry finds out
            pass

    def _reconnect_or_raise(self, exc: ServiceNotFoundError) -> None:
        """After a dead coordinator or node reader: a fresh coordinator handle (Ray restarts it under the same
        name) and, on first use, a fresh node reader. A service stopped for good re-raises ``exc``."""
        self._prefetched.clear()
        try:
            coordinator = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            raise exc from None  # stopped for good: nothing to reconnect to
        with self._lock:
            self._coordinator = coordinator
            self._reader = None
            self._cache.clear()
            self._replayed.clear()
            self._keep_from = 0  # a new incarnation may start below the old one's window

    # ------------------------------------------------------------------ state and control
    def commit(self, step: int) -> dict[str, Any]:
        """Record durably (atomically, under ``state_dir``) that this consumer's trainer checkpoint resumes at
        ``step``. A service restarted from the same ``state_dir`` starts its live window there. This client's
        cursor moves travel with it, so a commit right after a read is never refused as "ahead"."""
        step = _as_step(step, "commit step")
        return self._call(self._coordinator.commit.remote(step, self.consumer, self._own_moves()))

    def status(self) -> dict[str, Any]:
        """Producers (pids, lanes, generation), window (held steps and bytes vs. bound), cursors (this client's
        exact, others' as their node readers last reported them), reads (leases, node readers), throughput,
        durable checkpoints and commits, start-up replay and side-replay counters (status.py)."""
        return self._call(self._coordinator.status.remote(self._own_moves()), timeout=60)

    def rescale(self, producers: int) -> dict[str, Any]:
        """Go to ``producers`` producer actors (must divide the lanes) without changing any batch."""
        self.config.check_lanes(self.recipe, producers)
        result = self._call(self._coordinator.rescale.remote(producers))
        self.config = replace(self.config, producers=producers)
        return result

    def to_dataset(self, steps: Iterable[int]) -> "ray.data.Dataset":
        """A lazy ``ray.data.Dataset`` with one row per batch row: ``step``, ``lane``, ``row`` (index in the
        global batch), ``tokens`` and ``positions`` (fixed-size int32 lists), ``digest`` (of the step). For
        notebooks and ``write_parquet`` audits; it does not move this consumer's cursor. Nothing is read until the
        dataset is consumed: Ray Data tasks fetch one step each from the service (``track=False``), so memory
        stays bounded by Ray Data's streaming, not by the number of steps. For a materialised run read the Parquet
        directly: ``MaterializedSource(DIR).to_dataset()``. Test: tests/test_materialized.py."""
        steps = [_as_step(step, "to_dataset step") for step in steps]
        if not steps:
            raise ValueError("to_dataset: no steps given")
        return ray.data.from_items([{"step": step} for step in steps]).map_batches(
            _service_step_rows, fn_kwargs={"service": self}, batch_size=1, num_cpus=0.25, batch_format="numpy")

    # ------------------------------------------------------------------ helpers
    def _call_refs(self, refs: list[Any]) -> list[Any]:
        """Open containers (the direct path): a lost one (its producer died) is a ShardsLostError."""
        try:
            return ray.get(refs)
        except (*_LOST, RayActorError, ActorUnavailableError) as exc:
            raise ShardsLostError(f"service {self._where}: a step's shards were lost ({type(exc).__name__})") from None

    def _call(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except (RayTaskError, RayActorError, ActorUnavailableError, GetTimeoutError, *_LOST) as exc:
            raise _unwrap(exc, self._where) from None


def _service_step_rows(batch: dict[str, np.ndarray], service: "DataService") -> "pa.Table":
    """Ray Data task body of ``to_dataset``: the rows of the steps in ``batch`` (read without moving a cursor)."""
    import pyarrow as pa

    from zephon_ray.formats.materialized import batch_table

    return pa.concat_tables([batch_table(service.batch(int(step))) for step in batch["step"]])


def _as_step(step: Any, what: str = "step") -> int:
    """Steps are plain non-negative ints on the wire (numpy integers are accepted and converted)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {step!r}")
    return int(step)


def _reconnect(name: str, namespace: str, consumer: str, read_path: str | None = None) -> DataService:
    return DataService.connect(name, namespace=namespace, consumer=consumer, read_path=read_path)
