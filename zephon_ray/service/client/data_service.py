"""``DataService``: the client of the Ray data service. This is the API trainers, loaders and notebooks use.

    svc = DataService.start(recipe, name="run7", namespace="zr", producers=2, window=8,
                            state_dir="/shared/run7", checkpoint_every=8)   # run_id "run7", hosted TCPStore
    svc = DataService.connect("run7", namespace="zr", consumer="trainer")   # any driver, job, Train worker
    svc.prefetch(range(s + 1, s + 4), rank=r, world=W)   # optional: start fetching upcoming steps
    part = svc.slice(s, rank, world, track=True)  # RankSlice: rows [r*B/W, (r+1)*B/W) of step s; moves the cursor
    refs = svc.refs(s + 1, rank=r, world=W, track=False)  # read ahead: StepRefs (.slice/.batch) ...
    svc.advance(s + 1, rank=r, world=W)          # ... and move the cursor when the trainer takes the step
    svc.commit(s + 1)                            # after the trainer checkpoint that resumes at step s + 1
    svc.batch(s).digest                          # the whole GlobalBatch (moves no cursor: track defaults to False)

The handle holds lifecycle and control calls; reads go through one read-path object. On the default node path
(node_read_path.py) the ranks of a process share a lease cache and call this node's **node reader**
(server/node_reader.py) about once per run of steps it hands them; the node reader leases the refs of up to
``lease_steps`` steps from the coordinator in one call for every rank on the node; the rank then fetches only its
lanes' bytes from the object store (zero-copy, read-only arrays, on the producer's node). ``read_path="direct"``
(direct_read_path.py) makes one coordinator call per read instead and leases only the step it reads, so a phase
added while running can start right after what the consumer read. ``connect`` starts this node's reader, so the
first read waits for no actor start.

Guarantee: ``batch(s)`` and ``slice(s, r, W)`` return exactly the rows of the reference global batch s (whole, or
the rank's contiguous row range) for any s, any W up to B, any number of producers, and across producer
crashes, rescales and service restarts from the same ``state_dir``.

Reads heal themselves: when the coordinator restarts (also with reads in flight), a node reader dies, or the
producer or node holding a step's shards dies, ``batch``/``slice`` retry (backoff, at most
``reconnect_timeout_s``), the lost step is made again, and the caller sees only a delay. Reads are idempotent.
No call waits without a deadline: a read returns or raises within ``read_timeout_s`` (or its ``timeout_s``), its
retries included, with one line naming the step, what it waited for and how long; a refused read (past
``max_ahead``, a bad rank) moves no cursor.

Limits:
- Steps inside the live window are served from the object store. Steps behind it are replayed in a Replayer
  actor (restore of the nearest durable checkpoint + at most K steps for recent ones, ``anchor_every`` for old
  ones; sequential reads are cheap); steps more than ``window`` ahead of the slowest live consumer wait for it;
  reads more than ``max_ahead`` past the head are refused (ValueError).
- No read moves a cursor unless it says ``track=True`` (``slice``, ``batch``, ``refs``; ``to_dataset`` never):
  a trainer reading directly passes it (the loaders do), so a notebook or an audit cannot hold a trainer's window
  back. The default consumer name is unique per Ray job (``job-<id>``).
- Returned arrays are read-only views of shared memory; copy them before writing. A slice spanning several lanes
  is one concatenation (a copy); a slice inside one lane is a view.
- The cursor of a consumer is keyed by (consumer, rank, world); pass a stable ``consumer`` (e.g. the run id)
  from every rank of one job. A consumer silent for ``consumer_ttl_s`` stops holding the window back;
  ``release()`` does that at once. A rank's moves reach its node reader with its process's next read call (or
  alone after ``consumer_ttl_s / 8``, at most 15 s) and the coordinator with the node reader's next lease, so
  the coordinator's cursors lag by up to a run of steps plus a lease (node_read_path.py); ``commit`` and ``status``
  carry this client's own moves, so they are exact for it.
- Errors are raised as clean Python exceptions (ValueError, TimeoutError, ServiceError, ...), never as Ray
  wrappers. ``connect`` and reads import nothing of server/ (only client/ and the shared config, errors, wire,
  actor_shells and lease_cache); ``start`` and ``stop`` load server/launch.py when called.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import ray

from zephon_ray.batch import GlobalBatch, RankSlice, lane_span, slice_bounds
from zephon_ray.checks import check_reader
from zephon_ray.errors import best_effort
from zephon_ray.recipe import Recipe
from zephon_ray.service.client.direct_read_path import DirectReads
from zephon_ray.service.client.node_read_path import NodeReads
from zephon_ray.service.client.step_refs import StepRefs, as_step, call
from zephon_ray.service.config import DEFAULT_NAME, DEFAULT_NAMESPACE, READ_PATHS, ServiceConfig
from zephon_ray.service.errors import (
    ReadTimeoutError,
    ReplyTimeoutError,
    ServiceError,
    ServiceNotFoundError,
    ShardsLostError,
)
from zephon_ray.service.wire import CursorMove, check_batch_reader
from zephon_ray.source import pad_token_id

if TYPE_CHECKING:
    from zephon_ray.provenance import ProvenanceSource, StepProvenance

log = logging.getLogger("zephon_ray")

__all__ = ["DataService", "StepRefs", "default_consumer"]

REPLY_GRACE_S = 5.0
"""A read's own waits end this long after the deadline it gave the coordinator, whose answer (naming the window)
comes first; the client's answer is for a coordinator or node reader that cannot answer at all."""
CONTROL_TIMEOUT_S = 60.0
"""The bound of ``status`` and ``release`` (they wait for nothing but the coordinator's reply)."""
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ServiceConfig))
"""The keyword overrides ``start`` accepts besides ``consumer`` and ``ray_init``."""

