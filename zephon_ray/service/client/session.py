"""Attach to a Ray cluster, or start a private local one, for the length of a command or a job's driver.

    with ray_session(args.address, private_if_none=True):   # zephon-ray commands, service/*.py job entry points
        ...

Guarantee: the attaching process passes ``runtime_env={"env_vars": storage.worker_environment()}`` (storage
endpoints, region, addressing style, account names, retry settings; never a secret, a profile name or a local
path), so the actors a command starts see the same storage settings as the command. An unreachable address fails
within ``CONNECT_TIMEOUT_S`` naming it (:func:`check_reachable`), before Ray would wait minutes. Before Ray shuts
down, the node read path's background threads stop
(:func:`zephon_ray.service.client.node_read_path.stop_background`). Inside the block, the notices Ray publishes to
the driver (a task retried, a worker died) are printed on stderr, not on stdout as Ray prints them, so a command's
stdout is its output alone.
Limits: a Ray this process already runs is used as it is and left running; a private cluster lives as long as the
``with`` block, and its actors go with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from zephon_ray.service.ray_internals import bootstrap_address, driver_notices_on_stderr, init_private_local

CONNECT_TIMEOUT_S = 10.0
"""How long attaching to a cluster may take to find its head answering; Ray itself waits minutes."""


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise one line (``ConnectionError``) unless the cluster ``address`` names (``auto``: as Ray resolves it)
    accepts a TCP connection within ``timeout_s``. A cluster that is there costs one connect."""
    import socket

    target = bootstrap_address(address)
    if target is None:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConnectionError(
            f"no Ray cluster answers at {target} (address {address!r}): {reason} within "
            f"{timeout_s:g}s; start one (`ray start --head`) or pass the head's address"
        ) from None


def attach(address: str | None, **init_kwargs: Any) -> None:
    """``ray.init`` attached to ``address`` (default: ``RAY_ADDRESS``, else the running cluster), after checking
    within ``CONNECT_TIMEOUT_S`` that a cluster answers there."""
    import ray

    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(target)
    ray.init(address=target, **init_kwargs)


def starts_private_cluster(address: str | None, *, private_if_none: bool) -> bool:
    """Whether :func:`ray_session` with these arguments starts a private local Ray (not yet initialised here, no
    address given, none in ``RAY_ADDRESS``)."""
    import ray

    return not ray.is_initialized() and address is None and private_if_none and not os.environ.get("RAY_ADDRESS")


@contextlib.contextmanager
def ray_session(address: str | None, *, private_if_none: bool) -> Iterator[None]:
    """Attach to ``address`` (or the ambient cluster), or start a private local Ray when asked to. Inside it, Ray's
    notices to this driver go to stderr: a command's stdout holds its output alone (``--json`` is parsed)."""
    import ray

    if ray.is_initialized():
        with driver_notices_on_stderr():
            yield
        return
    from zephon_ray import storage

    temp_dir = None
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    env = storage.worker_environment()
    # Inside a `ray job submit` job, Ray merges ray.init's runtime_env with the job's and refuses a key set in both:
    # the job's own settings win, ours only fill in what it lacks.
    injected = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if injected:
        try:
            job_env = (json.loads(injected).get("runtime_env") or {}).get("env_vars") or {}
        except (ValueError, AttributeError):
            job_env = {}
        env = {k: v for k, v in env.items() if k not in job_env}
    if env:  # the job's runtime_env: every actor and task it starts (detached ones too) gets these settings
        quiet["runtime_env"] = {"env_vars": env}
    if starts_private_cluster(address, private_if_none=private_if_none):
        temp_dir = tempfile.mkdtemp(prefix="zephon-ray-local-", dir="/tmp")
        init_private_local(temp_dir, num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, **quiet)
    else:
        attach(address, **quiet)
    try:
        with driver_notices_on_stderr():
            yield
    finally:
        from zephon_ray.service.client.node_read_path import stop_background

        stop_background()  # no thread of ours may call into Ray after shutdown: Ray would exit the process with 1
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
