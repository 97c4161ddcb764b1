"""The Ray data service: producer actors precompute step-keyed global-batch shards for any number of consumers.

Public: :class:`DataService` (the client handle), :class:`StepRefs`, :class:`ServiceConfig`, :class:`ActorResources`,
and the errors. Layout, by the process a module runs in:

    client/   the trainer's, loader's or notebook's process: data_service.py (DataService), node_read_path.py and
              direct_read_path.py (the read paths), step_refs.py (StepRefs, Ray errors mapped), session.py
    server/   inside the actors: coordinator.py, window.py, pool.py, producer.py, replay_scheduler.py,
              replayer.py, node_reader.py, status.py, metrics.py; launch.py (what DataService.start runs)
    here      what both sides load: config.py, errors.py, wire.py (messages and actor names), actor_shells.py (the
              actor classes a client builds handles of), lease_cache.py, ray_internals.py (the Ray fence)

A process that connects and reads imports client/ and the shared modules, never server/. The commands are
zephon_ray/cli/service.py.
"""

from zephon_ray.service.config import ActorResources, ServiceConfig
from zephon_ray.service.errors import (
    FingerprintMismatchError,
    ReplyTimeoutError,
    ServiceError,
    ServiceNotFoundError,
    ShardsLostError,
)

__all__ = [
    "ActorResources",
    "DataService",
    "FingerprintMismatchError",
    "ReplyTimeoutError",
    "ServiceConfig",
    "ServiceError",
    "ServiceNotFoundError",
    "ShardsLostError",
    "StepRefs",
]


def __getattr__(name: str):
    # The client pulls in Ray; importing zephon_ray.formats.service_state (offline `zephon-ray inspect`) must not.
    if name in ("DataService", "StepRefs"):
        from zephon_ray.service.client import data_service

        return getattr(data_service, name)
    raise AttributeError(name)