_T = TypeVar("_T")


def _check_timeout(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: timeout_s must be a number of seconds > 0, got {value!r}")
    return float(value)


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
        from zephon_ray.service.client.session import attach

        try:
            attach(None, log_to_driver=False)
        except ConnectionError as exc:
            raise ServiceError(
                f"no Ray cluster to attach to ({exc}); start one (`ray start --head`), set "
                "RAY_ADDRESS, or pass ray_init=True to start a private local Ray"
            ) from None


class DataService:
    """A handle on a running data service: lifecycle and control calls here, reads through one read-path object
    (node_read_path.py, or direct_read_path.py with ``read_path="direct"``). Cheap to create; it pickles as (name,
    namespace, consumer, read path) and reconnects where it lands.

    Thread-safe: one handle may be shared by threads, each reading as its own rank (or as the same one). Its own
    state (the coordinator handle, this client's cursor moves) is guarded by a lock, and so is each read path's;
    no lock is held across a remote call (tests/test_node_reads.py and tests/test_direct_reads.py read with many
    threads on one handle and check every row).

    Create with :meth:`start` (launch a new service) or :meth:`connect` (find a running one by name); the
    constructor is not public.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "DataService is not constructed directly: DataService.start(recipe, ...) launches a service, "
            "DataService.connect(name, ...) finds a running one"
        )

    @classmethod
    def _from_coordinator(
        cls,
        coordinator: Any,
        *,
        name: str,
        namespace: str,
        consumer: str | None = None,
        read_path: str | None = None,
        warm: bool = True,
    ) -> DataService:
        """A handle on the service whose coordinator actor is ``coordinator`` (what start and connect return)."""
        self = cls.__new__(cls)
        self._setup(coordinator, name=name, namespace=namespace, consumer=consumer, read_path=read_path, warm=warm)
        return self

    def _setup(
        self, coordinator: Any, *, name: str, namespace: str, consumer: str | None, read_path: str | None, warm: bool
    ) -> None:
        self._coordinator = coordinator
        self.name = name
        self.namespace = namespace
        self.consumer = consumer or default_consumer()
        self._started_here = False  # set by start(): only then does leaving a `with` block stop the service
        self._where = f"{name!r} (namespace {namespace!r})"
        recipe, config = call(coordinator.recipe_and_config.remote(), self._where, timeout=120, what="the recipe")
        self.recipe: Recipe = recipe
        self.config: ServiceConfig = config
        self.read_path = config.read_path if read_path is None else read_path
        if self.read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {list(READ_PATHS)}, got {self.read_path!r}")
        self._pad = pad_token_id(recipe)
        self._lock = threading.Lock()
        self._moves: dict[tuple[int, int], tuple[int, float]] = {}  # this client's own (rank, world) -> (step, when)
        self._reads: NodeReads | DirectReads = NodeReads(self) if self.read_path == "node" else DirectReads(self)
        self._provenance: ProvenanceSource | None = None  # built at the first provenance() call
        self._provenance_lock = threading.Lock()
        if warm:
            try:
                self._reads.warm()  # the node reader is up before the first read (none for the direct path)
            except ServiceError:  # restarting: the first read retries and starts it
                pass

    def _require_ray(self) -> None:
        """A handle used after ``ray.shutdown()`` fails here in one line: any Ray call would start a new local Ray
        for this process, with no service in it."""
        if not ray.is_initialized():
            raise ServiceError(
                f"service {self._where}: Ray is not initialised in this process (ray.shutdown() was called?); "
                "after ray.init(), DataService.connect() again"
            )

    @property
    def _coordinator(self) -> Any:
        self._require_ray()
        return self._actor

    @_coordinator.setter
    def _coordinator(self, actor: Any) -> None:
        self._actor = actor

    def __reduce__(self) -> tuple[Callable[[str, str, str, str | None], DataService], tuple[str, str, str, str]]:
        """Ship to Ray Train workers / tasks as a reconnect, not as actor state."""
        return (_reconnect, (self.name, self.namespace, self.consumer, self.read_path))

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        recipe: Recipe | str | os.PathLike[str],
        config: ServiceConfig | None = None,
        *,
        consumer: str | None = None,
        ray_init: bool | dict[str, Any] | None = None,
        **overrides: Any,
    ) -> DataService:
        """Start a named, detached service and return a client for it.

        ``config`` is a :class:`ServiceConfig` (``ServiceConfig.build(recipe, ...)``); ``overrides`` are its fields
        by keyword (``name``, ``namespace``, ``producers``, ``window``, ``state_dir``, ``checkpoint_every``,
        ``run_id``, ``read_timeout_s``, ... and ``resources``, an :class:`ActorResources` or a dict of its fields),
        applied on top of it or, without one, of ``ServiceConfig.build``'s defaults (``run_id`` the service's name,
        the aggregation the TCPStore it hosts); an unknown keyword is a TypeError naming it. ``state_dir`` holds
        the durable state; start again with the same ``state_dir`` (and recipe) to resume where the newest commit
        left off. Without it a fresh temporary directory is used (nothing to resume from). Invalid settings, a
        ``state_dir`` of another recipe and an unusable ``materialized_dir`` raise before anything is created or
        written (service/server/launch.py).
        ``consumer`` names this client's consumer. ``ray_init`` (``True`` or ``ray.init`` kwargs) starts Ray when
        this process has none; by default the service attaches to a running cluster and never starts one.

        Use it as a context manager to stop the service it started when the block exits, also on an error
        (``tests/test_service_client.py``)::

            with DataService.start("tiny", name="peek", ray_init=True) as svc:
                svc.batch(3)
        """
        from zephon_ray.service.server import launch

        unknown = sorted(set(overrides) - CONFIG_FIELDS)
        if unknown:
            near = difflib.get_close_matches(unknown[0], CONFIG_FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(
                f"DataService.start: unknown option {unknown[0]!r}{hint}; options are consumer, ray_init "
                f"and the fields of ServiceConfig: {', '.join(sorted(CONFIG_FIELDS))}"
            )
        if not isinstance(recipe, Recipe):
            recipe = Recipe.from_toml(recipe)
        for key in ("state_dir", "aggregate_dir", "materialized_dir"):  # paths as strings: they travel to actors
            if overrides.get(key) is not None:
                overrides[key] = str(overrides[key])
        if config is None:
            config = ServiceConfig.build(recipe, **overrides)
        elif not isinstance(config, ServiceConfig):
            raise TypeError(f"DataService.start: config must be a ServiceConfig, got {type(config).__name__}")
        elif overrides:
            config = replace(config, **overrides).for_recipe(recipe)
        config = launch.prepare(recipe, config)  # state_dir and materialized_dir checks: before Ray
        if config.state_dir is None:
            config = replace(config, state_dir=tempfile.mkdtemp(prefix=f"zephon-ray-{config.name}-"))
        _ensure_ray(ray_init)
        handle = launch.launch(recipe, config)
        client = cls._from_coordinator(handle, name=config.name, namespace=config.namespace, consumer=consumer)
        client._started_here = True
        return client

    @classmethod
    def connect(
        cls,
        name: str = DEFAULT_NAME,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        consumer: str | None = None,
        timeout_s: float = 0.0,
        read_path: str | None = None,
    ) -> DataService:
        """Find a running service by name. Works from any driver, ``ray job submit`` job, notebook or Ray Train
        worker of the same cluster. A name that does not exist is a :class:`ServiceNotFoundError` at once; pass
        ``timeout_s`` to wait that long for a service that is still starting."""
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
            or timeout_s < 0
        ):
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
                    raise ServiceNotFoundError(
                        f"no service named {name!r} in namespace {namespace!r}{waited}; "
                        "start it, or wait for one that is starting (connect(timeout_s=...); `zephon-ray status --wait SECONDS`)"
                    ) from None
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return cls._from_coordinator(handle, name=name, namespace=namespace, consumer=consumer, read_path=read_path)

    def stop(self) -> None:
        """Stop the service: producers, replayers, node readers and coordinator. ``state_dir`` stays."""
        from zephon_ray.service.server.launch import stop

        self._reads.quiesce(stopping=True)  # nothing of ours may still call a node reader being killed
        self._close_provenance()
        stop(self._coordinator, self.name, self.namespace)

    def _close_provenance(self) -> None:
        with self._provenance_lock:
            if self._provenance is not None:
                self._provenance.close()
                self._provenance = None

    def __enter__(self) -> DataService:
        return self

    def __exit__(self, *exc: object) -> None:
        """A service this handle started is stopped; one it connected to is left running, minus our cursors."""
        if self._started_here:
            self.stop()
        else:
            with best_effort(log, "leaving a block must not mask the error that ended it"):
                self.release()

    def release(self) -> None:
        """Drop this consumer's cursors now, so that it no longer holds the window back."""
        self._require_ray()
        self._reads.quiesce()
        self._close_provenance()
        with self._lock:
            self._moves.clear()
        self._reads.release(self.consumer)
        self._call(self._coordinator.release.remote(self.consumer), CONTROL_TIMEOUT_S, f"release of {self.consumer!r}")

    # ------------------------------------------------------------------ reading
    def refs(
        self,
        step: int,
        *,
        rank: int | None = None,
        world: int | None = None,
        track: bool = False,
        timeout_s: float | None = None,
    ) -> StepRefs:
        """Step ``step``'s lane shards as refs; blocks until produced or replayed, at most ``timeout_s`` (default
        ``request_timeout_s``; then a TimeoutError naming the step and the window). ``track=True`` moves this
        consumer's cursor (the trainer path); the default leaves it where it is (inspection, read-ahead). Fetching
        from the returned refs may raise :class:`ShardsLostError`; ``batch``/``slice`` retry that themselves."""
        limit = self.config.request_timeout_s if timeout_s is None else _check_timeout("refs", timeout_s)
        return self._refs(step, rank, world, track, time.monotonic() + limit)

    def _refs(self, step: int, rank: int | None, world: int | None, track: bool, deadline: float) -> StepRefs:
        """``refs`` by a deadline (``time.monotonic()``): the coordinator waits for the step until then at most,
        and every wait on this side ends a little later (its answer, which names the window, comes first)."""
        step = as_step(step)
        r, w = check_batch_reader(rank, world, self.recipe.global_batch_rows)
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, r, w)
        self._require_ray()  # the read path's calls go to node readers, not through the coordinator handle
        wait_s = max(0.0, min(self.config.request_timeout_s, deadline - time.monotonic()))
        got = self._reads.refs(step, r, w, span.first, span.stop, track, wait_s, deadline + REPLY_GRACE_S)
        if track:
            self._own_move(step, r, w)
        return got

    def prefetch(self, steps: Iterable[int], *, rank: int | None = None, world: int | None = None) -> None:
        """Ask for upcoming steps without waiting and without moving the cursor; a later ``slice``/``batch``/
        ``refs`` of one of them (same rank and world) uses the answer. On the node path this is not needed: one
        call brings the refs of up to ``lease_steps`` steps. Keep the depth below ``window``: a step beyond the
        live window is replayed on the side (or taken from the window if producers reach it first), which costs a
        replayer."""
        steps = [as_step(step) for step in steps]
        r, w = check_batch_reader(rank, world, self.recipe.global_batch_rows)
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, r, w)
        self._reads.prefetch(steps, r, w, span.first, span.stop)

    def advance(self, step: int, *, rank: int | None = None, world: int | None = None) -> None:
        """Move this consumer's cursor (for ``rank`` of ``world``) to ``step`` without reading: for loaders
        that read ahead with ``track=False`` and report what the trainer actually consumed. Fire and forget."""
        step = as_step(step)
        r, w = check_batch_reader(rank, world, self.recipe.global_batch_rows)
        self._require_ray()
        self._own_move(step, r, w)
        self._reads.advance(r, w, step)

    def _own_move(self, step: int, rank: int, world: int) -> None:
        """Record this client's move of (``rank``, ``world``), as ``check_batch_reader`` returned them."""
        key = (rank, world)
        with self._lock:
            if any(w != key[1] for _, w in self._moves):
                self._moves.clear()  # one world per consumer, as on the coordinator: the newest world wins
            old = self._moves.pop(key, None)
            self._moves[key] = (max(step, old[0]) if old else step, time.monotonic())

    def _own_moves(self) -> list[CursorMove]:
        """This client's cursor moves, sent with commit() and status() so that both are exact for it."""
        now = time.monotonic()
        with self._lock:
            return [
                CursorMove(self.consumer, r, w, step, round(now - when, 3))
                for (r, w), (step, when) in self._moves.items()
            ]

    def batch(self, step: int, *, track: bool = False, timeout_s: float | None = None) -> GlobalBatch:
        """Global batch ``step`` (all B rows, lane-major); ``.digest`` equals GlobalBatchSource's. Ad hoc by
        default: moves no cursor unless ``track=True``. Returns or raises within ``timeout_s`` (default
        ``read_timeout_s``), retries included."""
        return self._read(step, None, None, track, timeout_s, lambda refs, t: refs.batch(timeout_s=t))

    def slice(
        self, step: int, rank: int, world: int, *, track: bool = False, timeout_s: float | None = None
    ) -> RankSlice:
        """Rank ``rank`` of ``world``'s rows of step ``step``; only the lanes covering them are fetched.
        ``track=True`` moves this consumer's cursor for (rank, world) (the trainer path). Returns or raises within
        ``timeout_s`` (default ``read_timeout_s``), retries included."""
        slice_bounds(self.recipe.global_batch_rows, rank, world)  # validate before any remote call
        return self._read(step, rank, world, track, timeout_s, lambda refs, t: refs.slice(rank, world, timeout_s=t))

    def _read(
        self,
        step: int,
        rank: int | None,
        world: int | None,
        track: bool,
        timeout_s: float | None,
        fetch: Callable[[StepRefs, float], _T],
    ) -> _T:
        """One read with transparent retries: a restarting coordinator (calls re-sent by Ray, or a fresh handle),
        a lost node reader and lost shards (the step is made again) cost a delay of at most
        ``reconnect_timeout_s``. Every wait inside ends by the read's deadline (``read_timeout_s``, or
        ``timeout_s``): past it, a :class:`ReadTimeoutError` names the step, what it waited for and how long."""
        limit = self.config.read_timeout_s if timeout_s is None else _check_timeout("read", timeout_s)
        t0 = time.monotonic()
        deadline = t0 + limit
        retry_until = min(deadline, t0 + self.config.reconnect_timeout_s)
        delay = 0.1
        while True:
            refs = None
            try:
                refs = self._refs(step, rank, world, track, deadline)
                return fetch(refs, max(1.0, deadline - time.monotonic()))
            except ShardsLostError as exc:
                reason = str(exc)
                self._reads.forget_prefetched()
                if refs is not None:
                    self._invalidate(refs.step, refs.generation)
            except ServiceNotFoundError as exc:
                reason = str(exc)
                self._reconnect_or_raise(exc)
            except ReplyTimeoutError as exc:
                reason = str(exc)
            now = time.monotonic()
            if now + delay > retry_until:
                budget = "read_timeout_s" if retry_until == deadline else "reconnect_timeout_s"
                raise ReadTimeoutError(
                    f"service {self._where}: step {step} not read within "
                    f"{budget}={retry_until - t0:.0f}s (waited {now - t0:.0f}s): {reason}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _invalidate(self, step: int, generation: int) -> None:
        with best_effort(log, "the coordinator itself may be restarting: the retry finds out"):
            self._reads.invalidate(step, generation)

    def _reconnect_or_raise(self, exc: ServiceNotFoundError) -> None:
        """After a dead coordinator or node reader: a fresh coordinator handle (Ray restarts it under the same
        name) and, on first use, a fresh node reader. A service stopped for good re-raises ``exc``."""
        self._reads.forget_prefetched()
        try:
            coordinator = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            raise exc from None  # stopped for good: nothing to reconnect to
        with self._lock:
            self._coordinator = coordinator
        self._reads.reset()

    def provenance(
        self,
        step: int,
        rank: int | None = None,
        world: int | None = None,
        *,
        rows: tuple[np.ndarray, np.ndarray] | None = None,
        timeout_s: float | None = None,
    ) -> StepProvenance:
        """Which document pieces every row of step ``step`` holds (all B rows, or rank ``rank`` of ``world``'s):
        :mod:`zephon_ray.provenance`. Computed on demand in this process, from the service's recipe: a
        provenance-mode pipeline restored from the nearest durable checkpoint under ``state_dir`` (the one a replay
        would use), checked against the rows the service serves for that step (``rows``: those already read, else
        read here without moving a cursor). Nothing runs in the service's actors but that read; steps asked in
        order reuse the pipeline. A phase the service accepted since this client last looked is picked up (one
        control call) before a disagreement is reported as :class:`~zephon_ray.provenance.ProvenanceError`."""
        from zephon_ray.provenance import ProvenanceError, slice_provenance

        step = as_step(step)
        # check_reader is slice_bounds's own first check (a rank without a world is its ValueError)
        reader = None if rank is None else check_reader(rank, world)
        first = 0 if reader is None else slice_bounds(self.recipe.global_batch_rows, *reader)[0]
        if rows is None:
            served = (
                self.batch(step, timeout_s=timeout_s)
                if reader is None
                else self.slice(step, *reader, track=False, timeout_s=timeout_s)
            )
            rows = (served.tokens, served.positions)
        with self._provenance_lock:
            try:
                full = self._provenance_source().provenance(step, rows=rows, first_row=first)
            except ProvenanceError:
                known = self.recipe.fingerprint
                if self.refresh_recipe().fingerprint == known:  # not a phase added since: the error stands
                    raise
                full = self._provenance_source().provenance(step, rows=rows, first_row=first)
        return slice_provenance(full, rank, world)

    def _provenance_source(self) -> ProvenanceSource:
        from zephon_ray.formats.service_state import read_nearest_checkpoint
        from zephon_ray.provenance import ProvenanceSource

        if self._provenance is None or self._provenance.recipe.fingerprint != self.recipe.fingerprint:
            state_dir, recipe = self.config.state_dir, self.recipe
            lookup = None if state_dir is None else (lambda s: read_nearest_checkpoint(state_dir, recipe, s))
            self._provenance = ProvenanceSource(recipe, checkpoints=lookup, reuse_within=self.config.checkpoint_every)
        return self._provenance

    # ------------------------------------------------------------------ state and control
    def commit(self, step: int) -> dict[str, Any]:
        """Record durably (atomically, under ``state_dir``) that this consumer's trainer checkpoint resumes at
        ``step``. A service restarted from the same ``state_dir`` starts its live window there. This client's
        cursor moves travel with it, so a commit right after a read is never refused as "ahead"."""
        step = as_step(step, "commit step")
        entry: dict[str, Any] = self._call(
            self._coordinator.commit.remote(step, self.consumer, self._own_moves()),
            self.config.read_timeout_s,
            f"the commit of step {step}",
        )
        return entry

    def status(self) -> dict[str, Any]:
        """Producers (pids, lanes, generation), window (held steps and bytes vs. bound), cursors (this client's
        exact, others' as their node readers last reported them), reads (leases, node readers), throughput,
        durable checkpoints and commits, start-up replay and side-replay counters (server/status.py)."""
        report: dict[str, Any] = self._call(
            self._coordinator.status.remote(self._own_moves()), CONTROL_TIMEOUT_S, "status"
        )
        return report

    def rescale(self, producers: int) -> dict[str, Any]:
        """Go to ``producers`` producer actors (must divide the lanes) without changing any batch."""
        self.config.check_lanes(self.recipe, producers)
        result: dict[str, Any] = self._call(
            self._coordinator.rescale.remote(producers),
            self.config.read_timeout_s,
            f"the rescale to {producers} producers",
        )
        self.config = replace(self.config, producers=producers)
        return result

    def refresh_recipe(self) -> Recipe:
        """The recipe the service runs now (one control call): with every phase it accepted while running."""
        recipe: Recipe
        recipe, _ = self._call(self._coordinator.recipe_and_config.remote(), CONTROL_TIMEOUT_S, "the recipe")
        self.recipe = recipe
        return recipe

    def add_phase(self, name: str, start_step: int, weights: dict[str, float]) -> dict[str, Any]:
        """Add mixture phase ``name`` (``weights`` by source name; unnamed sources get 0) from ``start_step`` on to
        the running service, durably (``state_dir``); steps it produced ahead from there are made again under the
        new weights. Refused with one line (ValueError) when a consumer has read ``start_step`` or a later step,
        naming the consumer and the step. Returns ``{"phase", "start_step", "fingerprint", "dropped_steps",
        "dropped_checkpoints", "restart_from", "applied_s"}`` (Coordinator.add_phase;
        tests/test_phases.py::test_a_phase_added_to_a_running_service)."""
        result: dict[str, Any] = self._call(
            self._coordinator.add_phase.remote(name, start_step, dict(weights)),
            self.config.read_timeout_s,
            f"adding phase {name!r}",
        )
        self.recipe = self.recipe.with_phase(name, start_step, weights)
        return result

    def to_dataset(self, steps: Iterable[int]) -> ray.data.Dataset:
        """A lazy ``ray.data.Dataset`` with one row per batch row: ``step``, ``lane``, ``row`` (index in the
        global batch), ``tokens`` and ``positions`` (fixed-size int32 lists), ``digest`` (of the step). For
        notebooks and ``write_parquet`` audits; it does not move this consumer's cursor. Nothing is read until the
        dataset is consumed: Ray Data tasks fetch one step each from the service (``track=False``), so memory
        stays bounded by Ray Data's streaming, not by the number of steps. For a materialised run read the Parquet
        directly: ``MaterializedSource(DIR).to_dataset()``. Test: tests/test_materialized.py."""
        steps = [as_step(step, "to_dataset step") for step in steps]
        if not steps:
            raise ValueError("to_dataset: no steps given")
        return ray.data.from_items([{"step": step} for step in steps]).map_batches(
            # Ray's hint for the function takes the batch alone: it has no room for the fn_kwargs Ray passes too
            _service_step_rows,  # type: ignore[arg-type]
            fn_kwargs={"service": self},
            batch_size=1,
            num_cpus=0.25,
            batch_format="numpy",
        )

    # ------------------------------------------------------------------ helpers
    def _call(self, ref: Any, timeout: float, what: str) -> Any:
        return call(ref, self._where, timeout=timeout, what=what)


def _service_step_rows(batch: dict[str, np.ndarray], service: DataService) -> Any:  # a pyarrow.Table
    """Ray Data task body of ``to_dataset``: the rows of the steps in ``batch`` (read without moving a cursor)."""
    import pyarrow as pa

    from zephon_ray.formats.materialized import batch_table

    return pa.concat_tables([batch_table(service.batch(int(step))) for step in batch["step"]])


def _reconnect(name: str, namespace: str, consumer: str, read_path: str | None = None) -> DataService:
    return DataService.connect(name, namespace=namespace, consumer=consumer, read_path=read_path)
