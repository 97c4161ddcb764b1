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

Guarantee: ``batch(s)`` and ``slice(s, r, W)`` return exactly the rows of ``GlobalBatchSource(recipe).batch(s)``
(whole, or the rank's contiguous row range) for any s, any W with B % W == 0, any number of producers, and
across producer crashes, rescales and service restarts from the same ``state_dir``.

Reads heal themselves: when the coordinator restarts or the node holding a step's shards dies, ``batch``/``slice``
retry (backoff, at most ``reconnect_timeout_s``), the lost step is replayed, and the caller sees only a delay
(tests/test_service_heal.py, tests/test_service_cluster.py). Reads are idempotent.

Limits:
- Steps inside the live window are served from the object store (zero-copy, read-only arrays). Steps behind it
  are replayed in a Replayer actor (restore of the nearest durable checkpoint + at most K steps for recent ones,
  ``anchor_every`` for old ones; sequential reads are cheap); steps more than ``window`` ahead of the slowest live
  consumer wait for it; reads more than ``max_ahead`` past the head are refused (ValueError).
- ``slice`` moves the cursor by default (the trainer path); ``batch``, ``refs`` and ``to_dataset`` do not unless
  ``track=True``. The default consumer name is unique per Ray job (``job-<id>``).
- Returned arrays are read-only views of shared memory; copy them before writing.
- The cursor of a consumer is keyed by (consumer, rank, world); pass a stable ``consumer`` (e.g. the run id)
  from every rank of one job. A consumer silent for ``consumer_ttl_s`` stops holding the window back;
  ``release()`` does that at once.
- Errors are raised as clean Python exceptions (ValueError, TimeoutError, ServiceError, ...), never as Ray
  wrappers.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
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
from zephon_ray.service.config import DEFAULT_NAME, DEFAULT_NAMESPACE, ActorResources, ServiceConfig
from zephon_ray.service.coordinator import Coordinator
from zephon_ray.service.errors import ServiceError, ServiceNotFoundError, ShardsLostError
from zephon_ray.formats.service_state import check_state_dir
from zephon_ray.source import assemble, pad_token_id

PRODUCER_NAME_INFIX = ".producer."
REPLAYER_NAME_INFIX = ".replayer."
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
    """A Ray error as the clean exception it wraps, or a ServiceError with a one-line reason."""
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
        return TimeoutError(f"service {service}: no reply in time")
    return exc


@dataclass(frozen=True)
class StepRefs:
    """One step's lane shards: Ray object refs (a live step) or values (a step replayed on the side).

    ``lanes[l]`` is lane l's shard or a ref to it; ``None`` for lanes outside the (rank, world) it was asked for
    (the coordinator sends a rank only the refs it needs). Keep the object to keep the shards alive; ``slice`` and
    ``batch`` only fetch the lanes they need.
    """

    step: int
    lanes: list[Any]
    recipe: Recipe
    pad_token_id: int | None

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
                                  "to have it replayed") from None
        except RayTaskError as exc:
            raise _unwrap(exc, "(replay)") from None

    def batch(self) -> GlobalBatch:
        shards = self._fetch(range(self.recipe.lanes))
        return assemble(self.recipe, self.step, dict(zip(range(self.recipe.lanes), shards)))

    def slice(self, rank: int, world: int) -> RankSlice:
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, rank, world)
        return RankSlice.from_lanes(self.step, rank, world, span, self._fetch(span.lanes), self.pad_token_id)


