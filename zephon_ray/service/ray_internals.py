"""The one place the package touches Ray internals, fenced: no other module of the package uses a private Ray name
(a test scans them), and a test of what each one returns fails loudly when a Ray upgrade moves them.

- :func:`owner_worker_id`: the worker that owns an object, from the owner address Ray keeps in every ObjectRef
  (``ObjectRef.owner_address()``, a serialized ``ray.core.generated.common_pb2.Address``). Used by ``status()`` to
  count who owns the shards the coordinator routes (never the coordinator itself), and by tests and benchmarks.
- :func:`object_locations`: nodes holding a copy and the object's size in the object store
  (``ray.experimental.get_object_locations``; an object inlined into a process's memory has no node).
- :func:`init_private_local`: a private local Ray whose session files live in a directory of ours
  (``ray.init(_temp_dir=...)``, a private keyword).
- :func:`memory_store`: entries and bytes in this process's core-worker memory store
  (``ray._private.worker.global_worker.core_worker``), the count that grew by one per released object before the
  held refs of server/producer.py and server/node_reader.py (docs/benchmarks.md "Memory over a long run"); the
  actors' ``memory()`` report it.
- :func:`bootstrap_address`: the ``host:port`` that ``ray.init(address=...)`` would connect to (``auto`` resolved
  the way Ray resolves it: ``RAY_ADDRESS``, then the newest ``ray start`` of this machine), so that it can be probed
  before Ray waits minutes for a cluster that is not there.
- :func:`free_resources_per_node`: what each live node has free now, from the GCS
  (``ray._private.state.available_resources_per_node``, a DeveloperAPI); the public ``ray.available_resources`` sums
  the nodes, which cannot tell whether an actor fits on one of them. The pool asks it before it recycles a group.
- :func:`driver_notices_on_stderr`: the notices a cluster publishes to a driver (a task retried, a worker died), which
  Ray 2.60's driver prints on stdout whatever ``log_to_driver`` says (``ray._private.worker.listen_error_messages``
  calls ``print_to_stdstream`` with ``is_err`` False), printed on stderr instead, so that a command's stdout holds
  only its output (``zephon-ray status --json | jq``).

Shared by both sides (client/session.py, server/status.py, the actors' ``memory()``); a process that only connects
and reads never imports it. Limit: it follows the Ray version the package pins; each name may move in another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def owner_worker_id(ref: Any) -> str:
    """Hex worker id of the process that owns ``ref``."""
    from ray.core.generated import common_pb2

    # protoc's generated classes carry no type information (no stubs shipped with Ray)
    return common_pb2.Address.FromString(ref.owner_address()).worker_id.hex()  # type: ignore[attr-defined]


def object_locations(refs: list[Any]) -> dict[Any, dict[str, Any]]:
    """``{ref: {"node_ids": [...], "object_size": bytes}}`` for ``refs`` (Ray's object directory), asked of one
    owner at a time and without a timeout. Ray 2.60's ``CoreWorker::GetLocationFromOwner`` counts its pending
    requests up while it sends them, so when one owner replies before the next owner's request is counted, its
    promise is set twice and the calling process aborts ("std::future_error: Promise already satisfied"; it killed
    a pytest worker in tests/test_service.py::test_coordinator_owns_no_shard_bytes, whose refs have two owners).
    Its ``timeout_ms`` is also waited as microseconds. A dead owner fails its request, which ends the wait."""
    import ray.experimental

    by_owner: dict[str, list[Any]] = {}
    for ref in refs:
        by_owner.setdefault(owner_worker_id(ref), []).append(ref)
    found: dict[Any, dict[str, Any]] = {}
    for owned in by_owner.values():
        found.update(ray.experimental.get_object_locations(owned, timeout_ms=-1))
    return found


def memory_store() -> dict[str, int]:
    """``{"entries": n, "bytes": b}`` of this process's core-worker in-process memory store."""
    import ray

    cw = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]  # set by ray.init, untyped
    return {"entries": int(cw.get_memory_store_size()), "bytes": int(cw.get_local_memory_store_bytes_used())}


def free_resources_per_node() -> list[dict[str, float]]:
    """Each live node's free resources (``{"CPU": 1.25, "memory": ..., "head": 0.99}``): a hint, stale as soon as a
    task starts or ends. A GCS request with no deadline of its own: callers bound it (server/pool.py)."""
    from ray._private import state

    return [dict(free) for free in state.available_resources_per_node().values()]


def bootstrap_address(address: str) -> str | None:
    """``host:port`` of the cluster ``address`` names (None: Ray would start a local one). Ray's own resolution,
    ``ray._private.services.canonicalize_bootstrap_address``; a ``ray://`` client address is returned as written."""
    if address.startswith("ray://"):
        return address[len("ray://") :]
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(address)


def init_private_local(temp_dir: str, **kwargs: Any) -> Any:
    """``ray.init`` of a new local Ray (never an existing cluster) with its session files under ``temp_dir``."""
    import ray

    return ray.init(address="local", _temp_dir=temp_dir, **kwargs)


@contextmanager
def driver_notices_on_stderr() -> Iterator[None]:
    """While the block runs, Ray's notices to this driver are printed on stderr, not stdout. Ray's listener thread
    looks ``print_to_stdstream`` up in its module at each notice, so replacing it there is enough; worker logs
    (``log_to_driver``) keep the function Ray bound at ``ray.init``."""
    import ray._private.worker as ray_worker

    printer = ray_worker.print_to_stdstream

    def on_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        printer({**data, "is_err": True}, ignore_prefix)

    ray_worker.print_to_stdstream = on_stderr
    try:
        yield
    finally:
        ray_worker.print_to_stdstream = printer
