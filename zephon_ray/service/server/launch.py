"""Launching a service: the checks that need I/O, then the coordinator actor. Only ``DataService.start`` (and its
``stop``) import it, when called, so a client that connects or reads never loads server/.

    prepare(recipe, config)  state_dir of this recipe? materialised prefix usable?   (files only, before Ray)
    launch(recipe, config)   kill orphans of a dead incarnation, create the named detached coordinator, ready()
    stop(handle, name, ns)   stop the coordinator and every helper it launched

Guarantee: ``prepare`` refuses a ``state_dir`` of another recipe (``FingerprintMismatchError``) and a
``materialized_dir`` that is missing, damaged, of another recipe or without its end checkpoint (ValueError naming
it) before anything is created or written. ``launch`` leaves nothing behind when the service fails to start: the
coordinator and every helper it launched are killed and the error is one ``ServiceError`` naming the reason.
Limit: it runs in the starting process (a driver, a job, a notebook), not in an actor; the coordinator it creates
is detached and outlives that process until ``stop``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from zephon_ray import storage
from zephon_ray.errors import best_effort
from zephon_ray.formats.service_state import check_state_dir
from zephon_ray.recipe import Recipe
from zephon_ray.service.config import ServiceConfig
from zephon_ray.service.errors import ServiceError
from zephon_ray.service.wire import kill_named

log = logging.getLogger("zephon_ray")

READY_TIMEOUT_S = 300


def check_materialized_dir(recipe: Recipe, path: str | os.PathLike) -> str:
    """The absolute path of a materialised directory usable for ``recipe`` (ValueError naming what is wrong)."""
    from zephon_ray.service.server.replay_scheduler import read_materialized_prefix

    path = storage.location(path).uri  # absolute (or a URI): the coordinator and replayers resolve it elsewhere
    read_materialized_prefix(recipe, path)
    return path


def prepare(recipe: Recipe, config: ServiceConfig) -> ServiceConfig:
    """The I/O checks of a start, before Ray is touched; returns the config with absolute paths. Storage that does
    not answer within ``storage.START_BUDGET_S`` (an unresolvable endpoint, an outage) is one line, at once."""
    with storage.first_contact():
        if config.state_dir is not None:
            check_state_dir(recipe, config.state_dir)  # a path or a URI; an absent state_dir is fine
        if config.materialized_dir is not None:
            config = replace(config, materialized_dir=check_materialized_dir(recipe, config.materialized_dir))
        _ = recipe.fingerprint  # computed here, shipped with the recipe (the coordinator's node may differ)
    return config


def launch(recipe: Recipe, config: ServiceConfig) -> Any:
    """Start the coordinator of ``config.name`` and wait until it is ready; returns its actor handle."""
    import ray

    from zephon_ray.service.actor_shells import CoordinatorActor
    from zephon_ray.service.wire import CONTROL, CONTROL_CONCURRENCY, READS

    name, namespace = config.name, config.namespace
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise ServiceError(
            f"a service named {name!r} already runs in namespace {namespace!r}; connect() to it or stop() it first"
        )
    kill_named(name, namespace)  # helpers left by a coordinator that died without stop()
    res = config.resources
    groups = {READS: res.coordinator_max_concurrency, CONTROL: CONTROL_CONCURRENCY}
    handle = (
        # Ray's overloads of ray.remote list no `concurrency_groups` (it is a documented option of an actor class)
        ray.remote(concurrency_groups=groups)(CoordinatorActor)  # type: ignore[call-overload]
        .options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            num_cpus=res.coordinator_num_cpus,
            resources=dict(res.coordinator_resources),
            max_concurrency=res.coordinator_max_concurrency,
            # Self-healing: Ray restarts a dead coordinator (it reopens state_dir) and re-sends calls in flight.
            max_restarts=config.coordinator_max_restarts,
            max_task_retries=-1,
        )
        .remote(recipe, config)
    )
    try:
        ray.get(handle.ready.remote(), timeout=READY_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure to start: stop what started, then one line
        stop(handle, name, namespace)
        raise _start_error(exc, name) from None
    return handle


def stop(handle: Any, name: str, namespace: str) -> None:
    """Stop the coordinator (it stops its helpers), kill it and any helper left over."""
    import ray

    with best_effort(log, "already dead or wedged: kill it below either way"):
        ray.get(handle.stop.remote(), timeout=60)
    with best_effort(log, "already dead"):
        ray.kill(handle, no_restart=True)
    kill_named(name, namespace)


def _start_error(exc: BaseException, name: str) -> BaseException:
    from ray.exceptions import GetTimeoutError, RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), Exception):
        return exc.cause
    if isinstance(exc, GetTimeoutError):
        return ServiceError(f"service {name!r} did not become ready within {READY_TIMEOUT_S}s")
    return ServiceError(
        f"service {name!r} failed to start: {type(exc).__name__}: "
        f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    )