class DataService:
    """A handle on a running data service. Cheap to create; picklable state is just (name, namespace, consumer).

    Create with :meth:`start` (launch a new service) or :meth:`connect` (find a running one by name).
    """

    def __init__(self, coordinator: Any, *, name: str, namespace: str, consumer: str | None = None) -> None:
        self._coordinator = coordinator
        self.name = name
        self.namespace = namespace
        self.consumer = consumer or default_consumer()
        self._started_here = False  # set by start(): only then does leaving a `with` block stop the service
        self._where = f"{name!r} (namespace {namespace!r})"
        recipe, config = self._call(coordinator.recipe_and_config.remote(), timeout=120)
        self.recipe: Recipe = recipe
        self.config: ServiceConfig = config
        self._pad = pad_token_id(recipe)
        self._prefetched: dict[int, Any] = {}

    def __reduce__(self):  # ship to Ray Train workers / tasks as a reconnect, not as actor state
        return (_reconnect, (self.name, self.namespace, self.consumer))

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
        resources: ActorResources | None = None,
        ray_init: bool | dict[str, Any] | None = None,
        **options: Any,
    ) -> "DataService":
        """Start a named, detached service and return a client for it.

        ``state_dir`` holds the durable state; start again with the same ``state_dir`` (and recipe) to resume
        where the newest commit left off. Without ``state_dir`` a fresh temporary directory is used (nothing to
        resume from). ``options`` are further :class:`ServiceConfig` fields (``consumer_ttl_s``,
        ``request_timeout_s``, ``start_step``, ``aggregate_timeout_s``). Invalid settings raise ValueError
        before anything is created or written. ``ray_init`` (``True`` or ``ray.init`` kwargs) starts Ray when
        this process has none; by default the service attaches to a running cluster and never starts one.

        Use it as a context manager to stop the service it started when the block exits, also on an error
        (``tests/test_service_client.py``)::

            with DataService.start("tiny", name="peek", ray_init=True) as svc:
                svc.batch(3)
        """
        if not isinstance(recipe, Recipe):
            recipe = Recipe.from_toml(recipe)
        if state_dir is None:
            state_dir = tempfile.mkdtemp(prefix=f"zephon-ray-{name}-")
        config = ServiceConfig.build(
            recipe, name=name, namespace=namespace, producers=producers, window=window, state_dir=str(state_dir),
            checkpoint_every=checkpoint_every, aggregate_store=aggregate_store,
            aggregate_dir=None if aggregate_dir is None else str(aggregate_dir), run_id=run_id,
            resources=resources or ActorResources(), **options,
        )
        if Path(config.state_dir).exists():
            check_state_dir(recipe, config.state_dir)  # refuse another recipe's state before touching Ray
        _ = recipe.fingerprint  # computed here, shipped with the recipe (the coordinator's node may differ)
        _ensure_ray(ray_init)
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            pass
        else:
            raise ServiceError(f"a service named {name!r} already runs in namespace {namespace!r}; "
                               "connect() to it or stop() it first")
        _kill_orphan_producers(name, namespace)  # left by a coordinator that died without stop()
        res = config.resources
        handle = ray.remote(Coordinator).options(
            name=name, namespace=namespace, lifetime="detached", num_cpus=res.coordinator_num_cpus,
            resources=dict(res.coordinator_resources), max_concurrency=res.coordinator_max_concurrency,
            # Self-healing: Ray restarts a dead coordinator (it reopens state_dir) and re-sends calls in flight.
            max_restarts=config.coordinator_max_restarts, max_task_retries=-1,
        ).remote(recipe, config)
        try:
            ray.get(handle.ready.remote(), timeout=300)
        except Exception as exc:
            ray.kill(handle, no_restart=True)
            _kill_orphan_producers(name, namespace)  # the producers/replayers it had launched
            raise _creation_error(exc, name) from None
        client = cls(handle, name=name, namespace=namespace, consumer=consumer)
        client._started_here = True
        return client

    @classmethod
    def connect(cls, name: str = DEFAULT_NAME, *, namespace: str = DEFAULT_NAMESPACE, consumer: str | None = None,
                timeout_s: float = 60.0) -> "DataService":
        """Find a running service by name. Works from any driver, ``ray job submit`` job, notebook or Ray Train
        worker of the same cluster. Waits up to ``timeout_s`` for a service that is still starting."""
        _ensure_ray()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                handle = ray.get_actor(name, namespace=namespace)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise ServiceNotFoundError(f"no service named {name!r} in namespace {namespace!r}") from None
                time.sleep(0.5)
        return cls(handle, name=name, namespace=namespace, consumer=consumer)

    def stop(self) -> None:
        """Stop the service: producers and coordinator. Durable state stays in ``state_dir``."""
        try:
            ray.get(self._coordinator.stop.remote(), timeout=60)
        except Exception:
            pass  # already dead or wedged: kill it below either way
        ray.kill(self._coordinator, no_restart=True)
        _kill_orphan_producers(self.name, self.namespace)

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
        self._call(self._coordinator.release.remote(self.consumer))

    # ------------------------------------------------------------------ reading
    def refs(self, step: int, *, rank: int | None = None, world: int | None = None, track: bool = False,
             timeout_s: float | None = None) -> StepRefs:
        """Step ``step``'s lane shards as refs; blocks until produced or replayed. ``track=True`` moves this
        consumer's cursor (the trainer path); the default leaves it where it is (inspection, read-ahead). Fetching
        from the returned refs may raise :class:`ShardsLostError`; ``batch``/``slice`` retry that themselves."""
        step = _as_step(step)
        pending = self._prefetched.pop(step, None)
        if pending is not None:
            if track:  # the prefetch did not move the cursor; this read does
                self.touch(step, rank=rank, world=world)
            reply = self._call(pending)
        else:
            reply = self._call(self._coordinator.get_step.remote(step, self.consumer, rank, world, track, timeout_s))
        _, got, lanes = reply
        return StepRefs(got, lanes, self.recipe, self._pad)

    def prefetch(self, steps: Iterable[int], *, rank: int | None = None, world: int | None = None) -> None:
        """Ask for upcoming steps without waiting and without moving the cursor; a later ``slice``/``batch``/
        ``refs`` of one of them uses the answer. Keep the depth below ``window``: a step beyond the live window
        is replayed on the side instead."""
        for step in map(_as_step, steps):
            if step not in self._prefetched:
                self._prefetched[step] = self._coordinator.get_step.remote(step, self.consumer, rank, world, False)
        while len(self._prefetched) > 4 * self.config.window:  # forget the oldest unused prefetches
            self._prefetched.pop(next(iter(self._prefetched)))

    def touch(self, step: int, *, rank: int | None = None, world: int | None = None) -> None:
        """Move this consumer's cursor (for ``rank`` of ``world``) to ``step`` without reading: for loaders
        that read ahead with ``track=False`` and report what the trainer actually consumed. Fire and forget."""
        self._coordinator.touch.remote(_as_step(step), self.consumer, rank, world)

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
        """One read with transparent retries: a restarting coordinator (calls re-sent by Ray, or a fresh handle)
        and lost shards (the step is invalidated and replayed) cost a delay of at most ``reconnect_timeout_s``."""
        deadline = time.monotonic() + self.config.reconnect_timeout_s
        delay = 0.1
        while True:
            try:
                return fetch(self.refs(step, rank=rank, world=world, track=track))
            except ShardsLostError as exc:
                reason = str(exc)
                self._prefetched.clear()
                try:
                    ray.get(self._coordinator.invalidate.remote(_as_step(step)), timeout=30)
                except Exception:  # noqa: BLE001 - the coordinator itself may be restarting: retry below
                    pass
            except ServiceNotFoundError as exc:
                reason = str(exc)
                self._prefetched.clear()
                try:
                    self._coordinator = ray.get_actor(self.name, namespace=self.namespace)
                except ValueError:
                    raise exc from None  # stopped for good: nothing to reconnect to
            except TimeoutError as exc:
                if "no reply in time" not in str(exc):
                    raise
                reason = str(exc)
            if time.monotonic() + delay > deadline:
                raise ServiceError(f"service {self._where}: step {step} still unreadable after "
                                   f"reconnect_timeout_s={self.config.reconnect_timeout_s:.0f}s: {reason}")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ state and control
    def commit(self, step: int) -> dict[str, Any]:
        """Record durably (atomically, under ``state_dir``) that this consumer's trainer checkpoint resumes at
        ``step``. A service restarted from the same ``state_dir`` starts its live window there."""
        return self._call(self._coordinator.commit.remote(_as_step(step, "commit step"), self.consumer))

    def status(self) -> dict[str, Any]:
        """Producers (pids, lanes, generation), window (held steps and bytes vs. bound), cursors, throughput,
        durable checkpoints and commits, start-up replay and side-replay counters."""
        return self._call(self._coordinator.status.remote(), timeout=60)

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


def _kill_orphan_producers(name: str, namespace: str) -> None:
    """Producers and replayers are detached actors named "<service>.producer.<instance>.g<G>.<i>" (".replayer.");
    kill any of this service's that its coordinator could not (it died, or was killed without ``stop()``)."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        actor_name = entry.get("name", "")
        if entry.get("namespace") == namespace and (actor_name.startswith(name + PRODUCER_NAME_INFIX)
                                                    or actor_name.startswith(name + REPLAYER_NAME_INFIX)):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            except Exception:
                pass


def _reconnect(name: str, namespace: str, consumer: str) -> DataService:
    return DataService.connect(name, namespace=namespace, consumer=consumer)


def _creation_error(exc: BaseException, name: str) -> BaseException:
    unwrapped = _unwrap(exc, repr(name))
    if not isinstance(unwrapped, ServiceNotFoundError):
        return unwrapped
    # The coordinator's constructor raised: Ray reports it as a dead actor; keep the original last line.
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    reason = next((ln for ln in reversed(lines) if "Error:" in ln), lines[-1] if lines else repr(exc))
    return ServiceError(f"service {name!r} failed to start: {reason}")
